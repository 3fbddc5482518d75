"""A resume that changes ``eval.metric`` or ``eval.mode`` does not rank the new metric against the
old metric's best: the best starts over (with a warning), the next evaluation replaces
``model_best.pth``, and the summary names the new metric's real best. Both for a checkpoint that
records what its best was ranked by and for one from before it did (read from the
``model_best.pth.json`` sidecar)."""

from __future__ import annotations

import json

import pytest

from _helpers import describe, launch, pimm_here, read_jsonl

TINY = ("train.epochs=2", "data.batch_size=256")  # 6 steps an epoch, an evaluation at each epoch end


def _val(run_dir, key: str) -> list[float]:
    return [r[key] for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "val"]


@pytest.mark.parametrize("recorded", [True, False])
def test_changing_the_selection_metric_on_resume_starts_the_best_over(tmp_path, monkeypatch, recorded):
    from pimm_core.train.state import TrainState

    if not recorded:  # the first session writes checkpoints as pimm did before the trainer state named
        full = TrainState.state_dict  # its best's metric (in this process: launch here=True)
        monkeypatch.setattr(TrainState, "state_dict", lambda self: {k: v for k, v in full(self).items()
                                                                    if k != "best_of"})
    r = launch(tmp_path, "m", *TINY, here=True)
    assert r.returncode == 0, describe(r)
    monkeypatch.undo()
    run_dir = tmp_path / "digits" / "m"
    r = pimm_here("resume", run_dir, "--", "train.epochs=3", 'eval.metric="val/loss"', 'eval.mode="min"')
    assert r.returncode == 0, describe(r)
    out = r.stdout + r.stderr
    assert "the selection metric changed from val/acc (max) to val/loss (min)" in out, out
    losses = _val(run_dir, "loss")
    assert len(losses) == 3
    # the epoch-2 evaluation is the first of val/loss: it is the best whatever val/acc did before
    side = json.loads((run_dir / "model" / "model_best.pth.json").read_text())["selection_metric"]
    assert side["name"] == "val/loss" and side["mode"] == "min" and side["value"] == pytest.approx(losses[2])
    assert f"best val/loss {losses[2]:.4f} (epoch 2)" in out, out

    # the same metric again: its best is kept (a worse later value does not replace it)
    r = pimm_here("resume", run_dir, "--", "train.epochs=4", 'eval.metric="val/loss"', 'eval.mode="min"')
    assert r.returncode == 0, describe(r)
    assert "selection metric changed" not in r.stdout + r.stderr
    losses = _val(run_dir, "loss")
    best = min(losses[2:])
    side = json.loads((run_dir / "model" / "model_best.pth.json").read_text())["selection_metric"]
    assert side["value"] == pytest.approx(best)
