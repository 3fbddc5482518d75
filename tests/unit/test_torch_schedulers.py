"""``[scheduler] target`` returning torch's own ``lr_scheduler`` objects (ExponentialLR, a
SequentialLR of LinearLR then ExponentialLR): training runs, the status's horizon is the run's
last step, and a run stopped mid-epoch and resumed has the LR trace and the weights of the
uninterrupted run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from pimm_core import Trainer, load_config  # noqa: E402
from userpkg.data import digits_aug  # noqa: E402
from userpkg.nets import tied_bn  # noqa: E402

# 4 steps per epoch, 3 epochs: 12 steps
BASE = ["train.epochs=3", "train.lr=0.01", "train.warmup_steps=0", "train.log_every_steps=1", "data.batch_size=16"]


def _trainer(run: Path, target: str) -> Trainer:
    torch.manual_seed(0)
    cfg = load_config(None, [*BASE, f'scheduler.target="userpkg.schedulers:{target}"'])
    return Trainer(cfg, run_dir=run, model=tied_bn(8), datasets=digits_aug(64, 40))


def _lrs(run: Path) -> dict[int, float]:
    recs = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["lr"] for r in recs if r.get("split") == "train"}


@pytest.mark.parametrize("target", ["exponential", "warmup_then_exponential"])
def test_a_torch_scheduler_trains_and_resumes_exactly(tmp_path: Path, target: str) -> None:
    full = _trainer(tmp_path / "full", target)
    assert full.train(checkpoint_dir=tmp_path / "full" / "model").finished
    lrs = _lrs(tmp_path / "full")
    assert len(lrs) == 12 and lrs[12] < lrs[5]  # decayed: the scheduler's own LRs
    if target == "exponential":
        assert lrs[1] == pytest.approx(0.01) and lrs[3] == pytest.approx(0.01 * 0.9 ** 2)
    else:
        assert lrs[1] == pytest.approx(0.001) and lrs[4] == pytest.approx(0.01)  # warmup, then decay
    status = json.loads((tmp_path / "full" / "status.json").read_text())
    assert status["total_steps"] == 12  # the run's horizon, not an attribute of the scheduler

    cut = _trainer(tmp_path / "cut", target)
    cut.callbacks.append(lambda tr: tr.stop.request("test") if tr.state.global_step == 6 else None)
    assert cut.train(checkpoint_dir=tmp_path / "cut" / "model").stop_reason is not None
    resumed = _trainer(tmp_path / "cut", target)
    assert resumed.train(checkpoint_dir=tmp_path / "cut" / "model", resume_from=tmp_path / "cut" / "model").finished
    assert _lrs(tmp_path / "cut") == lrs
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
