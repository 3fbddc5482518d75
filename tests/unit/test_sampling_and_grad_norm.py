"""The training sampler's options (``data.shuffle``, ``data.drop_last``), ``eval.batch_size``, and
the gradient norm each optimizer step records (``grad_norm``, before clipping)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pimm_core.config import DataConfig, TrainConfig
from pimm_core.data.loaders import eval_loader, train_loader
from pimm_core.process.dist import DistInfo
from pimm_core.train.step import APPLIED, WindowStep


def _indices(loader) -> list[int]:
    return [int(i) for (batch,) in loader for i in batch]


def _shards(n: int, world: int, **data) -> list[list[int]]:
    ds = TensorDataset(torch.arange(n))
    cfg = DataConfig(batch_size=2, **data)
    out = []
    for rank in range(world):
        loader, sampler = train_loader(ds, cfg, DistInfo(rank=rank, world_size=world), seed=0)
        sampler.set_epoch(0)
        out.append(_indices(loader))
    return out


def test_by_default_ranks_pad_an_uneven_split_by_repeating_samples():
    shards = _shards(10, 3)
    flat = [i for s in shards for i in s]
    assert len(flat) == 12 and set(flat) == set(range(10))  # two samples train twice per epoch


def test_drop_last_trains_no_sample_twice_and_no_short_batch():
    shards = _shards(10, 3, drop_last=True)
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == 6  # 9 samples in the ranks' shards, 3 each; the short batch of 1 dropped
    assert all(len(s) == 2 for s in shards)


def test_shuffle_false_keeps_the_order():
    assert _shards(10, 2, shuffle=False) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    shuffled = _shards(10, 2)
    assert shuffled != [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]] and sorted(sum(shuffled, [])) == list(range(10))


def test_eval_batch_size():
    ds = TensorDataset(torch.arange(600))
    assert eval_loader(ds, DataConfig(batch_size=32), DistInfo()).batch_size == 256  # the default
    assert eval_loader(ds, DataConfig(batch_size=32), DistInfo(), batch_size=100).batch_size == 100


def _step(grad_clip: float) -> tuple[WindowStep, nn.Linear]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    objective = lambda m, batch: (m(batch[0]).pow(2).sum(), {})  # noqa: E731
    return WindowStep(model, opt, scaler, None, TrainConfig(grad_clip=grad_clip), autocast=lambda: torch.autocast(
        "cpu", enabled=False), distributed=False, objective=objective), model


def test_grad_norm_is_the_norm_before_clipping():
    for clip in (0.0, 1e-3):
        step, model = _step(clip)
        step.backward((torch.ones(5, 4),), window_len=1, last_in_window=True)
        expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert step.finish() == APPLIED
        assert torch.allclose(step.grad_norm, expected), (clip, step.grad_norm, expected)
        assert expected > 1e-3
