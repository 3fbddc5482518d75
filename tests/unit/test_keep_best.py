"""``checkpoint.keep_best``: which evaluations are kept as ``best_<step>.pth``, which kept files go,
and that the ranking is the one on disk (ties, NaN, a file removed by hand, a resume, files the
run did not write). The Checkpointer is driven as the trainer's evaluation does (a BestTracker
says whether ``model_best.pth`` improves), without a Trainer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from pimm_core.checkpoint.records.manifest import write_manifest
from pimm_core.checkpoint.select.selection import list_candidates
from pimm_core.config import CheckpointConfig, Config, EvalConfig
from pimm_core.process.dist import DistInfo
from pimm_core.run import read_json
from pimm_core.train.schedule import WarmupCosine
from pimm_core.process.stop import StopRequest
from pimm_core.train.best import BestTracker
from pimm_core.train.best_k import BestKeeper, ranked_best
from pimm_core.train.checkpointer import Checkpointer
from pimm_core.train.state import TrainState


def sidecar(step: int, selection: dict) -> dict:
    """A valid weights-file sidecar (the manifest schema) of a ``best_<step>.pth``."""
    return {"kind": "best", "format": "weights", "step": step, "epoch": 0, "iter": 0, "selection_metric": selection,
            "files": {}}


class Loader:
    def __len__(self) -> int:
        return 5

    def state_dict(self) -> dict:
        return {}


class Run:
    """A Checkpointer and the run's BestTracker, evaluated as ``session.evaluate_and_record`` does."""

    def __init__(self, model_dir: Path, keep_best: int, mode: str = "max", fmt: str = "standard"):
        cfg = Config(checkpoint_format=fmt, checkpoint=CheckpointConfig(keep_best=keep_best),
                     eval=EvalConfig(metric="val/acc", mode=mode))
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        self.c = Checkpointer(cfg, DistInfo(), StopRequest(), model=model, optimizer=opt, loader=Loader(),
                              state=TrainState(), scaler=torch.amp.GradScaler("cpu", enabled=False), ema=None,
                              data_fingerprint="fp", code_version="v1")
        self.c.begin(model_dir, scheduler=WarmupCosine(opt, warmup=0, total=10, min_ratio=0.0, kind="cosine"),
                     grad_accum=1)
        self.best = BestTracker("val/acc", mode)
        best = read_json(model_dir / "model_best.pth.json") if (model_dir / "model_best.pth.json").exists() else None
        if best:  # a resume: the tracker's state comes back from the checkpoint
            self.best.best = best["selection_metric"]["value"]
        self.model_dir, self.mode = model_dir, mode

    def evaluate(self, step: int, value: float) -> None:
        epoch = step // 10 - 1
        self.c.state.global_step, self.c.state.epoch, self.c.state.iter = step, epoch + 1, 0
        improved = self.best.update(value, epoch)
        self.c.on_evaluated(epoch, {"name": "val/acc", "value": value, "mode": self.mode, "split": "val",
                                    "epoch": epoch, "weights": "raw"}, improved=improved)

    def kept(self) -> dict[str, float]:
        """Every best_<step>.pth on disk and the value its sidecar records."""
        return {p.name: read_json(p.with_name(p.name + ".json"))["selection_metric"]["value"]
                for p in sorted(self.model_dir.glob("best_*.pth"))}

    def model_best(self) -> float:
        return read_json(self.model_dir / "model_best.pth.json")["selection_metric"]["value"]


def test_keep_best_one_writes_only_model_best(tmp_path):
    run = Run(tmp_path, keep_best=1)
    for step, value in ((10, 0.5), (20, 0.7), (30, 0.6)):
        run.evaluate(step, value)
    assert run.kept() == {} and run.model_best() == 0.7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_best.pth", "model_best.pth.json"]


def test_the_k_best_are_kept_and_model_best_stays_the_best(tmp_path):
    run = Run(tmp_path, keep_best=3)
    for step, value in ((10, 0.5), (20, 0.7), (30, 0.6), (40, 0.4), (50, 0.8), (60, 0.65)):
        run.evaluate(step, value)
    assert run.kept() == {"best_50.pth": 0.8, "best_20.pth": 0.7, "best_60.pth": 0.65}
    assert run.model_best() == 0.8
    side = read_json(tmp_path / "best_60.pth.json")  # the same sidecar as model_best.pth's
    assert (side["kind"], side["step"], side["epoch"], side["format"]) == ("best", 60, 5, "weights")
    assert side["files"]["best_60.pth"]["size"] == (tmp_path / "best_60.pth").stat().st_size
    loaded = torch.load(tmp_path / "best_50.pth", weights_only=True)
    assert set(loaded) == {"state_dict"}


def test_min_mode_keeps_the_lowest(tmp_path):
    run = Run(tmp_path, keep_best=2, mode="min")
    for step, value in ((10, 0.5), (20, 0.3), (30, 0.4), (40, 0.9)):
        run.evaluate(step, value)
    assert run.kept() == {"best_20.pth": 0.3, "best_30.pth": 0.4}
    assert run.model_best() == 0.3


