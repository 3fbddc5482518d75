"""Resumes where something changed between save and resume: batching, the run's length,
schedule keys. Real trainings (world size 1, in-process); 45 micro-batches per epoch.

Cases: ``../shared/cases/accum-change-on-resume.md`` and the LR half of
``lr-horizon-after-topology-change.md`` (the 2 -> 1 rank half is in test_resume_exact.py).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from _helpers import read_json, read_jsonl, resumed_records
from _resume_driver import run_job
from conftest import STOPPED_AT, STOPPED_OVERRIDES

OV = ["train.epochs=3", "train.max_steps=60"]  # digits: 45 micro-batches per epoch at batch 32
MIN_LR = 2e-5  # configs/digits.toml


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Case B's first session: trained to train.max_steps=60 (epoch 1, iter 15, loader cursor saved)."""
    run = tmp_path_factory.mktemp("changes") / "base"
    run_job(run, OV)
    m = read_json(run / "model" / "last" / "manifest.json")
    assert (m["step"], m["epoch"], m["iter"], m["epoch_start_step"]) == (60, 1, 15, 45)
    assert (m["batch_size"], m["grad_accum"]) == (32, 1)
    return run


def _resume(base: Path, dest: Path, overrides: list[str], **kw) -> tuple[dict, list[dict], object]:
    shutil.copytree(base, dest)
    trainer = run_job(dest, overrides, resume_from=dest / "model" / "last", **kw)
    entry = [s for s in read_json(dest / "provenance.json")["starts"] if s["kind"] == "resume"][-1]
    after = [r for r in resumed_records(dest / "metrics.jsonl", entry["step"]) if r["split"] == "train"]
    return entry, after, trainer


def _finite(trainer) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


def test_accum_change_replays_from_recorded_epoch_start_with_full_windows(base, tmp_path):
    """Case B: max_steps 60 -> 62 with grad_accum 1 -> 4. Seen: step 61 on one micro-batch divided by 4."""
    entry, after, trainer = _resume(base, tmp_path / "run", ["train.epochs=3", "train.max_steps=62",
                                                              "train.grad_accum=4"])
    assert entry["policy"] == "grad_accum" and entry["exact"] is False
    assert entry["replay_boundary"] == {"epoch": 1, "step": 45, "from_iter": 15}
    assert (entry["topology"]["saved_grad_accum"], entry["topology"]["grad_accum"]) == (1, 4)
    # epoch 1 restarts at step 45; 45 micro-batches in windows of 4: 11 full ones and a last one of 1
    steps = [(r["step"], r["epoch"], r["iter"]) for r in after]
    assert steps[:12] == [(45 + i, 1, 4 * i) for i in range(1, 12)] + [(57, 1, 45)]
    assert steps[12:] == [(58, 2, 4), (59, 2, 8), (60, 2, 12), (61, 2, 16), (62, 2, 20)]
    # every window's logged loss is an average, not a fraction of one: within the range of its neighbours
    losses = [r["loss"] for r in after]
    assert max(losses) / min(losses) < 1.6, losses
    assert _finite(trainer)
    status = read_json(tmp_path / "run" / "status.json")
    assert (status["state"], status["step"], status["total_steps"]) == ("finished", 62, 62)


def test_batch_size_change_never_applies_the_old_cursor(base, tmp_path):
    entry, after, trainer = _resume(base, tmp_path / "run", ["train.epochs=2", "data.batch_size=16"])
    assert entry["policy"] == "batch_size" and "loader cursor" in entry["discarded"]
    assert (entry["topology"]["saved_batch_size"], entry["topology"]["batch_size"]) == (32, 16)
    assert (entry["step"], entry["epoch"], entry["iter"]) == (45, 1, 0)
    # 90 micro-batches of 16 in the replayed epoch: steps 46..135, the run ends with that epoch
    assert [(r["step"], r["iter"]) for r in after][:2] == [(46, 1), (47, 2)]
    assert after[-1]["step"] == 135 == read_json(tmp_path / "run" / "status.json")["total_steps"]
    assert _finite(trainer)


