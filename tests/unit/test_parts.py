"""The trainer's parts as pure decisions: best tracking, the stop agreement (one process),
the LR schedule and its horizon. Fast, no subprocess, no training."""

from __future__ import annotations

import math
import time

import pytest
import torch

from pimm_core.process.dist import DistInfo
from pimm_core.train.schedule import WarmupCosine
from pimm_core.process.stop import StopRequest, stop_file, write_stop_file
from pimm_core.train.best import BestTracker
from pimm_core.train.stop_agreement import StopAgreement


# ------------------------------------------------------------------ best tracking
@pytest.mark.parametrize("mode,values,bests", [
    ("max", [0.5, 0.7, 0.7, 0.6, 0.9], [True, True, False, False, True]),
    ("min", [1.0, 0.8, 0.8, 0.9, 0.1], [True, True, False, False, True]),
])
def test_best_is_a_strict_improvement(mode, values, bests):
    t = BestTracker("val/acc", mode)
    assert [t.update(v, e) for e, v in enumerate(values)] == bests
    assert (t.best, t.epoch) == (values[-1], len(values) - 1)


def test_non_finite_is_never_best_and_does_not_block_later_ones():
    t = BestTracker("val/loss", "min")
    assert not t.update(float("nan"), 0) and t.best is None
    assert t.update(2.0, 1)
    assert not t.update(float("-inf"), 2) and not t.update(float("nan"), 3)
    assert t.update(1.0, 4) and (t.best, t.epoch) == (1.0, 4)


def test_best_state_round_trips():
    t = BestTracker("val/acc", "max")
    t.update(0.8, 3)
    u = BestTracker("val/acc", "max")
    u.load_state_dict(t.state_dict())
    assert (u.best, u.epoch) == (0.8, 3) and not u.update(0.8, 4) and u.update(0.81, 5)
    with pytest.raises(ValueError):
        BestTracker("val/acc", "up")


# ------------------------------------------------------------------ stop agreement, one process
def agreement(run_dir, **kw) -> StopAgreement:
    return StopAgreement(StopRequest(), DistInfo(), run_dir, torch.device("cpu"), **kw)


def test_stop_file_is_polled_at_most_once_per_interval(tmp_path):
    a = agreement(tmp_path, poll_every_s=60.0)
    assert a.agree() is None  # the first poll finds nothing
    write_stop_file(tmp_path, "maintenance")
    assert a.agree() is None  # the next poll is a minute away: no stat per window
    a._last_poll = time.monotonic() - 61
    assert a.agree() == "maintenance" and a.file_used
    a.consume()
    assert not stop_file(tmp_path).exists()


def test_a_request_wins_without_touching_the_file(tmp_path):
    a = agreement(tmp_path)
    a.stop.request("budget")
    write_stop_file(tmp_path, "operator")
    assert a.agree() == "budget" and not a.file_used
    a.consume()
    assert stop_file(tmp_path).exists()  # not ours to remove


def test_stale_stop_file_is_discarded_at_start(tmp_path):
    write_stop_file(tmp_path, "old")
    a = agreement(tmp_path)
    a.discard_stale()
    assert not stop_file(tmp_path).exists() and a.agree() is None


# ------------------------------------------------------------------ LR schedule
def schedule(total=100, warmup=10, kind="cosine", lr=1.0, min_lr=0.01) -> WarmupCosine:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return WarmupCosine(opt, warmup=warmup, total=total, min_ratio=min_lr / lr, kind=kind)


def test_warmup_then_cosine_to_the_floor():
    s = schedule()
    assert [s.factor(k) for k in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert s.factor(10) == pytest.approx(1.0) and s.factor(55) == pytest.approx(0.01 + 0.99 * 0.5)
    assert s.factor(100) == pytest.approx(0.01) and s.factor(150) == pytest.approx(0.01)
    assert schedule(kind="constant").factor(80) == 1.0


@pytest.mark.parametrize("resume_at,new_total", [(40, 200), (40, 60), (5, 300), (99, 120)])
def test_retarget_is_continuous_and_reaches_the_floor_at_the_new_end(resume_at, new_total):
    s = schedule()
    before = s.factor(resume_at)
    s.retarget(resume_at, new_total)
    assert s.factor(resume_at) == pytest.approx(before, rel=1e-12)
    assert s.factor(new_total) == pytest.approx(0.01)
    lrs = [s.factor(k) for k in range(max(resume_at, 10), new_total + 1)]
    assert all(b <= a + 1e-15 for a, b in zip(lrs, lrs[1:]))  # decays, never jumps up


def test_schedule_state_round_trips_with_its_anchor():
    s = schedule()
    s.retarget(40, 200)
    for _ in range(45):
        s.optimizer.step()
        s.step()
    t = schedule()
    t.load_state_dict(s.state_dict())
    assert (t.total, t.anchor_step, t.last_epoch) == (200, 40, s.last_epoch)
    assert t.factor(123) == s.factor(123) and math.isclose(t.get_last_lr()[0], s.get_last_lr()[0])


def test_trainer_is_freed_by_reference_counting():
    """No part holds the trainer: a reference cycle would keep the loaders and their worker processes
    (which ignore SIGTERM) alive until interpreter exit, where multiprocessing's join then hangs."""
    import gc
    import weakref

    from pimm_core import Trainer, load_config

    from pathlib import Path

    digits = Path(__file__).resolve().parents[2] / "configs" / "digits.toml"
    cfg = load_config(digits, ["train.epochs=1", "train.max_steps=2", "data.num_workers=2"])
    trainer = Trainer(cfg)
    trainer.train()
    ref = weakref.ref(trainer)
    gc.disable()
    try:
        del trainer
        alive = ref()
        held_by = [type(r).__name__ + (f" {getattr(r, 'f_code', '')}" if type(r).__name__ == "frame" else "")
                   for r in gc.get_referrers(alive)] if alive is not None else []
        del alive
        assert ref() is None, f"the trainer is still referenced by: {held_by}"
    finally:
        gc.enable()


def test_train_config_passed_to_train_sets_the_fresh_runs_optimizer(tmp_path):
    """``trainer.train(TrainConfig(lr=...))`` trains with that LR from the first step (the optimizer
    was built from the config's), and the run's config.toml records it for ``pimm resume``."""
    import dataclasses
    import tomllib
    from pathlib import Path

    from pimm_core import Trainer, load_config

    digits = Path(__file__).resolve().parents[2] / "configs" / "digits.toml"
    cfg = load_config(digits, ["train.epochs=1", "train.max_steps=2", "train.lr=0.001"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    t = dataclasses.replace(cfg.train, lr=0.01, warmup_steps=0, weight_decay=0.0)
    trainer.train(t)
    assert [g["initial_lr"] for g in trainer.optimizer.param_groups] == [0.01] * len(trainer.optimizer.param_groups)
    assert all(g["weight_decay"] == 0.0 for g in trainer.optimizer.param_groups)
    saved = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert saved["train"]["lr"] == 0.01
