"""Resume from the command line: ``--dry-run``, the path helper, rotation recovery, and ``kill -9``.

The first dry run and the ``kill -9`` case run the console script in real processes; the other
dry runs run it in this process (``_helpers.pimm_here``: same code, no subprocess importing torch).
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

from _helpers import DIGITS, REPO, clean_env, describe, hang_s, pimm, pimm_here, read_json, read_jsonl, snapshot
from _resume_driver import BASE, run_job
from conftest import STOPPED_AT, STOPPED_OVERRIDES
from pimm_core.checkpoint.select.selection import select_resume
from pimm_core.run import read_json as read_json_or_none

K = 50  # interruption: epoch 1, iter 5 (45 steps per epoch at world size 1)
OV = ["train.epochs=2", "data.num_workers=0"]
CLI_OV = [*BASE, *OV]


def resume_cli(root: Path, name: str, *flags: str, overrides=tuple(CLI_OV), timeout: float = 240, here: bool = True):
    """``pimm launch ... --train.resume FLAGS -- overrides``; ``here``: in this process."""
    return (pimm_here if here else pimm)("launch", "--train.config", str(DIGITS), "--run.root", str(root),
                                         "--run.name", name, "--run.no-timestamp", "--train.resume", *flags, "--",
                                         *overrides, timeout=timeout)


@pytest.fixture(scope="module")
def root(tmp_path_factory, stopped_run) -> Path:
    """``<root>/digits/base``: interrupted mid-epoch at step K (model/last: step 50, epoch 1, iter 5);
    a copy of conftest's ``stopped_run`` (BASE + OV, stopped at K)."""
    assert (tuple(OV), K) == (STOPPED_OVERRIDES, STOPPED_AT)
    root = tmp_path_factory.mktemp("resume_cli")
    shutil.copytree(stopped_run, root / "digits" / "base")
    return root


@pytest.fixture
def copy(root, tmp_path) -> Path:
    dest = tmp_path / "digits" / "c"
    shutil.copytree(root / "digits" / "base", dest)
    return dest


# ------------------------------------------------------------------ --dry-run
def test_dry_run_same_topology(root):
    run = root / "digits" / "base"
    before = snapshot(root)
    r = resume_cli(root, "base", "--dry-run", here=False)
    assert r.returncode == 0, describe(r)
    out = r.stdout.splitlines()
    last = run / "model" / "last"
    assert out[0] == f"run: {run}"
    assert f"checkpoint: {last} (step 50, epoch 1, iter 5)" in out
    assert any(line.startswith("policy: same world size, strategy, per-rank micro-batch, accumulation window and per-rank workers") for line in out)
    assert "topology: world size 1 -> 1, strategy ddp -> ddp, per-rank workers 0 -> 0, per-rank micro-batch 32 -> 32, grad_accum 1 -> 1" in out
    restore = next(line for line in out if line.startswith("restore: "))
    for part in ("model weights", "optimizer", "scheduler", "per-rank RNG", "loader cursor"):
        assert part in restore
    assert "discard: nothing" in out
    assert "continue at: step 50, epoch 1, iter 5 (exact continuation)" in out
    assert "config diff: none" in out
    assert not any(line.startswith("warning:") for line in out)
    assert out[-1] == "dry run: nothing was trained or written"
    assert snapshot(root) == before  # nothing written, not even a lock


def test_dry_run_two_ranks_shows_world_size_row_and_replay_boundary(root):
    before = snapshot(root)
    r = resume_cli(root, "base", "--nproc-per-node", "2", "--dry-run")
    assert r.returncode == 0, describe(r)
    out = r.stdout.splitlines()
    assert any(line.startswith("policy: world size changes: reshard compatible state, discard loader cursor")
               for line in out)
    assert "topology: world size 1 -> 2, strategy ddp -> ddp, per-rank workers 0 -> 0, per-rank micro-batch 32 -> 32, grad_accum 1 -> 1" in out
    discard = next(line for line in out if line.startswith("discard: "))
    assert "loader cursor" in discard and "per-rank RNG" in discard
    assert "optimizer (resharded through DCP)" in next(line for line in out if line.startswith("restore: "))
    assert "continue at: step 45, epoch 1, iter 0 (replay boundary: epoch 1 start, step 45; 5 batches replay)" in out
    warnings = [line for line in out if line.startswith("warning: ")]
    assert any("loader cursor skipped" in w for w in warnings) and any("world size changed 1 -> 2" in w for w in warnings)
    assert snapshot(root) == before


