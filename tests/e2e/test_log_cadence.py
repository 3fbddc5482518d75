"""The train records of ``metrics.jsonl``: every ``train.log_every_steps``, at step 1, and at the
last step of each epoch and of the run, so the console's "last" loss and plot never lag the
run's end (a 90-step run logged every 50 steps used to end its record at step 50)."""

from __future__ import annotations

from _helpers import describe, launch, read_json, read_jsonl


def test_the_last_step_of_each_epoch_and_of_the_run_is_logged(tmp_path):
    r = launch(tmp_path, "cadence", "train.epochs=2", "train.log_every_steps=50", "eval.every_epochs=0", here=True)
    assert r.returncode == 0, describe(r)
    run = tmp_path / "digits" / "cadence"
    status = read_json(run / "status.json")
    per_epoch, total = status["steps_per_epoch"], status["total_steps"]
    assert total == 2 * per_epoch and per_epoch % 50  # an epoch end that is not a multiple of 50
    train = [x for x in read_jsonl(run / "metrics.jsonl") if x["split"] == "train"]
    steps = [x["step"] for x in train]
    assert all(x["grad_norm"] > 0 for x in train), train[:2]  # the window's gradient norm, before clipping
    assert steps == sorted({1, *range(50, total + 1, 50), per_epoch, total}), (steps, per_epoch)
