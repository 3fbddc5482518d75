"""Tied parameters and buffers in every weight set: the EMA, EMA evaluation, checkpoints
(sync and async), best/iter files, exports, strict load and warm start.

The model ties its output head to its embedding (``head.weight is emb.weight``) and has a
BatchNorm (float running statistics and an integer ``num_batches_tracked``). Everything is
driven directly: no subprocess, no training run.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from pimm_core.checkpoint.export.model_dir import export, export_weights, load_exported
from pimm_core.checkpoint.formats.async_save import AsyncStandardFormat
from pimm_core.checkpoint.formats.protocol import SaveItem
from pimm_core.checkpoint.formats.standard import StandardFormat, load_standard, save_standard
from pimm_core.checkpoint.formats.weights_file import write_weights_file
from pimm_core.checkpoint.weights.strict_load import load_weights
from pimm_core.checkpoint.tensors.ties import find_aliases, follow_model_ties, tied_groups
from pimm_core.checkpoint.weights.warm_start import warm_start
from pimm_core.checkpoint.export.files import write_safetensors
from pimm_core.checkpoint.weights.read import read_weight_sets
from pimm_core.process.dist import DistInfo
from pimm_core.train.ema import EMA
from pimm_core.train.evaluator import Evaluator

VOCAB, DIM = 11, 8
BUFFERS = ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked")
META = {"trainer": {"global_step": 4, "epoch": 0, "iter": 4}, "scheduler": {}, "scaler": {}, "world_size": 1,
        "workers_per_rank": 0}


class TiedLM(nn.Module):
    """Token -> embedding -> BatchNorm -> logits through the embedding matrix (a tied LM head)."""

    def __init__(self, tie: bool = True):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm = nn.BatchNorm1d(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B,) int64 -> (B, VOCAB) logits
        return self.head(self.norm(self.emb(x)))


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (16,), generator=g) for _ in range(n)]


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, ema: EMA | None) -> None:
    model.train()
    F.cross_entropy(model(x), x).backward()
    opt.step()
    opt.zero_grad()
    if ema is not None:
        ema.update(model)


def trained(steps: int = 4) -> tuple[TiedLM, torch.optim.Optimizer, EMA, torch.Tensor]:
    """A model after ``steps`` steps, its optimizer, its EMA, and the EMA of the tied tensor by hand."""
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ema = EMA(model, decay=0.5, warmup=False)
    by_hand = model.emb.weight.detach().clone()
    for x in batches(steps):
        step(model, opt, x, ema)
        by_hand = 0.5 * by_hand + 0.5 * model.emb.weight.detach()
    return model, opt, ema, by_hand


def same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ------------------------------------------------------------------ the EMA itself
def test_ema_averages_a_tied_tensor_once_and_keeps_the_tie() -> None:
    model, _, ema, by_hand = trained()
    assert list(ema.shadow) == ["emb.weight", "norm.weight", "norm.bias"]  # by identity: head.weight is emb.weight
    sd = ema.state_dict_for(model)
    assert list(sd) == list(model.state_dict())
    assert sd["head.weight"] is sd["emb.weight"] and find_aliases(sd) == {"head.weight": "emb.weight"}
    assert torch.allclose(sd["head.weight"], by_hand, atol=1e-6)
    assert not torch.equal(sd["head.weight"], model.emb.weight)  # an average, not the raw weight


def test_ema_copies_buffers_at_the_time_the_set_is_made() -> None:
    model, _, ema, _ = trained()
    sd = ema.state_dict_for(model)
    assert int(sd["norm.num_batches_tracked"]) == 4
    assert all(torch.equal(sd[k], model.state_dict()[k]) for k in BUFFERS)
    before = sd["norm.running_mean"].clone()
    model.train()
    model(batches(5)[-1])  # a forward in train mode moves the running statistics
    assert torch.equal(sd["norm.running_mean"], before)  # a copy, not a view of the live buffer


def test_ema_load_reads_a_tied_tensor_under_any_name_canonical_first() -> None:
    model, _, ema, _ = trained()
    saved = ema.state_dict_for(model)
    only_head = {k: v.clone() for k, v in saved.items() if k != "emb.weight"}
    again = EMA(model, 0.5, warmup=False)
    again.load(only_head, ema.updates)
    assert torch.equal(again.shadow["emb.weight"], ema.shadow["emb.weight"]) and again.updates == 4
    # a set whose tied names disagree (an EMA set written before ties were followed: the
    # head held the raw weight): the canonical name is the averaged one
    stale = dict(saved, **{"head.weight": model.emb.weight.detach().clone()})
    again.load(stale, 4)
    assert torch.equal(again.shadow["emb.weight"], ema.shadow["emb.weight"])


def test_ema_evaluation_runs_the_averaged_tied_weights_and_leaves_the_model_alone() -> None:
    model, _, ema, _ = trained()
    val = [(x, x, None) for x in batches(3)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = Evaluator(val, torch.device("cpu"), contextlib.nullcontext, weights="ema").evaluate(model, ema)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.head.weight is model.emb.weight and model.training  # mode restored

    copy = TiedLM()
    copy.load_state_dict(ema.state_dict_for(model))
    want = Evaluator(val, torch.device("cpu"), contextlib.nullcontext, weights="raw").evaluate(copy)
    assert got == pytest.approx(want, rel=1e-6)
    raw = Evaluator(val, torch.device("cpu"), contextlib.nullcontext, weights="raw").evaluate(model)
    assert raw["val/loss"] != got["val/loss"]


# ------------------------------------------------------------------ checkpoints and resume
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_checkpoint_keeps_ties_and_buffers_and_resumes_exactly(tmp_path: Path, mode: str) -> None:
    model, opt, ema, _ = trained()
    kw = dict(model=model, optimizer=opt, meta=META, rank_state={}, manifest={"step": 4},
              ema_state_dict=ema.state_dict_for(model))
    if mode == "sync":
        save_standard(tmp_path, info=DistInfo(), **kw)
    else:  # staged to CPU buffers in the background: the ties must survive the copy
        saver = AsyncStandardFormat(StandardFormat(DistInfo()))
        ema_sd = kw.pop("ema_state_dict")
        saver.save(tmp_path, SaveItem(**kw, step=4, ema_weights=lambda: ema_sd), background=True)
        saver.wait()
    sets = read_weight_sets(tmp_path / "last" / "weights.pth")
    for name in ("raw", "ema"):
        assert set(BUFFERS) <= sets[name].keys()
        assert find_aliases(sets[name]) == {"head.weight": "emb.weight"}  # stored once

    torch.manual_seed(5)
    resumed = TiedLM()
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=0.1)
    loaded = load_standard(tmp_path / "last", model=resumed, optimizer=resumed_opt, info=DistInfo())
    resumed_ema = EMA(resumed, 0.5, warmup=False)
    resumed_ema.load(loaded.ema_state_dict, loaded.meta["trainer"]["global_step"])
    assert resumed.head.weight is resumed.emb.weight and same_state(model, resumed)

    x = batches(6)[-1]  # one more step on both: bitwise the same (weights, buffers, EMA)
    step(model, opt, x, ema)
    step(resumed, resumed_opt, x, resumed_ema)
    assert same_state(model, resumed)
    a, b = ema.state_dict_for(model), resumed_ema.state_dict_for(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_best_and_iter_files_load_back_the_ema_values_retied(tmp_path: Path) -> None:
    model, _, ema, by_hand = trained()
    path = tmp_path / "model_best.pth"
    write_weights_file(path, model, {"step": 4}, ema.state_dict_for(model))
    assert json.loads((tmp_path / "model_best.pth.json").read_text())["step"] == 4

    torch.manual_seed(5)
    fresh = TiedLM()
    load_weights(fresh, path, weights="ema")
    assert fresh.head.weight is fresh.emb.weight
    assert torch.allclose(fresh.emb.weight, by_hand, atol=1e-6)
    assert all(torch.equal(fresh.state_dict()[k], model.state_dict()[k]) for k in BUFFERS)
    load_weights(fresh, path, weights="raw")
    assert fresh.head.weight is fresh.emb.weight and same_state(fresh, model)


def test_a_stale_or_once_named_tied_tensor_loads_strictly(tmp_path: Path) -> None:
    model, _, ema, _ = trained()
    good = ema.state_dict_for(model)
    stale = {k: v.clone() for k, v in good.items()}
    stale["head.weight"] = model.emb.weight.detach().clone()  # differs from the canonical emb.weight
    torch.save({"state_dict": model.state_dict(), "ema_state_dict": stale}, tmp_path / "stale.pth")
    fresh = TiedLM()
    load_weights(fresh, tmp_path / "stale.pth", weights="ema")  # last copy would win: the raw head
    assert fresh.head.weight is fresh.emb.weight and torch.equal(fresh.emb.weight, good["emb.weight"])

    once = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # as Hugging Face files store it
    torch.save(once, tmp_path / "once.pth")
    fresh = TiedLM()
    load_weights(fresh, tmp_path / "once.pth")
    assert fresh.head.weight is fresh.emb.weight and same_state(fresh, model)
    with pytest.raises(Exception, match="missing 1: head.weight"):  # an untied model needs both names
        load_weights(TiedLM(tie=False), tmp_path / "once.pth")


def test_follow_model_ties_prefers_the_canonical_name_and_ignores_untied_models() -> None:
    tied, untied = TiedLM(), TiedLM(tie=False)
    assert tied_groups(tied) == [["emb.weight", "head.weight"]] and tied_groups(untied) == []
    a, b = torch.zeros(VOCAB, DIM), torch.ones(VOCAB, DIM)
    assert follow_model_ties(tied, {"head.weight": b, "emb.weight": a})["head.weight"] is a
    assert follow_model_ties(tied, {"head.weight": b})["emb.weight"] is b
    assert follow_model_ties(untied, {"head.weight": b, "emb.weight": a})["head.weight"] is b


# ------------------------------------------------------------------ exports
@pytest.mark.parametrize("weights", ["raw", "ema"])
def test_exports_store_the_tied_tensor_once_and_load_back_retied(tmp_path: Path, weights: str) -> None:
    model, _, ema, _ = trained()
    ema_sd = ema.state_dict_for(model)
    want = ema_sd if weights == "ema" else model.state_dict()
    torch.save({"state_dict": model.state_dict(), "ema_state_dict": ema_sd}, tmp_path / "weights.pth")

    out = export(tmp_path / "weights.pth", tmp_path / "st", weights=weights)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "head.weight" not in f.keys() and set(BUFFERS) <= set(f.keys())
        assert json.loads(f.metadata()["pimm.aliases"]) == {"head.weight": "emb.weight"}
    for fresh in (TiedLM(), TiedLM(tie=False)):  # an untied build is re-tied by load_exported
        load_exported(fresh, out)
        assert fresh.head.weight is fresh.emb.weight
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
    fresh = TiedLM()
    load_weights(fresh, out)  # an export is a raw weight set of its own
    assert fresh.head.weight is fresh.emb.weight and all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())

    out_bin = export(tmp_path / "weights.pth", tmp_path / "bin", weights=weights, fmt="bin")
    fresh = TiedLM(tie=False)
    load_exported(fresh, out_bin)
    assert fresh.head.weight is fresh.emb.weight and torch.equal(fresh.emb.weight, want["emb.weight"])

    for name in ("w.safetensors", "w.pth"):
        export_weights(tmp_path / "weights.pth", tmp_path / name, weights=weights)
        fresh = TiedLM()
        load_weights(fresh, tmp_path / name)
        assert fresh.head.weight is fresh.emb.weight
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())


def test_live_ema_set_written_as_safetensors_stores_the_tie(tmp_path: Path) -> None:
    # what Trainer.save_model(weights="ema") writes
    model, _, ema, _ = trained()
    assert write_safetensors(ema.state_dict_for(model), tmp_path / "m.safetensors") == {"head.weight": "emb.weight"}
    sd = read_weight_sets(tmp_path / "m.safetensors")["raw"]
    assert sd["head.weight"] is sd["emb.weight"] and set(BUFFERS) <= sd.keys()


# ------------------------------------------------------------------ warm start
def test_warm_start_from_a_tied_checkpoint_into_a_tied_model(tmp_path: Path) -> None:
    model, _, ema, by_hand = trained()
    write_weights_file(tmp_path / "w.pth", model, {"step": 4}, ema.state_dict_for(model))
    torch.manual_seed(5)
    fresh = TiedLM()
    report = warm_start(fresh, tmp_path / "w.pth", weight_set="ema")
    assert report.missing == [] and report.unexpected == [] and "head.weight" in report.loaded
    assert report.loaded_params == report.model_params == 4  # tied names counted once each
    assert fresh.head.weight is fresh.emb.weight and torch.allclose(fresh.emb.weight, by_hand, atol=1e-6)
    assert all(torch.equal(fresh.state_dict()[k], model.state_dict()[k]) for k in BUFFERS)

    out = export(tmp_path / "w.pth", tmp_path / "st", weights="ema")  # the alias dropped in the file
    fresh = TiedLM()
    report = warm_start(fresh, out)
    assert report.missing == [] and fresh.head.weight is fresh.emb.weight
    assert torch.allclose(fresh.emb.weight, by_hand, atol=1e-6)

    once = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # the tie named once in the file
    torch.save(once, tmp_path / "once.pth")
    fresh = TiedLM()
    report = warm_start(fresh, tmp_path / "once.pth")
    assert report.missing == [] and "head.weight" in report.loaded and same_state(fresh, model)
