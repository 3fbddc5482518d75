"""Readers beside a live writer: a real ``pimm launch`` saving every step, and in this process
``pimm export``, ``pimm checkpoints ls/latest/verify``, ``load_weights`` and the console's reader
in a loop. Each must see one checkpoint generation whole: an export's ``export.json`` step and
its tensors come from the same save (compared with that step's ``iter_<step>.pth`` snapshot),
verify never calls the healthy ``last`` corrupt or missing, ``ls``/``latest`` always select a
checkpoint, and nothing raises. A CLI reader may instead say "changed while reading; try again"
with exit code 75 (saves overtook each of its tries): never another failure.

The loop ends after a fixed number of saves completed (counted by their snapshots), not after
a time; the writer is then stopped with SIGTERM and must exit 0.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import torch
from safetensors.torch import load_file

from _helpers import DIGITS, REPO, clean_env, pimm, pimm_here
from pimm_core import load_weights
from pimm_core.checkpoint.export.model_dir import export
from pimm_core.config import config_from_dict
from pimm_core.data.loaders import build_datasets
from pimm_core.errors import CHANGED_EXIT_CODE
from pimm_core.models import build_model
from pimm_core.watch.candidates import verify_checkpoint
from pimm_core.watch.snapshot import RunReader

SAVES = 60  # saves the writer completes while the readers loop
WAIT_S = 120  # generous: only catches a hang


def _wait_for(what: str, ready, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        assert proc.poll() is None, f"the writer exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {WAIT_S} s"
        time.sleep(0.05)


def _snapshot_weights(model: Path, step: int, proc: subprocess.Popen) -> dict[str, torch.Tensor]:
    # iter_<step>.pth is written right after `last` (its sidecar last of all)
    _wait_for(f"iter_{step}.pth", lambda: (model / f"iter_{step}.pth.json").is_file(), proc)
    return torch.load(model / f"iter_{step}.pth", weights_only=True)["state_dict"]


def _step_of_last(model: Path) -> int | None:
    for name in ("last", "last.prev"):
        try:
            return json.loads((model / name / "manifest.json").read_text())["step"]
        except (OSError, ValueError):
            continue
    return None


def test_readers_beside_a_run_saving_every_step(tmp_path: Path) -> None:
    root = tmp_path / "exp"
    run = root / "digits" / "live"
    model_dir = run / "model"
    args = ["launch", "--train.config", str(DIGITS), "--run.root", str(root), "--run.name", "live",
            "--run.no-timestamp", "--", "train.epochs=300", "checkpoint.every_steps=1", "checkpoint.keep_iter=100000",
            "eval.every_epochs=50"]
    proc = subprocess.Popen([sys.executable, "-m", "pimm_core.cli", *args], cwd=REPO, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    problems: list[str] = []
    retries: list[str] = []  # answers "changed while reading; try again" (exit 75): allowed, counted
    counts = dict.fromkeys(("export", "export_cli", "verify", "ls", "latest", "load_weights", "console"), 0)
    try:
        _wait_for("first complete save", lambda: (model_dir / "last" / ".complete").is_file(), proc)
        cfg = config_from_dict(tomllib.loads((run / "config.toml").read_text()))
        data = build_datasets(cfg.data)
        net = build_model(cfg.model, data.in_features, data.in_shape, data.num_classes)
        reader = RunReader(run)
        saves_at_start = len(list(model_dir.glob("iter_*.pth.json")))
        i = 0
        while len(list(model_dir.glob("iter_*.pth.json"))) < saves_at_start + SAVES:
            i += 1
            for name, read in (("export", lambda: _export(model_dir, tmp_path / "ex" / str(i), proc)),
                               ("export_cli", lambda: _cli_export(model_dir, tmp_path / "cx" / str(i), proc)),
                               ("verify", lambda: _cli_verify(model_dir)),
                               ("ls", lambda: _cli_ls(run)),
                               ("latest", lambda: _cli_latest(model_dir)),
                               ("load_weights", lambda: _load_weights(net, model_dir, proc)),
                               ("console", lambda: _console(reader, model_dir))):
                counts[name] += 1
                try:
                    problem = read()
                except Exception as e:  # noqa: BLE001 - any exception is a failed read
                    problem = f"raised {e.__class__.__name__}: {e}"
                if problem == "retry":
                    retries.append(name)
                elif problem:
                    problems.append(f"{name} {i}: {problem}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, output[-3000:]
    assert not problems, f"{len(problems)} bad reads of {counts}:\n" + "\n".join(problems[:20])
    assert all(counts.values()), counts
    assert len(retries) < sum(counts.values()) // 2, (retries, counts)  # mostly answers, not retries


def _export(model_dir: Path, out: Path, proc: subprocess.Popen) -> str | None:
    """An export of `last`: export.json's step and the tensors of one save."""
    export(model_dir / "last", out)
    rec = json.loads((out / "export.json").read_text())
    if not isinstance(rec["step"], int) or "last.prev" in rec["source"]:
        return f"step {rec['step']} from {rec['source']}"
    snap = _snapshot_weights(model_dir, rec["step"], proc)
    got = load_file(out / "model.safetensors")
    differ = [k for k in snap if not torch.equal(got[k], snap[k])]
    return f"export.json says step {rec['step']}, its tensors differ: {differ[:2]}" if differ else None


