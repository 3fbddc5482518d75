"""Signals at any moment, records that are data, a full disk outside a save (issue 21).

Real processes and real signals. A stop during start-up is delivered at a named moment by
the fail-point hook (``PIMM_FAILPOINT=<point>=sigterm``: the process sends itself the
signal exactly there, so the test never races start-up):

- ``launch.starting`` (``pimm launch`` has only parsed its config) and
  ``launch.importing_trainer`` (the slow import of torch and the trainer, where the signal
  used to be ignored): the run ends at once with exit 0, ``status.json`` ``stopped`` with
  the signal as stop reason, no step trained, nothing saved; a resumed run's ``last`` is
  untouched; with two ranks, one rank's signal stops both.
- SIGHUP (the terminal closed) during training is a clean stop like SIGTERM.
- ``pimm resume`` never imports code from the run directory, even where its recorded
  ``code_search_path`` points there.
- ENOSPC writing ``status.json`` (the heartbeat) is one warning; the run goes on and
  records its state when a write succeeds; its checkpoints verify. ENOSPC at start-up
  (``config.toml``) is one ``error:`` line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import DIGITS, REPO, clean_env, describe, hang_s, launch, pimm, pimm_here, read_json, read_jsonl
from conftest import TrainedRun

from pimm_core.checkpoint.select.selection import list_candidates


def _env(**kw: str) -> dict[str, str]:
    return {**clean_env(), **kw}


def _launch_args(root: Path, name: str, *overrides: str) -> list[str]:
    return ["launch", "--train.config", str(DIGITS), "--run.root", str(root), "--run.name", name, "--run.no-timestamp",
            "--", *overrides]


def _train_records(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if r.get("split") == "train"]


def _stopped_at_start(run: Path, result, sig: str, *, step: int = 0, records: list[dict] | None = None) -> None:
    """The run ended at once: stopped at ``step`` for ``sig``, no training record added."""
    assert result.returncode == 0 and "Traceback" not in result.stderr, describe(result)
    assert f"stopped (signal:{sig}) before the first step: nothing was trained or saved" in result.stdout
    status = read_json(run / "status.json")
    assert (status["state"], status["stop_reason"], status["step"]) == ("stopped", f"signal:{sig}", step)
    assert _train_records(run) == (records or [])
    assert [e["kind"] for e in read_json(run / "provenance.json")["starts"]][-1] == "stop"


@pytest.mark.parametrize("moment,sig", [("launch.starting", "SIGTERM"), ("launch.importing_trainer", "SIGTERM"),
                                        ("launch.importing_trainer", "SIGINT")])
def test_a_stop_signal_during_startup_ends_the_run_cleanly(tmp_path: Path, moment: str, sig: str) -> None:
    result = launch(tmp_path, "s", "train.epochs=2", env=_env(PIMM_FAILPOINT=f"{moment}={sig.lower()}"))
    run = tmp_path / "digits" / "s"
    _stopped_at_start(run, result, sig)
    assert list_candidates(run / "model") == []  # nothing saved


def test_a_stop_signal_while_a_resume_starts_leaves_last_untouched(trained_run: TrainedRun, tmp_path: Path) -> None:
    run = trained_run.copy_to(tmp_path)
    manifest, records = (run / "model" / "last" / "manifest.json").read_bytes(), _train_records(run)
    result = pimm("resume", str(run), "--", "train.epochs=4",
                  env=_env(PIMM_FAILPOINT="launch.importing_trainer=sigterm"))
    _stopped_at_start(run, result, "SIGTERM", step=135, records=records)
    assert (run / "model" / "last" / "manifest.json").read_bytes() == manifest
    assert not (run / "model" / "last.prev").exists()


def test_one_ranks_signal_during_startup_stops_both_ranks(tmp_path: Path) -> None:
    result = launch(tmp_path, "s", "train.epochs=2", nproc=2,
                    env=_env(PIMM_FAILPOINT="launch.importing_trainer=sigterm", PIMM_FAILPOINT_RANK="1"))
    _stopped_at_start(tmp_path / "digits" / "s", result, "SIGTERM")


def test_sighup_during_training_is_a_clean_stop(tmp_path: Path) -> None:
    run = tmp_path / "digits" / "h"
    cmd = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(DIGITS), "--run.root", str(tmp_path),
           "--run.name", "h", "--run.no-timestamp", "--", "train.epochs=200", "train.log_every_steps=1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + hang_s(240)
        while not ((run / "status.json").exists() and (read_json(run / "status.json").get("step") or 0) >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never took a step"
            time.sleep(0.05)
        proc.send_signal(signal.SIGHUP)
        out, err = proc.communicate(timeout=hang_s(240))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, f"{proc.returncode}\n{out}\n{err}"
    status = read_json(run / "status.json")
    assert (status["state"], status["stop_reason"]) == ("stopped", "signal:SIGHUP")
    last = read_json(run / "model" / "last" / "manifest.json")
    assert last["step"] == status["step"] >= 1
    verify = pimm_here("checkpoints", "verify", str(run))
    assert verify.returncode == 0 and "last: ok" in verify.stdout, describe(verify)


def test_resume_runs_no_code_from_the_run_directory(trained_run: TrainedRun, tmp_path: Path) -> None:
    """A module planted in the run directory, and the recorded search path pointed at it: a
    resume of a config naming only built-ins imports nothing from there."""
    run = trained_run.copy_to(tmp_path)
    marker = tmp_path / "planted-code-ran"
    for where in (run / "lib" / "sklearn", run / "sklearn", run / "lib" / "numpy"):
        where.mkdir(parents=True)
        (where / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write({str(where)!r} + '\\n')\n")
    prov = read_json(run / "provenance.json")
    prov["starts"][-1]["code_search_path"] = [str(run / "lib"), str(run), *prov["starts"][-1]["code_search_path"]]
    (run / "provenance.json").write_text(json.dumps(prov))
    for args in (["--dry-run", "--", "train.epochs=4"], ["--", "train.epochs=4"]):
        result = pimm("resume", str(run), *args)
        assert result.returncode == 0, describe(result)
        assert not marker.exists(), marker.read_text()
    assert read_json(run / "status.json")["state"] == "finished"


def _one_warning(result) -> None:
    assert result.returncode == 0 and "Traceback" not in result.stderr, describe(result)
    assert (result.stdout + result.stderr).count("warning: cannot write status.json (No space left on device)") == 1


# (status.json's write 1 is `running` at the start, 2 the first logged step's heartbeat; the writer
# thread writes the next ones at most 4 times a second, so a short run may write none before `finished`)
@pytest.mark.parametrize("spec", ["status.write@2=enospc", "status.write@2+=enospc"], ids=["once", "stays-full"])
def test_a_full_disk_at_the_heartbeat_is_one_warning(tmp_path: Path, spec: str) -> None:
    # in this process (the fail point raises; the heartbeat's writer is the same code as in a subprocess)
    result = pimm_here(*_launch_args(tmp_path, "d", "train.epochs=2"), failpoint=spec)
    _one_warning(result)
    run = tmp_path / "digits" / "d"
    status = read_json(run / "status.json")
    if spec.endswith("+=enospc"):
        assert status["state"] == "running" and status["step"] < 90  # the last heartbeat that could be written
    else:
        assert (status["state"], status["step"]) == ("finished", 90)  # recorded once the write worked again
        assert "status.json written again" in (run / "train.log").read_text()
    verify = pimm_here("checkpoints", "verify", str(run))
    assert verify.returncode == 0 and "last: ok" in verify.stdout, describe(verify)
    assert read_json(run / "model" / "last" / "manifest.json")["step"] == 90


def test_a_full_disk_at_startup_is_one_error_line(tmp_path: Path) -> None:
    result = pimm_here(*_launch_args(tmp_path, "d", "train.epochs=1"), failpoint="atomic.written@1=enospc")
    assert result.returncode == 1 and "Traceback" not in result.stderr, describe(result)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: No space left on device writing "), lines


def test_a_stop_signal_before_torchruns_agent_starts_the_ranks_is_not_lost(tmp_path: Path) -> None:
    """Seen: a SIGTERM to the launcher after its start-up's last look at the stop request and before
    torchrun's agent handles the signals (the rendezvous) was recorded and never acted on: the agent started
    the ranks and they trained to the end. Now the launch ends there, as one caught before it."""
    result = launch(tmp_path, "s", "train.epochs=2", nproc=2, env=_env(PIMM_FAILPOINT="launch.agent_starting=sigterm"))
    assert result.returncode == 0 and "Traceback" not in result.stderr, describe(result)
    assert "stopped (signal:SIGTERM) before the ranks started: nothing was trained or saved" in result.stdout, \
        describe(result)
    assert "done:" not in result.stdout and not (tmp_path / "digits" / "s").exists(), describe(result)
