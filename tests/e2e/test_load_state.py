"""load_standard into freshly built optimizers: exact state, and a clean optimizer when state is skipped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pimm_core.checkpoint.formats.standard import load_standard, save_standard
from pimm_core.process.dist import DistInfo


# the trainer state a resume needs (load_standard refuses a checkpoint without it)
META = {"trainer": {"global_step": 3, "epoch": 0, "iter": 3}, "scheduler": {}, "scaler": {}, "world_size": 1,
        "workers_per_rank": 0}


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.BatchNorm1d(4))


def _trained(make_opt, steps: int = 3):
    model = _model(0)
    opt = make_opt(model)
    for _ in range(steps):
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


OPTIMIZERS = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9),
    "adam_amsgrad_two_groups": lambda m: torch.optim.Adam(
        [{"params": m[0].parameters(), "lr": 1e-3}, {"params": list(m[2].parameters()) + list(m[3].parameters())}],
        lr=1e-2, amsgrad=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fresh_optimizer_gets_the_saved_state_bitwise_and_steps_identically(tmp_path, name):
    model, opt = _trained(OPTIMIZERS[name])
    save_standard(tmp_path, model=model, optimizer=opt, meta=META, rank_state={}, manifest={"kind": "last", "step": 3},
                  info=DistInfo())
    fresh = _model(1)
    fresh_opt = OPTIMIZERS[name](fresh)
    load_standard(tmp_path / "last", model=fresh, optimizer=fresh_opt, info=DistInfo())

    assert fresh_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    saved, loaded = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    for i in saved:
        assert saved[i].keys() == loaded[i].keys()
        for k in saved[i]:
            assert torch.equal(torch.as_tensor(saved[i][k]), torch.as_tensor(loaded[i][k])), (i, k)
    x = torch.randn(5, 8)
    for m, o in ((model, opt), (fresh, fresh_opt)):  # the next step is the same step
        m(x).pow(2).mean().backward()
        o.step()
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_skipped_optimizer_state_leaves_a_fresh_optimizer(tmp_path):
    model, opt = _trained(OPTIMIZERS["adamw"])
    save_standard(tmp_path, model=model, optimizer=opt, meta=META, rank_state={}, manifest={"kind": "last", "step": 3},
                  info=DistInfo())
    fresh = _model(1)
    sgd = OPTIMIZERS["sgd_momentum"](fresh)  # no momentum_buffer in an AdamW checkpoint
    loaded = load_standard(tmp_path / "last", model=fresh, optimizer=sgd, info=DistInfo(), strict=False)
    assert loaded.skipped and "momentum_buffer" in loaded.skipped[0]
    assert len(sgd.state) == 0  # as freshly built: the first step initializes it
    for a, b in zip(model.parameters(), fresh.parameters()):  # the weights were still restored
        assert torch.equal(a, b)


def test_a_failed_load_leaves_a_fresh_optimizer_without_uninitialized_state(tmp_path):
    model, opt = _trained(OPTIMIZERS["adamw"])
    save_standard(tmp_path, model=model, optimizer=opt, meta=META, rank_state={}, manifest={"kind": "last", "step": 3},
                  info=DistInfo())
    shard = next((tmp_path / "last" / "trainer.dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: the read fails
    fresh = _model(1)
    fresh_opt = OPTIMIZERS["adamw"](fresh)
    with pytest.raises(BaseException):  # DCP's CheckpointException is a BaseException
        load_standard(tmp_path / "last", model=fresh, optimizer=fresh_opt, info=DistInfo())
    assert len(fresh_opt.state) == 0


def test_fresh_optimizer_state_keeps_the_parameters_memory_layout(tmp_path):
    def conv():
        torch.manual_seed(0)
        return nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)

    model = conv()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    opt.step()
    save_standard(tmp_path, model=model, optimizer=opt, meta=META, rank_state={}, manifest={"kind": "last", "step": 1},
                  info=DistInfo())
    fresh = conv()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_standard(tmp_path / "last", model=fresh, optimizer=fresh_opt, info=DistInfo())
    weight = fresh.weight
    assert fresh_opt.state[weight]["exp_avg"].stride() == weight.stride() == opt.state[model.weight]["exp_avg"].stride()
    assert torch.equal(fresh_opt.state[weight]["exp_avg_sq"], opt.state[model.weight]["exp_avg_sq"])


@pytest.mark.parametrize("strict", [True, False])
def test_state_of_a_parameter_frozen_since_the_save_is_named_or_skipped(tmp_path, strict):
    from pimm_core.errors import CheckpointError

    model, opt = _trained(OPTIMIZERS["adamw"])
    save_standard(tmp_path, model=model, optimizer=opt, meta=META, rank_state={}, manifest={"kind": "last", "step": 3},
                  info=DistInfo())
    fresh = _model(1)
    fresh[0].weight.requires_grad_(False)  # frozen for fine-tuning: the optimizer has no state for it
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    if strict:
        with pytest.raises(CheckpointError, match=r"not in this optimizer: optim/state/0\.weight/"):
            load_standard(tmp_path / "last", model=fresh, optimizer=fresh_opt, info=DistInfo())
    else:
        loaded = load_standard(tmp_path / "last", model=fresh, optimizer=fresh_opt, info=DistInfo(), strict=False)
        assert "not in this optimizer: optim/state/0.weight/" in loaded.skipped[0]
        assert torch.equal(fresh[0].weight, model[0].weight)
    assert len(fresh_opt.state) == 0
