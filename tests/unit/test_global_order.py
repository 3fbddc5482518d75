"""The global data order's pieces: the sampler deals the same micro-batches to any number of ranks
(what each step trains depends on the seed and the epoch only), a mid-epoch start at any world size
continues with the samples not yet consumed, the window derived from the world size (and the one
line refusing a world size that does not divide), the micro-batch RNG streams, the resume
policy's ``global_order`` and ``order`` rows, and the BatchNorm warning of a world-size change.
(End to end at 1, 2 and 3 ranks: tests/e2e/test_elastic.py.)"""

from __future__ import annotations

import pytest
import torch

from pimm_core.errors import ConfigError
from pimm_core.data.global_order import GlobalOrderSampler, seed_micro_batch, window_of
from pimm_core.run.topology import ROWS, plan_resume


def _steps(length: int, world: int, *, start: int = 0, epoch: int = 0, global_batch: int = 16, batch: int = 4):
    """Each optimizer step's samples over all ranks (sets) and micro-batches by their index in the step."""
    samplers = [GlobalOrderSampler(length, batch, global_batch, r, world, seed=7) for r in range(world)]
    per_rank = []
    for s in samplers:
        s.set_epoch(epoch)
        s.set_start(start * s.window)
        per_rank.append(list(s))
    window = samplers[0].window
    steps = []
    for k in range(len(per_rank[0]) // window):
        micro = {a * world + r: per_rank[r][k * window + a] for r in range(world) for a in range(window)}
        steps.append([micro[j] for j in range(len(micro))])
    return steps


def test_the_same_micro_batches_whatever_the_world_size():
    one, two, four = _steps(70, 1), _steps(70, 2), _steps(70, 4)
    assert one == two == four and len(one) == 70 // 16  # the tail of 70 % 16 = 6 samples is not trained
    flat = [i for step in one for mb in step for i in mb]
    assert len(flat) == len(set(flat)) == 64
    assert _steps(70, 2, epoch=1) != two  # a new permutation each epoch, from (seed, epoch)


def test_a_mid_epoch_start_at_another_world_size_continues_with_the_rest():
    whole = _steps(70, 2)
    assert _steps(70, 1, start=2) == whole[2:] == _steps(70, 4, start=2)
    sampler = GlobalOrderSampler(70, 4, 16, 0, 2, seed=7)
    assert len(sampler) == 4 * 2  # this rank's micro-batches in a whole epoch: steps x window


def test_the_window_is_derived_and_a_world_size_that_does_not_divide_is_one_line():
    assert window_of(64, 8, 1) == 8 and window_of(64, 8, 4) == 2
    with pytest.raises(ConfigError, match=r"^train.global_batch = 64 is 8 micro-batches of 8, which do not divide "
                                          r"among 3 ranks; run on 1, 2, 4, 8 ranks, or change train.global_batch$"):
        window_of(64, 8, 3)
    with pytest.raises(ConfigError, match=r"not a multiple of data.batch_size = 24"):
        window_of(64, 24, 1)


def test_micro_batch_streams_depend_on_seed_step_and_index_only():
    def draw(step, index):
        seed_micro_batch(3, step, index)
        return torch.rand(4)

    assert torch.equal(draw(5, 2), draw(5, 2))
    assert not torch.equal(draw(5, 2), draw(5, 3)) and not torch.equal(draw(5, 2), draw(6, 2))


def _manifest(**kw):
    return {"step": 5, "epoch": 0, "iter": 10, "world_size": 2, "strategy": "ddp", "workers_per_rank": 0,
            "batch_size": 8, "grad_accum": 2, "epoch_start_step": 0, "has_loader_state": True,
            "data_order": "global", "global_batch": 32, **kw}


def test_a_world_size_change_under_the_global_order_keeps_the_cursor():
    p = plan_resume(_manifest(), world_size=1, strategy="ddp", workers_per_rank=0, strict=True, grad_accum=2,
                    batch_size=8, order="global", global_batch=32)
    assert p.row == "global_order" and p.description == ROWS["global_order"]
    assert (p.step, p.epoch, p.iter) == (5, 0, 20)  # 5 steps x the window of 4 at one rank
    assert p.replay_boundary is None and p.topology["grad_accum"] == 4 and p.topology["saved_grad_accum"] == 2
    assert any("under the global data order" in w for w in p.warnings)
    same = plan_resume(_manifest(), world_size=2, strategy="ddp", workers_per_rank=0, strict=True, grad_accum=2,
                       batch_size=8, order="global", global_batch=32)
    assert same.row == "same" and same.exact


@pytest.mark.parametrize("change", [{"order": "rank"}, {"global_batch": 64}])
def test_changing_the_order_or_the_global_batch_restarts_the_epoch(change):
    planned = {"order": "global", "global_batch": 32, **change}
    p = plan_resume(_manifest(), world_size=2, strategy="ddp", workers_per_rank=0, strict=True, grad_accum=2,
                    batch_size=8, **planned)
    assert p.row == "order" and p.replay_boundary == {"epoch": 0, "step": 0, "from_iter": 10}


def test_a_default_order_checkpoint_keeps_its_rows():
    m = {k: v for k, v in _manifest().items() if k not in ("data_order", "global_batch")}
    p = plan_resume(m, world_size=1, strategy="ddp", workers_per_rank=0, strict=True, grad_accum=2, batch_size=8)
    assert p.row == "world_size" and p.replay_boundary is not None


def test_the_derived_window_is_not_a_config_change():
    from pimm_core.config import config_from_dict
    from pimm_core.run.topology import config_diff

    def cfg(order: str, accum: int) -> dict:
        return config_from_dict({"data": {"order": order}, "train": {"global_batch": 32, "grad_accum": accum}}).to_dict()

    assert config_diff(cfg("global", 4), cfg("global", 2)) == []
    assert config_diff(cfg("rank", 4), cfg("rank", 2)) == ["train.grad_accum: 4 -> 2"]


def test_a_world_size_change_warns_about_batchnorm_running_statistics_and_syncbatchnorm():
    from torch import nn

    from pimm_core.data.global_order import running_stats_warning

    assert running_stats_warning(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))) == []
    assert running_stats_warning(nn.Sequential(nn.BatchNorm1d(4, track_running_stats=False))) == []
    line, = running_stats_warning(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4)))
    assert "BatchNorm running statistics (1 and 1 more)" in line and "rank 0" in line
    line, = running_stats_warning(nn.Sequential(nn.SyncBatchNorm(4)))
    assert "SyncBatchNorm (0)" in line and "does not keep the trajectory" in line