def _lr_at(records: list[dict], step: int) -> float:
    return next(r["lr"] for r in records if r["split"] == "train" and r["step"] == step)


def cosine_lr(step: int, *, lr: float, min_lr: float, warmup: int, total: int, anchor=None) -> float:
    """The README's formula, written out independently of pimm_core.train.schedule."""
    s_a, p_a = anchor or (warmup, 0.0)
    p = min(1.0, max(0.0, p_a + (1 - p_a) * (step - s_a) / (total - s_a)))
    m = min_lr / lr
    return lr * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p)))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, stopped_run) -> Path:
    """A 2-epoch run (90 steps, warmup 20) stopped after step 50 (epoch 1, iter 5): a copy of
    conftest's ``stopped_run``."""
    assert STOPPED_AT == 50 and "train.epochs=2" in STOPPED_OVERRIDES
    run = tmp_path_factory.mktemp("changes") / "stopped"
    shutil.copytree(stopped_run, run)
    return run


def test_finished_run_resume_is_a_noop(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (run / "model").rglob("*") if p.is_file()}
    metrics = (run / "metrics.jsonl").read_bytes()
    trainer = run_job(run, OV, resume_from=run / "model" / "last")
    assert trainer.state.finished and trainer.state.global_step == 60
    assert (run / "metrics.jsonl").read_bytes() == metrics
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (run / "model").rglob("*") if p.is_file()}
    assert after == before
    assert "the run finished at step 60 (epoch 1; train.max_steps = 60)" in (run / "train.log").read_text()


def test_more_epochs_keeps_lr_continuous_and_reaches_min_lr(stopped, tmp_path):
    """Raising train.epochs on resume: no LR jump at the resume, cosine ends at min_lr at the new last step."""
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    split = len(read_jsonl(run / "metrics.jsonl"))
    run_job(run, ["train.epochs=3"], resume_from=run / "model" / "last")
    recs = read_jsonl(run / "metrics.jsonl")
    before, after = recs[:split], [r for r in recs[split:] if r["split"] == "train"]
    assert [r["step"] for r in after] == list(range(51, 136))
    # step 51 gets what the 2-epoch schedule gave it (continuous), then decays towards step 135
    p50 = (50 - 20) / (90 - 20)
    assert math.isclose(after[0]["lr"], cosine_lr(50, lr=0.002, min_lr=MIN_LR, warmup=20, total=90), rel_tol=1e-9)
    for r in after:
        want = cosine_lr(r["step"] - 1, lr=0.002, min_lr=MIN_LR, warmup=20, total=135, anchor=(50, p50))
        assert math.isclose(r["lr"], want, rel_tol=1e-9), r
    assert _lr_at(before, 50) > after[0]["lr"]
    assert MIN_LR <= after[-1]["lr"] <= MIN_LR * 1.05, after[-1]
    assert read_json(run / "status.json")["total_steps"] == 135
    entry = read_json(run / "provenance.json")["starts"][-1]
    assert any("horizon moved from step 90 to step 135" in n for n in entry["schedule"]), entry


def test_lr_override_on_resume_is_applied_and_said(stopped, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    split = len(read_jsonl(run / "metrics.jsonl"))
    run_job(run, ["train.epochs=2", "train.lr=0.001"], resume_from=run / "model" / "last", stop_at=52)
    after = [r for r in read_jsonl(run / "metrics.jsonl")[split:] if r["split"] == "train"]
    entry = read_json(run / "provenance.json")["starts"][-2]
    assert entry["kind"] == "resume"
    assert "train.lr changed 0.002 -> 0.001 on resume: applied from step 50" in entry["schedule"]
    assert "train.lr changed 0.002 -> 0.001 on resume: applied from step 50" in (run / "train.log").read_text()
    # the same schedule with the new base LR (min_lr stays the floor)
    assert [r["step"] for r in after] == [51, 52]
    for r in after:
        assert math.isclose(r["lr"], cosine_lr(r["step"] - 1, lr=0.001, min_lr=MIN_LR, warmup=20, total=90),
                            rel_tol=1e-9), r
    assert not any("LR schedule differs" in w for w in entry["warnings"])
