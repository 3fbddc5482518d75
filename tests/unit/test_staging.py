"""CPU staging buffers kept between snapshots (memory tier, ``checkpoint.async``)."""

from __future__ import annotations

import torch

from pimm_core.checkpoint.tensors.staging import StagingBuffers


def test_a_second_copy_reuses_the_buffers_and_holds_the_new_values() -> None:
    staging = StagingBuffers()
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    tree = {"model": model.state_dict(), "optimizer": opt.state_dict(), "loader": None}
    first = staging.copy_tree("s", tree)
    ptrs = [first["model"]["weight"].data_ptr(), first["optimizer"]["state"][0]["exp_avg"].data_ptr()]
    assert first["model"]["weight"].data_ptr() != model.weight.data_ptr()  # a copy, not the live tensor

    opt.step()  # the live state changes after the snapshot
    second = staging.copy_tree("s", {"model": model.state_dict(), "optimizer": opt.state_dict(), "loader": None})
    assert [second["model"]["weight"].data_ptr(), second["optimizer"]["state"][0]["exp_avg"].data_ptr()] == ptrs
    assert torch.equal(second["model"]["weight"], model.weight)
    assert torch.equal(second["optimizer"]["state"][0]["exp_avg"], opt.state[model.weight]["exp_avg"])
    assert second["optimizer"]["param_groups"] == opt.state_dict()["param_groups"]  # non-tensors as they are
    assert second["loader"] is None and not second["model"]["weight"].requires_grad


def test_a_changed_shape_or_dtype_gets_a_new_buffer() -> None:
    staging = StagingBuffers()
    a = staging.copy("k", torch.ones(3))
    b = staging.copy("k", torch.ones(4))
    c = staging.copy("k", torch.ones(4, dtype=torch.float64))
    assert a.shape == (3,) and b.shape == (4,) and c.dtype == torch.float64
    assert a.data_ptr() != b.data_ptr() and torch.equal(c, torch.ones(4, dtype=torch.float64))
