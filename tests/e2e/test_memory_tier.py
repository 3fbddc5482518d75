"""The memory tier (issue 35): 2-rank torchrun runs with ``checkpoint.memory_every_steps = 3`` and
``pimm launch --max-restarts 1`` whose rank 1 is SIGKILLed, recovered by torchrun's restart.

Five real launches: the uninterrupted run; rank 1 killed by a fail point in the
middle of writing its copy of step 6 (the previous complete copy, step 3, is used); rank 1 killed by a
fail point at step 8 after a disk save at step 7 (the disk ``last`` is newer than memory: it is used);
rank 1 paused at step 8 (a fail point), its own copy of step 6 removed, then ``kill -9`` from this test
(recovered from memory at step 6, its state sent by its buddy rank 0, though the disk ``last`` is at
step 6 too: a tie goes to memory); the same with both copies of its state removed (its own and its
buddy's: recovered from the disk ``last`` of step 8, said in one line). Each ends with weights bitwise
equal to the uninterrupted run's, and no memory left behind; between a kill and the restart,
status.json says ``restarting``, not ``failed``. The copies live under ``$PIMM_SHM_ROOT``
(a directory of the test, /dev/shm by default).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _helpers import DIGITS, REPO, clean_env, hang_s, memory_holds_only, memory_index, wait_while_running

OVERRIDES = ("train.epochs=1", "model.hidden=16", "train.log_every_steps=5", "checkpoint.memory_every_steps=3",
             "checkpoint.every_epochs=1", "data.num_workers=0")
KILLED = {"PIMM_FAILPOINT_RANK": "1", "PIMM_FAILPOINT_RESTART": "0"}


def _start(root: Path, name: str, env: dict[str, str], *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(DIGITS), "--run.root", str(root),
            "--run.name", name, "--run.no-timestamp", "--nproc-per-node", "2", "--max-restarts", "1",
            "--", *OVERRIDES, *extra]
    return subprocess.Popen(args, cwd=REPO, env={**clean_env(), "PIMM_SHM_ROOT": str(root / "shm"), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=hang_s(300))
    assert proc.returncode == 0, out[-4000:]
    return out



def _pause_then_kill(root: Path, name: str, *remove: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """A launch whose rank 1 pauses at step 8; once both ranks hold their copies of step 6, the copies
    matching ``remove`` (globs under the run's shared memory) are deleted and rank 1 is ``kill -9``ed."""
    gate = root / f"gate-{name}"
    gate.mkdir()
    proc = _start(root, name, {**KILLED, "PIMM_FAILPOINT": "memory.step@8=pause", "PIMM_FAILPOINT_DIR": str(gate)},
                  *extra)
    run = root / "digits" / name
    wait_while_running(lambda: (gate / "memory.step.reached.8").exists(), "rank 1 paused at step 8", proc)
    wait_while_running(lambda: memory_holds_only(run, root / "shm", name, 6, remove),
                       "both ranks' copies of step 6, and no older one", proc)
    shm = next((root / "shm").glob(f"pimm-{name}-*"))
    doomed = [p for pattern in remove for p in shm.glob(pattern)]
    assert len(doomed) == 2 * len(remove), doomed  # each copy with its sidecar
    for path in doomed:
        path.unlink()
    os.kill(memory_index(run, 1)["pid"], signal.SIGKILL)
    # between the kill and the restarted rank 0's first status: what status.json says meanwhile
    wait_while_running(lambda: _state(run) in ("restarting", "failed") or "recovery" in _status(run), "the state after the kill",
              proc)
    (root / f"state-{name}.json").write_text(json.dumps({"status": _status(run), "launcher": proc.pid}))
    return proc


def _state(run: Path) -> str | None:
    try:
        return _status(run)["state"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("memtier")
    (root / "shm").mkdir()
    out = {}
    ref = _start(root, "ref", {})
    # the 3rd copy rank 1 writes: its own of step 6 (1st: its own of step 3, 2nd: rank 0's of step 3)
    mid_copy = _start(root, "mid_copy", {**KILLED, "PIMM_FAILPOINT": "memory.copy_writing@3=kill"})
    # killed at step 8: the disk `last` of step 7 is newer than any step in memory
    newer = _start(root, "newer", {**KILLED, "PIMM_FAILPOINT": "memory.step@8=kill"}, "checkpoint.every_steps=7")
    out["ref"], out["mid_copy"], out["newer"] = _finish(ref), _finish(mid_copy), _finish(newer)
    # rank 1's own copy lost: rank 0 sends the one it holds (the disk `last` at the same step: memory is
    # taken); both lost: the disk `last` of step 8
    killed = _pause_then_kill(root, "killed", "1/step_*/rank_1.*", extra=("checkpoint.every_steps=6",))
    lost = _pause_then_kill(root, "lost", "1/step_*/rank_1.*", "0/step_*/rank_1.*", extra=("checkpoint.every_steps=4",))
    out["killed"], out["lost"] = _finish(killed), _finish(lost)
    out["root"] = root
    return out


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model" / "last" / "weights.pth", weights_only=True)["state_dict"]


def _status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


def _recoveries(run: Path) -> list[dict]:
    prov = json.loads((run / "provenance.json").read_text())
    return [e for e in prov["starts"] if e.get("kind") == "recovery"]


@pytest.mark.parametrize("name, tier, step", [("killed", "memory", 6), ("mid_copy", "memory", 3),
                                              ("newer", "disk", 7), ("lost", "disk", 8)])
def test_a_killed_rank_is_recovered_and_the_run_ends_bitwise_equal(runs, name, tier, step):
    root = runs["root"]
    run = root / "digits" / name
    status = _status(run)
    assert status["state"] == "finished" and status["step"] == 23
    recovery = status["recovery"]
    assert recovery["tier"] == tier and recovery["restart"] == 1
    assert recovery["step"] == step
    (entry,) = _recoveries(run)
    assert entry["tier"] == tier and entry["step"] == recovery["step"] and entry["restart"] == 1
    log = (run / "train.log").read_text()
    line = f"recovered from {tier} at step {recovery['step']} (restart 1"
    assert log.count(line) == 1, log[-3000:]
    assert line in runs[name]
    assert recovery["message"] == entry["message"] and entry["message"] in log  # which tier and why
    if name == "killed":  # its own copy removed: the copy rank 0 held was sent to it, and checked
        assert f"{line}; rank 1 from its buddy rank 0; disk at step 6 too: memory is faster)" in log
        assert entry["from_buddy"] == {"1": 0} and entry["read_from"] == {"0": 0, "1": 0}
        assert entry["disk_step"] == 6
    if name == "mid_copy":  # killed in the middle of its copy of step 6: every rank's step 3
        assert f"{line}; every rank from its own copy; nothing on disk)" in log
    if name == "newer":  # a disk save (step 7) after the newest memory snapshot (3 or 6, its round in flight)
        assert re.search(r"\(restart 1; newer than the newest step every rank can reach in memory, [36]\)", log)
    if name == "lost":  # both copies of rank 1 were removed: one line says why the disk was used
        assert "(restart 1; no step every rank can reach in memory (rank 1 has no copy))" in log
    ref, got = _weights(root / "digits" / "ref"), _weights(run)
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref), "the recovered run left the uninterrupted trajectory"


@pytest.mark.parametrize("name", ["killed", "lost"])
def test_a_failed_rank_with_a_restart_left_says_restarting_not_failed(runs, name):
    """Rank 1 killed with one restart left: rank 0's collective fails, and the run is ``restarting`` (the
    launcher's pid named as the process alive meanwhile), never ``failed``; the restart then runs it on."""
    seen = json.loads((runs["root"] / f"state-{name}.json").read_text())
    between = seen["status"]
    assert between["state"] == "restarting", between
    assert between["agent_pid"] == seen["launcher"] and between["error"]  # (torchrun's agent runs in the launcher)
    log = (runs["root"] / "digits" / name / "train.log").read_text()
    assert "torchrun restarts them (1 restart left)" in log


def test_the_memory_tier_is_removed_when_the_run_ends(runs):
    root = runs["root"]
    assert _status(root / "digits" / "ref")["memory_step"] == 21  # the newest mid-epoch multiple of 3
    assert "recovery" not in _status(root / "digits" / "ref")
    assert list((root / "shm").iterdir()) == []  # every run's shared memory is gone
    for name in ("ref", "killed", "mid_copy", "newer", "lost"):
        assert not (root / "digits" / name / "memory").exists()


def test_a_stopped_run_removes_its_memory_and_the_next_run_removes_a_dead_runs(tmp_path, monkeypatch):
    """In this process, one rank: a killed run's tier (its lock free, its launcher gone) is removed by the
    next run's start; the run's own copies exist while it trains and are gone once it stopped."""
    from pimm_core import Trainer, load_config
    from pimm_core.checkpoint.memory.store import RankStore

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("PIMM_SHM_ROOT", str(shm))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = RankStore(tmp_path / "killed-run", 0)
    left.open(agent_pid=dead.pid)
    left.write(0, 3, b"state of a run that was killed")
    left.close(remove=False)  # (what a kill -9 leaves: the lock free, the copies in place)

    run = tmp_path / "run"
    trainer = Trainer(load_config(DIGITS, list(OVERRIDES)), run_dir=run)
    seen = {}

    def at_seven(tr) -> None:
        if tr.state.global_step == 7:
            tr.checkpointer.memory.wait()  # the round of step 6 done
            seen["copies"] = sorted(p.name for p in shm.glob("pimm-run-*/0/step_*/*"))
            seen["index"] = memory_index(run, 0)
            seen["left"] = left.root.exists()
            tr.stop.request("budget")

    trainer.callbacks.append(at_seven)
    state = trainer.train(checkpoint_dir=run / "model")
    assert state.stop_reason == "budget" and state.global_step == 7
    assert seen["copies"] == ["rank_0.json", "rank_0.pt"] and seen["index"]["own"]["step"] == 6
    assert seen["index"]["buddy"] is None  # one rank: no buddy
    assert "no buddy copy: one rank" in (run / "train.log").read_text()
    assert not seen["left"] and "the memory tier of a run that is gone" in (run / "train.log").read_text()
    assert list(shm.iterdir()) == [] and not (run / "memory").exists()
    assert _status(run)["state"] == "stopped"


def test_shared_memory_that_cannot_be_written_is_one_line(tmp_path):
    from _helpers import pimm_here

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    result = pimm_here("launch", "--train.config", str(DIGITS), "--run.root", str(tmp_path), "--run.name", "r",
                       "--run.no-timestamp", "--", *OVERRIDES, env={"PIMM_SHM_ROOT": str(not_a_dir)})
    assert result.returncode != 0
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "cannot write the memory tier" in errors[0] and "PIMM_SHM_ROOT" in errors[0]
    assert "Traceback" not in result.stderr
