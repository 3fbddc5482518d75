"""Built-in tensor-parallel plans (``parallel.tp_plan`` unset): ``{module FQN: ParallelStyle}``
for ``torch.distributed.tensor.parallel.parallelize_module``, one per model family.

Each follows torchtitan's Llama plan (``torchtitan/models/llama3/infra/parallelize.py``): in
every block, the projections into the attention heads and into the MLP's hidden features are
``ColwiseParallel`` (each rank computes its own heads and hidden features), the projections
back to the model width ``RowwiseParallel`` (their partial sums all-reduced), so one block
costs two all-reduces forward and two backward. Embeddings, norms and the (tied) output head
stay whole on every rank; a plan may name FQNs with ``*`` for one name segment
(``"layers.*.mlp.up_proj"``), as ``parallelize_module`` matches them.

- :func:`charlm`: the bundled char LM (``examples/charlm``): ``q``/``k``/``v`` and ``mlp.0``
  colwise, ``proj`` and ``mlp.2`` rowwise.
- :func:`llama`: Hugging Face ``LlamaModel``/``LlamaForCausalLM`` (and models with its layer
  names): ``q/k/v_proj``, ``gate_proj``, ``up_proj`` colwise; ``o_proj``, ``down_proj`` rowwise
  (the plan of ``LlamaConfig.base_model_tp_plan``).
- :func:`gpt2`: Hugging Face ``GPT2Model``/``GPT2LMHeadModel``: each block's MLP (``c_fc``
  colwise, ``c_proj`` rowwise). GPT-2's layers are ``Conv1D`` (weight ``(in, out)``, the
  transpose of ``nn.Linear``'s), which :class:`Conv1DColwise`/:class:`Conv1DRowwise` shard;
  its attention stays whole: ``c_attn`` is one fused ``q|k|v`` projection that the model
  splits at the full width, so a column shard would mix queries and keys.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

Plan = dict[str, ParallelStyle]


def _distribute(module: nn.Module, mesh, placements: dict[str, list], src_data_rank) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(param, mesh, placements[name], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad))


class Conv1DColwise(ColwiseParallel):
    """``ColwiseParallel`` for Hugging Face's ``Conv1D`` (``y = x @ W + b``, ``W: (in, out)``):
    ``W`` sharded on its output dimension 1, ``b`` on 0."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        part = lambda _, m, mesh: _distribute(m, mesh, {"weight": [Shard(1)], "bias": [Shard(0)]},  # noqa: E731
                                              self.src_data_rank)
        return distribute_module(module, device_mesh, part,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwise(RowwiseParallel):
    """``RowwiseParallel`` for Hugging Face's ``Conv1D``: ``W`` sharded on its input dimension 0,
    ``b`` replicated (added once, after the partial sums are reduced)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        part = lambda _, m, mesh: _distribute(m, mesh, {"weight": [Shard(0)], "bias": [Replicate()]},  # noqa: E731
                                              self.src_data_rank)
        self.desired_input_layouts = (Shard(-1),)  # (as RowwiseParallel sets it for nn.Linear)
        return distribute_module(module, device_mesh, part,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def _prefix_of(model: nn.Module, name: str) -> str | None:
    """The FQN (with a trailing dot) of the model's first ``nn.ModuleList`` called ``name``; None if none."""
    for fqn, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and fqn.split(".")[-1] == name:
            return fqn + "."
    return None


def charlm(model: nn.Module) -> Plan:
    """The plan of ``examples.charlm.model.CharTransformer`` (``blocks.*``)."""
    return {"blocks.*.q": ColwiseParallel(), "blocks.*.k": ColwiseParallel(), "blocks.*.v": ColwiseParallel(),
            "blocks.*.proj": RowwiseParallel(), "blocks.*.mlp.0": ColwiseParallel(),
            "blocks.*.mlp.2": RowwiseParallel()}


def llama(model: nn.Module) -> Plan:
    """The plan of a Hugging Face Llama (``[model.]layers.*.self_attn``/``mlp``)."""
    p = _prefix_of(model, "layers") or "layers."
    col, row = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"), \
        ("self_attn.o_proj", "mlp.down_proj")
    return {**{f"{p}*.{n}": ColwiseParallel() for n in col}, **{f"{p}*.{n}": RowwiseParallel() for n in row}}


def gpt2(model: nn.Module) -> Plan:
    """The plan of a Hugging Face GPT-2 (``[transformer.]h.*.mlp``)."""
    p = _prefix_of(model, "h") or "h."
    return {f"{p}*.mlp.c_fc": Conv1DColwise(), f"{p}*.mlp.c_proj": Conv1DRowwise()}


#: The built-in plan of each model class, by ``type(model).__name__``.
BUILT_IN: dict[str, Callable[[nn.Module], Plan]] = {
    "CharTransformer": charlm,
    "LlamaModel": llama, "LlamaForCausalLM": llama,
    "GPT2Model": gpt2, "GPT2LMHeadModel": gpt2,
}