def test_ties_keep_the_earlier_evaluation(tmp_path):
    run = Run(tmp_path, keep_best=2)
    for step, value in ((10, 0.7), (20, 0.7), (30, 0.7), (40, 0.6)):
        run.evaluate(step, value)
    # as model_best.pth: an equal value does not displace the one that reached it first
    assert run.kept() == {"best_10.pth": 0.7, "best_20.pth": 0.7}
    assert read_json(tmp_path / "model_best.pth.json")["step"] == 10
    assert [f.name for f in ranked_best(tmp_path, "val/acc", "max")] == ["best_10.pth", "best_20.pth"]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_value_is_never_kept(tmp_path, bad):
    run = Run(tmp_path, keep_best=3)
    run.evaluate(10, bad)  # not even when fewer than k are kept
    run.evaluate(20, 0.5)
    run.evaluate(30, bad)
    assert run.kept() == {"best_20.pth": 0.5} and run.model_best() == 0.5


def test_a_file_removed_by_hand_is_forgotten(tmp_path):
    run = Run(tmp_path, keep_best=2)
    run.evaluate(10, 0.5)
    run.evaluate(20, 0.7)
    (tmp_path / "best_20.pth").unlink()  # the file only: its sidecar stays behind
    run.evaluate(30, 0.4)  # two slots, one file: 0.4 is kept
    assert run.kept() == {"best_10.pth": 0.5, "best_30.pth": 0.4}
    (tmp_path / "best_10.pth").unlink()
    (tmp_path / "best_10.pth.json").unlink()
    run.evaluate(40, 0.45)
    assert run.kept() == {"best_30.pth": 0.4, "best_40.pth": 0.45}


def test_a_resume_continues_the_ranking_from_disk(tmp_path):
    first = Run(tmp_path, keep_best=2)
    for step, value in ((10, 0.5), (20, 0.7), (30, 0.6)):
        first.evaluate(step, value)
    resumed = Run(tmp_path, keep_best=2)  # a new process: nothing in memory
    resumed.evaluate(40, 0.55)  # below both kept: not kept
    assert resumed.kept() == {"best_20.pth": 0.7, "best_30.pth": 0.6}
    resumed.evaluate(50, 0.65)
    assert resumed.kept() == {"best_20.pth": 0.7, "best_50.pth": 0.65}
    # a resume that evaluates a kept step again replaces that file, not a third one
    resumed.evaluate(50, 0.66)
    assert resumed.kept() == {"best_20.pth": 0.7, "best_50.pth": 0.66}


def test_a_smaller_keep_best_on_resume_removes_the_surplus(tmp_path):
    first = Run(tmp_path, keep_best=3)
    for step, value in ((10, 0.5), (20, 0.7), (30, 0.6)):
        first.evaluate(step, value)
    Run(tmp_path, keep_best=2).evaluate(40, 0.1)  # not kept itself; the surplus goes all the same
    assert sorted(p.name for p in tmp_path.glob("best_*.pth")) == ["best_20.pth", "best_30.pth"]


def test_files_the_run_did_not_write_are_never_ranked_or_removed(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "best_1.pth").write_bytes(b"a user's file, no sidecar")
    (tmp_path / "best_2.pth").write_bytes(b"another metric")
    write_manifest(tmp_path / "best_2.pth.json", sidecar(2, {"name": "val/loss", "value": 0.0, "mode": "min"}))
    (tmp_path / "best_3.pth").write_bytes(b"bad sidecar")
    (tmp_path / "best_3.pth.json").write_text("{not json")
    run = Run(tmp_path, keep_best=2)
    for step, value in ((10, 0.5), (20, 0.7), (30, 0.6)):
        run.evaluate(step, value)
    names = sorted(p.name for p in tmp_path.glob("best_*.pth"))
    assert names == ["best_1.pth", "best_2.pth", "best_20.pth", "best_3.pth", "best_30.pth"]


def test_the_keeper_alone_ranks_what_is_on_disk(tmp_path):
    for step, value in ((10, 0.5), (20, 0.9), (30, 0.7)):
        (tmp_path / f"best_{step}.pth").write_bytes(b"w")
        write_manifest(tmp_path / f"best_{step}.pth.json", sidecar(step, {"name": "val/acc", "value": value,
                                                                           "mode": "max"}))
    keeper = BestKeeper(2, "val/acc", "max")
    assert not keeper.admits(tmp_path, 40, 0.7)  # equal to the second: the earlier stays
    assert keeper.admits(tmp_path, 40, 0.71)
    assert keeper.admits(tmp_path, 30, 0.6)  # step 30 again is ranked without its own earlier file
    assert [f.name for f in keeper.surplus(tmp_path)] == ["best_10.pth"]
    assert keeper.rotate(tmp_path) == ["best_10.pth"]
    assert not (tmp_path / "best_10.pth").exists() and not (tmp_path / "best_10.pth.json").exists()
    assert not BestKeeper(1, "val/acc", "max").admits(tmp_path, 50, 1.0)


def test_checkpoints_ls_lists_kept_best_files_with_their_step(tmp_path):
    run = Run(tmp_path, keep_best=2)
    for step, value in ((10, 0.5), (20, 0.7), (30, 0.6)):
        run.evaluate(step, value)
    cands = {c.name: c for c in list_candidates(tmp_path)}
    assert {n: (c.kind, c.step, c.complete, c.resumable) for n, c in cands.items() if n.startswith("best_")} == {
        "best_20.pth": ("best", 20, True, False), "best_30.pth": ("best", 30, True, False)}
    assert cands["best_20.pth"].manifest["selection_metric"]["value"] == 0.7
