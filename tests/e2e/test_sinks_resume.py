"""After a crash and a resume each step is in every sink once: ``metrics.jsonl`` (and the console's
reader of it) and the TensorBoard event files, read back with TensorBoard's own EventAccumulator.

A real run is SIGKILLed by a fail point at its second step-checkpoint save (step 10; ``last``
still holds step 5), after the records of steps 6-10 were logged, then resumed by the same
``pimm launch``.
"""

from __future__ import annotations

import os

import pytest

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pimm_core.run import METRICS, SUPERSEDED
from pimm_core.watch.metrics import MetricsTail

from _helpers import clean_env, describe, launch, pimm, read_jsonl

_RUN = ("train.max_steps=14", "train.log_every_steps=1", "checkpoint.every_steps=5", "checkpoint.every_epochs=0",
        "log.tensorboard=true")


def _scalars(run_dir, tag):
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_a_resume_after_a_kill_logs_each_step_once_in_every_sink(tmp_path):
    env = {**clean_env(), "PIMM_FAILPOINT": "standard.prepared@2=kill"}  # inside the step-10 save
    killed = launch(tmp_path, "tb", *_RUN, env=env)
    assert killed.returncode == -9 or "signal 9" in killed.stderr or killed.returncode == 137, describe(killed)
    run = tmp_path / "digits" / "tb"
    before = read_jsonl(run / METRICS)
    assert [r["step"] for r in before if r["split"] == "train"] == list(range(1, 11))  # steps 6-10 logged, then killed
    assert [s for s, _ in _scalars(run, "train/loss")] == list(range(1, 11))

    resumed = pimm("resume", run)
    assert resumed.returncode == 0, describe(resumed)
    after = read_jsonl(run / METRICS)
    train = [r for r in after if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 15))  # each step once
    assert train[:5] == [r for r in before if r["split"] == "train"][:5]  # the interrupted run's, up to step 5
    # steps 6-10 are the resumed run's records (written after the resume), the old ones kept aside
    aside = read_jsonl(run / SUPERSEDED)
    assert [r["step"] for r in aside] == list(range(6, 11)) and aside == before[5:]
    assert all(r["time"] >= before[-1]["time"] for r in train[5:])

    # TensorBoard: each step once, with the values the resumed run logged
    assert _scalars(run, "train/loss") == [(r["step"], pytest.approx(r["loss"])) for r in train]
    lrs = _scalars(run, "train/lr")
    assert [s for s, _ in lrs] == list(range(1, 15))

    # the console's reader plots each step once
    tail = MetricsTail(run / METRICS)
    tail.poll()
    assert tail.loss.points()[0] == [float(s) for s in range(1, 15)]
    assert os.path.isfile(run / SUPERSEDED)
