"""Reduce-on-plateau resumed exactly: a run whose ``[scheduler] name = "plateau"`` lowers the LR
at its evaluations, stopped mid-epoch after a reduction and resumed in process, gives the same
LRs at every step and the same weights, bit for bit, as an uninterrupted run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from pimm_core import Trainer, load_config  # noqa: E402
from userpkg.data import digits_aug  # noqa: E402
from userpkg.nets import tied_bn  # noqa: E402

# 4 steps per epoch; the loss must fall by half to count as better, so from the second
# evaluation on (patience 0) each one halves the LR
CONFIG = ["train.epochs=4", "train.lr=0.01", "train.warmup_steps=0", "train.log_every_steps=1", "data.batch_size=16",
          "scheduler.name=\"plateau\"", "scheduler.args={factor = 0.5, patience = 0, threshold = 0.5}",
          "eval.metric=\"val/loss\"", "eval.mode=\"min\""]


def _trainer(run: Path) -> Trainer:
    torch.manual_seed(0)  # the same initial weights in every run
    return Trainer(load_config(None, CONFIG), run_dir=run, model=tied_bn(8), datasets=digits_aug(64, 40))


def _lrs(run: Path) -> dict[int, float]:
    recs = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["lr"] for r in recs if r.get("split") == "train"}


def test_plateau_schedule_resumes_exactly(tmp_path):
    full = _trainer(tmp_path / "full")
    full.train(checkpoint_dir=tmp_path / "full" / "model")
    lrs = _lrs(tmp_path / "full")
    assert len(lrs) == 16 and lrs[16] < lrs[9] < lrs[1]  # reduced during the run, more than once

    cut = _trainer(tmp_path / "cut")
    cut.callbacks.append(lambda tr: tr.stop.request("test") if tr.state.global_step == 10 else None)
    assert cut.train(checkpoint_dir=tmp_path / "cut" / "model").stop_reason is not None
    resumed = _trainer(tmp_path / "cut")
    assert resumed.train(checkpoint_dir=tmp_path / "cut" / "model", resume_from=tmp_path / "cut" / "model").finished
    assert _lrs(tmp_path / "cut") == lrs
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_a_resume_after_a_cut_at_the_last_evaluation_does_not_warn_of_a_schedule_change(tmp_path):
    """Stopped at an epoch's end, whose evaluation cut the LR: the log's last train record carries the
    LR from before the cut, the checkpoint the cut one. The traces are identical, so no warning."""
    full = _trainer(tmp_path / "full")
    full.train(checkpoint_dir=tmp_path / "full" / "model")
    lrs = _lrs(tmp_path / "full")
    assert lrs[9] < lrs[8]  # the evaluation at step 8 cut the LR

    cut = _trainer(tmp_path / "cut")
    cut.callbacks.append(lambda tr: tr.stop.request("test") if tr.state.global_step == 8 else None)
    assert cut.train(checkpoint_dir=tmp_path / "cut" / "model").stop_reason is not None
    resumed = _trainer(tmp_path / "cut")
    assert resumed.train(checkpoint_dir=tmp_path / "cut" / "model", resume_from=tmp_path / "cut" / "model").finished
    assert _lrs(tmp_path / "cut") == lrs
    start = json.loads((tmp_path / "cut" / "provenance.json").read_text())["starts"][-1]
    assert start["kind"] == "resume" and start["step"] == 8
    assert [w for w in start["warnings"] if "LR schedule" in w] == []
