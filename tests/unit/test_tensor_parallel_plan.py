"""Tensor-parallel plans and layouts checked before training (no process group needed), and
the resume policy's rows for a change of ``parallel.tp``.

The plans' numerics (a TP forward/backward equals the whole model's) and the checks under
torchrun are in ``tests/e2e/test_tensor_parallel.py``.
"""

from __future__ import annotations

import pytest
from torch import nn

from pimm_core.config import Config, ParallelConfig, TrainConfig
from pimm_core.errors import ConfigError
from pimm_core.run.topology import plan_resume
from pimm_core.train.tensor_parallel import check_layout, data_parallel, planned_modules, resolve_plan
from pimm_core.process.dist import DistInfo


def _cfg(tp: int = 2, plan: str | None = None, strategy: str = "ddp") -> Config:
    return Config(parallel=ParallelConfig(tp=tp, tp_plan=plan), train=TrainConfig(strategy=strategy))


def _charlm(**kw):
    from examples.charlm.model import CharTransformer

    return CharTransformer(**{"block_size": 8, "d_model": 16, "n_layers": 2, "n_heads": 2, **kw})


def test_layouts_the_ranks_cannot_form_are_refused():
    with pytest.raises(ConfigError, match=r"parallel.tp = 3 does not divide the world size 4; launch a multiple of 3"):
        check_layout(_cfg(3, strategy="fsdp"), 4)
    with pytest.raises(ConfigError, match=r"2 data-parallel ranks, which DDP cannot reduce .* train.strategy = 'fsdp'"):
        check_layout(_cfg(2), 4)
    check_layout(_cfg(2, strategy="fsdp"), 4)
    check_layout(_cfg(2), 2)


def test_data_parallel_ranks_are_rows_of_the_mesh():
    dp = [data_parallel(DistInfo(r, 4), 2) for r in range(4)]
    assert [(d.rank, d.world_size) for d in dp] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert data_parallel(DistInfo(1, 2), 1) == DistInfo(1, 2)


def test_built_in_charlm_plan_names_its_projections():
    model = _charlm()
    plan = resolve_plan(model, _cfg(2))
    names = sorted(fqn for fqn, _, _ in planned_modules(model, plan, 2))
    assert names == sorted(f"blocks.{i}.{n}" for i in range(2) for n in ("q", "k", "v", "proj", "mlp.0", "mlp.2"))


def test_built_in_hugging_face_plans_match_their_modules():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    got = {type(m).__name__: sorted(f for f, _, _ in planned_modules(m, resolve_plan(m, _cfg(2)), 2))
           for m in (gpt2, llama)}
    assert got["GPT2LMHeadModel"] == [f"transformer.h.{i}.mlp.{n}" for i in range(2) for n in ("c_fc", "c_proj")]
    assert len(got["LlamaForCausalLM"]) == 2 * 7 and "model.layers.1.self_attn.o_proj" in got["LlamaForCausalLM"]
    with pytest.raises(ConfigError, match="does not divide the 2 attention heads of model.layers.0.self_attn"):
        planned_modules(llama, resolve_plan(llama, _cfg(4)), 4)  # (num_key_value_heads = 2)


def test_a_model_without_a_plan_is_refused():
    with pytest.raises(ConfigError, match=r"the model \(Sequential\) has no tensor-parallel plan .* parallel.tp_plan"):
        resolve_plan(nn.Sequential(nn.Linear(4, 4)), _cfg(2))


def plan_with_a_typo(model):
    from torch.distributed.tensor.parallel import ColwiseParallel

    return {"blocks.*.qq": ColwiseParallel()}


def plan_of_odd_features(model):
    from torch.distributed.tensor.parallel import ColwiseParallel

    return {"0": ColwiseParallel()}


def plan_of_the_tied_head(model):
    from torch.distributed.tensor.parallel import ColwiseParallel

    return {"head": ColwiseParallel()}


def not_a_plan(model):
    return ["blocks.0.q"]


def test_bad_plans_name_the_problem():
    here = "tests.unit.test_tensor_parallel_plan"
    with pytest.raises(ConfigError, match=r"names 'blocks.\*.qq', which is no module of the model"):
        planned_modules(_charlm(), resolve_plan(_charlm(), _cfg(2, f"{here}:plan_with_a_typo")), 2)
    odd = nn.Sequential(nn.Linear(4, 5))
    with pytest.raises(ConfigError, match=r"parallel.tp = 2 does not divide the 5 output features of '0'"):
        planned_modules(odd, resolve_plan(odd, _cfg(2, f"{here}:plan_of_odd_features")), 2)
    with pytest.raises(ConfigError, match=r"shards 'head', whose 'head.weight' is tied"):
        planned_modules(_charlm(), resolve_plan(_charlm(), _cfg(2, f"{here}:plan_of_the_tied_head")), 2)
    with pytest.raises(ConfigError, match=r"returned list, not a dict of module FQN -> ParallelStyle"):
        resolve_plan(_charlm(), _cfg(2, f"{here}:not_a_plan"))
    with pytest.raises(ConfigError, match=r"does not divide the 3 attention heads of blocks.0 \(n_heads\)"):
        model = _charlm(d_model=12, n_heads=3)
        planned_modules(model, resolve_plan(model, _cfg(2)), 2)


MANIFEST = {"step": 10, "epoch": 1, "iter": 6, "epoch_start_step": 5, "strategy": "ddp", "workers_per_rank": 0,
            "batch_size": 8, "grad_accum": 2, "has_loader_state": True}


def _plan(saved_ws, saved_tp, ws, tp, saved_strategy="ddp", strategy="ddp"):
    manifest = {**MANIFEST, "world_size": saved_ws, "strategy": saved_strategy, **({"tp": saved_tp} if saved_tp > 1 else {})}
    return plan_resume(manifest, world_size=ws, strategy=strategy, workers_per_rank=0, strict=True, grad_accum=2,
                       batch_size=8, tp=tp)


@pytest.mark.parametrize("saved,planned", [((2, 2, "ddp"), (1, 1, "ddp")), ((1, 1, "ddp"), (2, 2, "ddp")),
                                           ((4, 2, "fsdp"), (2, 1, "fsdp"))])
def test_a_layout_change_at_the_same_data_parallel_ranks_continues_from_the_saved_iteration(saved, planned):
    plan = _plan(saved[0], saved[1], planned[0], planned[1], saved[2], planned[2])
    assert (plan.row, plan.restore_cursor, plan.restore_rng, plan.exact) == ("layout", True, True, False)
    assert (plan.step, plan.iter) == (10, 6)
    assert plan.restored[0] == "model weights (resharded through DCP)"
    assert any(w.startswith(f"parallel layout changed: tp {saved[1]} x dp") for w in plan.warnings)
    assert (plan.topology["saved_tp"], plan.topology["tp"]) == (saved[1], planned[1])


def test_a_change_of_data_parallel_ranks_is_the_world_size_row():
    plan = _plan(2, 2, 2, 1)  # tp 2 x dp 1 -> tp 1 x dp 2 on the same 2 ranks
    assert (plan.row, plan.restore_cursor, plan.step, plan.iter) == ("world_size", False, 5, 0)
    assert any(w.startswith("data-parallel ranks changed 1 -> 2") for w in plan.warnings)
    same = _plan(4, 2, 4, 2, "fsdp", "fsdp")
    assert (same.row, same.exact) == ("same", True)
    assert _plan(2, 1, 2, 1).topology.get("tp") is None  # without TP the topology is as before
