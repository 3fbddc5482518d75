"""samples/s and steps/s: one definition (samples, steps of the optimizer steps since the last
train record over the seconds spent in them, evaluation and saving left out), checked in process
with a fake clock: the clock alone, and a real tiny Trainer whose every optimizer step takes one
fake second while each evaluation takes 1000 and each save 500: every record, those right after
an evaluation or a save too, says 1 step/s; the log line and the console show the same values."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from pimm_core.train.rate import StepClock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_paused_time_is_not_training_time() -> None:
    fake = FakeClock()
    clock = StepClock(fake)
    clock.start()
    for _ in range(4):
        fake.advance(0.5)
        clock.add(32)
    with clock.paused():  # an evaluation
        fake.advance(60)
        with clock.paused():  # the best file it writes: counted once
            fake.advance(30)
    fake.advance(0.5)
    clock.add(16)
    assert clock.take() == pytest.approx((144 / 2.5, 5 / 2.5))
    fake.advance(2.0)
    clock.add(64, steps=2)
    assert clock.take() == pytest.approx((32.0, 1.0))  # counted anew after a take
    assert clock.take() == (0.0, 0.0)  # no time, no steps: no division by zero


def test_records_after_evaluation_and_saving_are_not_skewed(tmp_path: Path, monkeypatch) -> None:
    from _api_runs import one_thread, pimm_logging  # noqa: E402 (tests/e2e helpers)

    from pimm_core import Trainer
    from pimm_core.config import load_config
    from pimm_core.run import read_metrics
    from pimm_core.watch.metrics import MetricsTail

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "digits.toml",
                      ["train.epochs=2", "train.log_every_steps=5", "checkpoint.every_steps=20",
                       "checkpoint.keep_iter=1", "data.num_workers=0", "train.max_steps=60"])
    fake = FakeClock()
    monkeypatch.setattr("pimm_core.train.recorder.StepClock", lambda: StepClock(fake))  # the train() call's clock
    with one_thread(), pimm_logging() as lines:
        tr = Trainer(cfg, run_dir=tmp_path)
        tr.optimizer.register_step_post_hook(lambda *_: fake.advance(1.0))  # each optimizer step: 1 s
        evaluate, save = tr.evaluate, tr.checkpointer.save

        def slow_evaluate():
            fake.advance(1000.0)
            return evaluate()

        def slow_save(*a, **k):
            fake.advance(500.0)
            return save(*a, **k)

        tr.evaluate, tr.checkpointer.save = slow_evaluate, slow_save
        tr.train(checkpoint_dir=tmp_path / "model")
    train = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["split"] == "train"]
    steps = [r["step"] for r in train]
    assert {25, 45, 50} <= set(steps)  # after the step-20 save, the epoch-end save; after the evaluation at 45
    batch = cfg.data.batch_size * cfg.train.grad_accum
    for r in train:
        assert r["steps_per_s"] == pytest.approx(1.0), r
        assert batch / 2 < r["samples_per_s"] <= batch + 1e-9, r  # (an epoch's last batch may be short)
    # the log line says the record's samples/s
    for r in train:
        (line,) = [m for _, m in lines if m.startswith(f"step {r['step']}/")]
        assert re.search(rf" {r['samples_per_s']:.0f} samples/s$", line), line
    # the console shows the newest record's values: its steps/s agrees with its samples/s
    tail = MetricsTail(tmp_path / "metrics.jsonl")
    tail.poll()
    assert tail.rate() == (pytest.approx(1.0), pytest.approx(train[-1]["samples_per_s"]))
