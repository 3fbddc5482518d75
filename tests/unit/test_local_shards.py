"""A rank's DTensor shards as plain tensors and back (the memory tier's sharded state), at one rank
under FSDP2 (a one-rank gloo group in this process; 2-rank runs: tests/e2e/test_memory_sharded.py)."""

from __future__ import annotations

import io

import pytest
import torch


@pytest.fixture
def sharded():
    import torch.distributed as tdist
    from torch.distributed.fsdp import fully_shard

    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        yield model, opt
    finally:
        tdist.destroy_process_group()


def test_shards_round_trip_through_a_weights_only_load(sharded):
    from torch.distributed.tensor import DTensor

    from pimm_core.checkpoint.tensors.local_shards import from_local, has_local, live_layouts, to_local

    model, opt = sharded
    state = {"model": to_local(model.state_dict()), "optimizer": to_local(opt.state_dict())}
    assert has_local(state) and not has_local({"model": {"w": torch.zeros(1)}})
    buf = io.BytesIO()
    torch.save(state, buf)
    back = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)  # (a DTensor itself would be refused)
    layouts = live_layouts(model)
    rebuilt = from_local(back["model"], layouts)
    for k, v in model.state_dict().items():
        assert isinstance(rebuilt[k], DTensor) and rebuilt[k].placements == v.placements
        assert rebuilt[k].shape == v.shape and torch.equal(rebuilt[k].to_local(), v.to_local())
    optim = from_local(back["optimizer"], layouts)
    assert torch.equal(optim["state"][0]["exp_avg"].to_local(), opt.state_dict()["state"][0]["exp_avg"].to_local())


def test_a_shard_of_another_layout_is_refused(sharded):
    from pimm_core.checkpoint.tensors.local_shards import from_local, live_layouts, to_local

    model, _ = sharded
    entry = to_local(model.state_dict())["0.weight"]
    with pytest.raises(ValueError, match=r"mesh \(1,\) .* fits no parameter of the model now"):
        from_local({"0.weight": entry}, {})  # (an unsharded model now)
    with pytest.raises(ValueError, match="fits no parameter"):
        from_local({"0.weight": {**entry, "mesh": [2]}}, live_layouts(model))  # (taken at another world size)


def test_shards_of_another_world_size_are_assembled_and_cut_to_the_live_layout(sharded):
    """Two old ranks' shards of rows 0-3 and 4-5 (as ``to_local`` records them at 2 ranks) become the live
    one-rank DTensor, every value where it was; a shard without an offset is refused."""
    from torch.distributed.tensor import DTensor

    from pimm_core.checkpoint.tensors.local_shards import MARK, from_owners

    model, _ = sharded
    live = model.state_dict()["0.weight"]
    whole = torch.arange(24, dtype=torch.float32).view(6, 4)
    spec = {"mesh": [2], "dims": [], "placements": "(Shard(dim=0),)", "shape": [6, 4], "stride": [4, 1]}
    owners = [{"w": {MARK: whole[:4].clone(), **spec, "offset": [0, 0]}, "n": 7},
              {"w": {MARK: whole[4:].clone(), **spec, "offset": [4, 0]}, "n": 8}]
    got = from_owners(owners, {"w": live})
    assert isinstance(got["w"], DTensor) and got["w"].placements == live.placements
    assert torch.equal(got["w"].to_local(), whole) and got["n"] == 7  # (other values: old rank 0's)
    assert torch.equal(from_owners(owners, {})["w"], whole)  # no live DTensor: the whole tensor
    owners[1]["w"]["offset"] = None
    with pytest.raises(ValueError, match="no offset"):
        from_owners(owners, {"w": live})