def _retry(r) -> bool:
    """The CLI said the checkpoint changed while it read (exit 75, one line to try again)."""
    return r.returncode == CHANGED_EXIT_CODE and "changed while reading" in r.stdout + r.stderr \
        and "try again" in r.stdout + r.stderr


def _cli_export(model_dir: Path, out: Path, proc: subprocess.Popen) -> str | None:
    """`pimm export last OUT` in its own process: as :func:`_export`, or exit 75."""
    r = pimm("export", model_dir / "last", out)
    if _retry(r):
        return "retry"
    if r.returncode != 0:
        return f"exit {r.returncode}: {(r.stdout + r.stderr).strip()[-500:]}"
    rec = json.loads((out / "export.json").read_text())
    snap = _snapshot_weights(model_dir, rec["step"], proc)
    got = load_file(out / "model.safetensors")
    differ = [k for k in snap if not torch.equal(got[k], snap[k])]
    return f"export.json says step {rec['step']}, its tensors differ: {differ[:2]}" if differ else None


def _cli_verify(model_dir: Path) -> str | None:
    r = pimm_here("checkpoints", "verify", model_dir / "last")
    if _retry(r):
        return "retry"
    if r.returncode != 0 or r.stdout.strip() != "last: ok":
        return f"exit {r.returncode}: {(r.stdout + r.stderr).strip()}"
    return None


def _cli_ls(run: Path) -> str | None:
    r = pimm_here("checkpoints", "ls", run, "--json")
    if _retry(r):
        return "retry"
    listing = json.loads(r.stdout) if r.returncode == 0 else {}
    if r.returncode != 0 or listing.get("selected") not in ("last", "last.prev"):
        return f"exit {r.returncode}, selected {listing.get('selected')}: {r.stderr.strip()}"
    return None


def _cli_latest(model_dir: Path) -> str | None:
    r = pimm_here("checkpoints", "latest", model_dir)
    if _retry(r):
        return "retry"
    if r.returncode != 0 or Path(r.stdout.strip()).name not in ("last", "last.prev"):
        return f"exit {r.returncode}: {(r.stdout + r.stderr).strip()}"
    return None


def _load_weights(net: torch.nn.Module, model_dir: Path, proc: subprocess.Popen) -> str | None:
    """load_weights of `last`: the weights of one save, of a step `last` held during the call."""
    lo = _step_of_last(model_dir)
    load_weights(net, model_dir / "last")
    hi = _step_of_last(model_dir)
    loaded = net.state_dict()
    if lo is None or hi is None or not any(
            all(torch.equal(loaded[k], v) for k, v in _snapshot_weights(model_dir, s, proc).items())
            for s in range(lo, hi + 1)):
        return f"not the weights of any save of steps {lo}..{hi}"
    return None


def _console(reader: RunReader, model_dir: Path) -> str | None:
    """The console's poll selects a checkpoint and calls none corrupt; its verify never fails `last`."""
    snap = reader.poll(force_checkpoints=True)
    if snap.checkpoints_changed and snap.chosen is None:  # (saves overtook every read of the first poll: it
        return "retry"  # says so, and shows the checkpoints at the next; seen under a loaded suite)
    verdict = verify_checkpoint(model_dir, "last", settle_s=0.01)
    corrupt = [c.name for c in snap.candidates if c.verify_problems]
    if snap.chosen is None or corrupt or verdict.outcome == "failed":
        return f"chosen {snap.chosen}, corrupt {corrupt}, verify {verdict.outcome} {verdict.problems}"
    return None


def test_a_poll_overtaken_by_saves_says_so_and_keeps_what_it_showed(trained_run, monkeypatch) -> None:
    """When saves replace the checkpoints during every read of a poll (select_resume gives up with
    GenerationChanged, as a run saving every step on a loaded machine makes it), the console keeps what
    it showed and the snapshot says why; at the first poll, with nothing shown yet, it says so in a note."""
    from pimm_core.checkpoint.records.generation import GenerationChanged
    from pimm_core.watch import snapshot

    shown = RunReader(trained_run.run_dir)
    first = shown.poll(force_checkpoints=True)
    assert first.chosen is not None and not first.checkpoints_changed, first.problems

    def overtaken(model_dir):
        raise GenerationChanged(f"{model_dir} changed while reading")

    monkeypatch.setattr(snapshot, "select_resume", overtaken)
    again = shown.poll(force_checkpoints=True)
    assert again.checkpoints_changed and again.chosen == first.chosen, again
    assert again.candidates == first.candidates
    fresh = RunReader(trained_run.run_dir).poll(force_checkpoints=True)
    assert fresh.checkpoints_changed and fresh.chosen is None, fresh
    assert any("replaced them while they were read" in p for p in fresh.problems), fresh.problems