def test_dry_run_strategy_change_keeps_cursor_and_rng(root):
    """ddp -> fsdp at the same world size: state resharded exactly, the cursor and RNG carry over."""
    r = resume_cli(root, "base", "--dry-run", overrides=[*CLI_OV, "train.strategy=fsdp"])
    assert r.returncode == 0, describe(r)
    out = r.stdout.splitlines()
    assert any(line.startswith("policy: strategy changes at the same world size (ddp <-> fsdp)") for line in out), out
    assert "topology: world size 1 -> 1, strategy ddp -> fsdp, per-rank workers 0 -> 0, " \
           "per-rank micro-batch 32 -> 32, grad_accum 1 -> 1" in out
    restore = next(line for line in out if line.startswith("restore: "))
    for part in ("model weights (resharded through DCP)", "optimizer (resharded through DCP)", "per-rank RNG",
                 "loader cursor"):
        assert part in restore
    assert "discard: nothing" in out
    assert "continue at: step 50, epoch 1, iter 5 (loader cursor restored; not bitwise: the strategy changed)" in out
    warnings = [line for line in out if line.startswith("warning: ")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: strategy changed ddp -> fsdp"), warnings
    assert "config diff: train.strategy: 'ddp' -> 'fsdp'" in out


def test_dry_run_strategy_and_world_size_change(root, tmp_path):
    """fsdp (an edited manifest) -> ddp on 2 ranks: the world-size row applies; the strategy change is named."""
    run = tmp_path / "digits" / "base"
    shutil.copytree(root / "digits" / "base", run)
    m = read_json(run / "model" / "last" / "manifest.json")
    (run / "model" / "last" / "manifest.json").write_text(json.dumps({**m, "strategy": "fsdp"}))
    r = resume_cli(tmp_path, "base", "--nproc-per-node", "2", "--dry-run")
    assert r.returncode == 0, describe(r)
    out = r.stdout.splitlines()
    assert any(line.startswith("policy: world size changes") for line in out), out
    assert "topology: world size 1 -> 2, strategy fsdp -> ddp," in r.stdout
    assert "continue at: step 45, epoch 1, iter 0 (replay boundary: epoch 1 start, step 45; 5 batches replay)" in out
    warnings = [line for line in out if line.startswith("warning: ")]
    assert any("world size changed 1 -> 2" in w for w in warnings)
    assert any(w.startswith("warning: strategy changed fsdp -> ddp") and "world size changed too" in w
               for w in warnings), warnings


def test_dry_run_shows_config_diff(root):
    r = resume_cli(root, "base", "--dry-run", overrides=[*CLI_OV, "train.lr=0.003"])
    assert r.returncode == 0, describe(r)
    diff = [line for line in r.stdout.splitlines() if line.startswith("config diff: ")]
    assert len(diff) == 1 and "train.lr: 0.002 -> 0.003" in diff[0]


# ------------------------------------------------------------------ path helper and rotation recovery
def _latest_both(model: Path, *flags: str) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    helper = subprocess.run([sys.executable, "-m", "pimm_core.utils.path", "latest-checkpoint", str(model), *flags],
                            cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=hang_s(60))
    cli = pimm("checkpoints", "latest", str(model), *flags)
    return helper, cli


def test_path_helper_matches_checkpoints_latest(root):
    model = root / "digits" / "base" / "model"
    helper, cli = _latest_both(model, "--explain")
    assert helper.returncode == cli.returncode == 0, describe(helper)
    assert helper.stdout == cli.stdout == f"{model / 'last'}\n"
    assert helper.stderr == cli.stderr and "last: selected" in helper.stderr


def test_interrupted_rotation_is_recovered(copy):
    model = copy / "model"
    os.rename(model / "last", model / "last.prev")  # a save died between its two renames
    helper, cli = _latest_both(model)
    assert helper.returncode == cli.returncode == 0, describe(helper)
    assert helper.stdout == cli.stdout == f"{model / 'last.prev'}\n"
    r = resume_cli(copy.parents[1], "c", "--dry-run")
    assert r.returncode == 0, describe(r)
    assert f"checkpoint: {model / 'last.prev'} (step 50, epoch 1, iter 5)" in r.stdout.splitlines()
    # the resume itself continues exactly from the recovered candidate; the next save completes the rotation
    split = len(read_jsonl(copy / "metrics.jsonl"))
    run_job(copy, OV, resume_from=model, stop_at=K + 1)
    entry = [s for s in read_json(copy / "provenance.json")["starts"] if s["kind"] == "resume"][-1]
    assert entry["checkpoint"] == str(model / "last.prev") and entry["policy"] == "same" and entry["exact"]
    assert [(r["step"], r["iter"]) for r in read_jsonl(copy / "metrics.jsonl")[split:] if r["split"] == "train"] \
        == [(K + 1, 6)]
    assert (model / "last" / ".complete").is_file() and not (model / "last.prev").exists()
    assert read_json(model / "last" / "manifest.json")["step"] == K + 1


def test_path_helper_and_latest_agree_on_no_candidate(copy):
    model = copy / "model"
    (model / "last" / ".complete").unlink()
    helper, cli = _latest_both(model)
    assert helper.returncode == cli.returncode == 1
    assert helper.stdout == cli.stdout == ""
    assert helper.stderr == cli.stderr and helper.stderr.startswith("error: no complete checkpoint")


# ------------------------------------------------------------------ kill -9 mid-epoch, then the seed's resume command
KILL_OV = ["train.epochs=2", "checkpoint.every_steps=7", "train.log_every_steps=1"]
KILL_TOTAL = 2 * 45  # saves at 7, 14, ..., 84: none falls on an epoch end (45)


def test_kill_9_mid_epoch_then_resume(tmp_path):
    root = tmp_path / "exp"
    run = root / "digits" / "k"
    manifest = run / "model" / "last" / "manifest.json"
    args = ["launch", "--train.config", str(DIGITS), "--run.root", str(root), "--run.name", "k", "--run.no-timestamp"]
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pimm_core.cli", *args, "--", *KILL_OV], cwd=REPO,
                                env=clean_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + hang_s(180)
            while time.monotonic() < deadline and proc.poll() is None:
                m = read_json_or_none(manifest)  # None while absent (before the first save, or mid-rotation)
                if m is not None and m.get("step", 0) >= 14:
                    break
                time.sleep(0.01)
            assert proc.poll() is None, "the run ended before it could be killed:\n" + (tmp_path / "first.log").read_text()
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=hang_s(30))
    assert proc.returncode == -signal.SIGKILL
    assert read_json(run / "status.json")["state"] == "running"  # nobody said goodbye

    chosen, _ = select_resume(run / "model")  # what was on disk at kill time (torch-free)
    assert chosen is not None and 14 <= chosen.step < KILL_TOTAL
    assert 0 < chosen.iter  # mid-epoch
    r = pimm(*args, "--train.resume", "--", *KILL_OV, timeout=240)
    assert r.returncode == 0, describe(r)
    assert f"steps {KILL_TOTAL}" in r.stdout and "resume check" in r.stdout

    starts = read_json(run / "provenance.json")["starts"]
    assert [s["kind"] for s in starts] == ["start", "resume"]
    entry = starts[-1]
    assert entry["checkpoint"] == chosen.path and entry["checkpoint_step"] == chosen.step
    assert entry["policy"] == "same" and entry["exact"] is True and entry["replay_boundary"] is None
    assert not [w for w in entry["warnings"] if "LR schedule" in w or "config differs" in w]
    status = read_json(run / "status.json")
    assert (status["state"], status["step"], status["epoch"], status["iter"]) == ("finished", KILL_TOTAL, 2, 0)
    # after the resume, every step from the checkpoint on trained exactly once more, in order
    steps = [rec["step"] for rec in read_jsonl(run / "metrics.jsonl") if rec["split"] == "train"]
    before_kill, after = steps[: len(steps) - (KILL_TOTAL - chosen.step)], steps[len(steps) - (KILL_TOTAL - chosen.step):]
    assert after == list(range(chosen.step + 1, KILL_TOTAL + 1))
    assert before_kill == list(range(1, len(before_kill) + 1)) and len(before_kill) >= chosen.step
    # the interrupted save's temporaries and an interrupted rotation's last.prev are gone
    leftovers = [p.name for p in (run / "model").rglob("*") if p.is_dir() and p.name.endswith((".tmp", ".prev"))]
    assert leftovers == []
    assert select_resume(run / "model")[0].path == str(run / "model" / "last")
    assert read_json(run / "model" / "last" / "manifest.json")["step"] == KILL_TOTAL
