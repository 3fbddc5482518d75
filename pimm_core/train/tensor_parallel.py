"""Tensor parallel (``[parallel] tp``, ``tp_plan``): the ranks as a 2-D mesh ``("dp", "tp")``.

Following torchtitan (``torchtitan/distributed/parallel_dims.py``): the ``tp`` ranks of one
row share every layer of the plan, ``parallelize_module`` over the mesh's ``tp`` dimension;
the data-parallel degree is ``world size / tp`` and ``train.strategy = "fsdp"`` shards over
``dp`` (``fully_shard(mesh=mesh["dp"])``, after TP). Ranks are numbered row-major, so the
``tp`` ranks of one data-parallel rank are neighbours (``rank // tp`` is the data-parallel
rank): on one node they share the fastest links.

The ranks of one ``tp`` group read the same batches and draw the same random numbers (a
dropout after a rowwise layer must drop the same features on each), so the loaders, the
samplers and the seeds see the data-parallel layout (:func:`data_parallel`), not the world.

DDP takes no DTensor parameters: with several data-parallel ranks TP needs FSDP over
``dp``, as torchtitan requires (its ``apply_ddp`` is 1-D only).
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any, Iterable

import torch
from torch import nn

from ..config import Config
from ..process.dist import DistInfo
from ..errors import ConfigError
from ..targets import TargetSpec, call
from .tp_plans import BUILT_IN

HELP = "docs/scaling.md, 'Tensor parallel'"
#: Attributes (of a planned module's parent, or its ``config``) that count attention heads.
HEAD_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads", "num_key_value_heads")


def data_parallel(info: DistInfo, tp: int) -> DistInfo:
    """This rank as the data sees it: data-parallel rank ``rank // tp`` of ``world_size // tp``."""
    if tp <= 1:
        return info
    return DistInfo(info.rank // tp, info.world_size // tp, info.local_rank)


def ranks_of(cfg: Config) -> tuple[DistInfo, DistInfo]:
    """This process's ranks from the launcher's environment (``tp`` set), and its data-parallel
    ranks (:func:`data_parallel`), after :func:`check_layout` (before any process group)."""
    import dataclasses

    from ..process.dist import env_world

    info = env_world()
    check_layout(cfg, info.world_size)
    info = dataclasses.replace(info, tp=cfg.parallel.tp)
    return info, data_parallel(info, cfg.parallel.tp)


def check_layout(cfg: Config, world_size: int) -> None:
    """Refuse a ``parallel.tp`` the ranks cannot form.

    Raises:
        ConfigError: ``tp`` does not divide ``world_size``; or several data-parallel ranks
            under ``train.strategy = "ddp"``.
    """
    tp = cfg.parallel.tp
    if tp <= 1:
        return
    if world_size % tp:
        sizes = ", ".join(str(tp * k) for k in range(1, 4))
        raise ConfigError(f"parallel.tp = {tp} does not divide the world size {world_size}; launch a multiple of {tp} "
                          f"ranks ({sizes}...) or set parallel.tp to a divisor of {world_size}")
    if world_size // tp > 1 and cfg.train.strategy == "ddp":
        raise ConfigError(f"parallel.tp = {tp} on {world_size} ranks makes {world_size // tp} data-parallel ranks, "
                          "which DDP cannot reduce over tensor-parallel (DTensor) parameters; set train.strategy = "
                          "'fsdp' (FSDP2 shards over the data-parallel ranks, as torchtitan), or parallel.tp = "
                          f"{world_size}")


def device_mesh(device: torch.device, world_size: int, tp: int):
    """The 2-D ``DeviceMesh`` ``("dp", "tp")`` of ``(world_size // tp, tp)`` ranks, row-major."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def resolve_plan(model: nn.Module, cfg: Config, config_path=None) -> dict[str, Any]:
    """The model's plan: ``parallel.tp_plan``'s ``fn(model)``, else the built-in plan of its class.

    Raises:
        ConfigError: no plan for the model; the target fails or returns something else than a
            dict of FQN -> ``ParallelStyle``.
    """
    from torch.distributed.tensor.parallel import ParallelStyle

    entry = cfg.parallel.tp_plan
    if entry is None:
        fn = BUILT_IN.get(type(model).__name__)
        if fn is None:
            raise ConfigError(f"parallel.tp = {cfg.parallel.tp} but the model ({type(model).__name__}) has no "
                              "tensor-parallel plan (built in: " + ", ".join(sorted(BUILT_IN)) + "); set "
                              "parallel.tp_plan = 'package.module:fn' returning {module FQN: ColwiseParallel() or "
                              f"RowwiseParallel()...}} ({HELP}), or parallel.tp = 1")
        plan, entry = fn(model), f"the built-in plan of {type(model).__name__}"
    else:
        plan = call(TargetSpec("parallel.tp_plan", entry), model, config_path=config_path)
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, ParallelStyle)
                                             for k, v in plan.items()):
        raise ConfigError(f"parallel.tp_plan: {entry} returned {type(plan).__name__}, not a dict of module FQN -> "
                          f"ParallelStyle (ColwiseParallel(), RowwiseParallel()...); {HELP}")
    if not plan:
        raise ConfigError(f"parallel.tp_plan: {entry} returned an empty plan: nothing would be split across the "
                          f"{cfg.parallel.tp} tensor-parallel ranks; name the model's linear layers ({HELP})")
    return plan


def planned_modules(model: nn.Module, plan: dict[str, Any], tp: int) -> list[tuple[str, nn.Module, Any]]:
    """``(fqn, module, style)`` for every module the plan names (``*`` matches one name segment),
    checked against the model and ``tp``.

    Raises:
        ConfigError: a plan key matches no module; a sharded dimension (features, embeddings)
            or the parent's attention heads are not a multiple of ``tp``; a planned module holds
            a parameter tied to another module's (sharding would untie them).
    """
    from ..checkpoint.tensors.ties import tied_groups

    names = dict(model.named_modules())
    out = []
    for key, style in plan.items():
        pattern = key.split(".")
        hits = [n for n in names if n and len(n.split(".")) == len(pattern)
                and all(fnmatch.fnmatchcase(a, p) for a, p in zip(n.split("."), pattern))]
        if not hits:
            near = [n for n in names if n and n.split(".")[-1] == pattern[-1]][:3] or \
                [n for n, m in names.items() if isinstance(m, nn.Linear)][:3]
            raise ConfigError(f"parallel.tp_plan names {key!r}, which is no module of the model "
                              f"({type(model).__name__}); its modules are named like {near}; fix the plan's keys")
        out += [(n, names[n], style) for n in hits]
    tied = {name for group in tied_groups(model) for name in group}
    for fqn, module, style in out:
        _check_divisible(fqn, module, style, tp)
        held = [f"{fqn}.{n}" for n, _ in module.named_parameters(recurse=False) if f"{fqn}.{n}" in tied]
        if held:
            raise ConfigError(f"parallel.tp_plan shards {fqn!r}, whose {held[0]!r} is tied to another module's "
                              "parameter (sharding one would untie them); leave it out of the plan")
        parent = names[fqn.rsplit(".", 1)[0]] if "." in fqn else model
        for holder in (parent, getattr(parent, "config", None)):
            for attr in HEAD_ATTRS:
                heads = getattr(holder, attr, None)
                if isinstance(heads, int) and heads % tp:
                    raise ConfigError(f"parallel.tp = {tp} does not divide the {heads} attention heads of "
                                      f"{fqn.rsplit('.', 1)[0] or 'the model'} ({attr}); set parallel.tp to a divisor "
                                      f"of {heads}")
    return out


def _check_divisible(fqn: str, module: nn.Module, style: Any, tp: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from .tp_plans import Conv1DColwise, Conv1DRowwise

    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return
    if isinstance(style, (Conv1DColwise, Conv1DRowwise)):  # (in, out)
        dim = 1 if isinstance(style, Conv1DColwise) else 0
    elif isinstance(module, nn.Embedding):
        dim = 1 if isinstance(style, ColwiseParallel) else 0
    elif isinstance(style, (ColwiseParallel, RowwiseParallel)):  # nn.Linear: (out, in)
        dim = 0 if isinstance(style, ColwiseParallel) else 1
    else:
        return
    if w.shape[dim] % tp:
        what = "output" if isinstance(style, ColwiseParallel) else "input"
        raise ConfigError(f"parallel.tp = {tp} does not divide the {w.shape[dim]} {what} features of {fqn!r} "
                          f"({type(style).__name__}); set parallel.tp to a divisor of {w.shape[dim]}")


def apply_tp(model: nn.Module, plan: dict[str, Any], tp_mesh) -> None:
    """``parallelize_module(model, tp_mesh, plan)``, in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    # DTensor logs a warning at each gather of a parameter sharded on both mesh dimensions
    # (FSDP x TP) into a whole tensor (a checkpoint's weights.pth): expected, not the user's concern
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    parallelize_module(model, tp_mesh, plan)


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Total L2 norm of the gradients (0-d plain tensor) and, with ``max_norm``, clip them to it,
    when they live on several meshes (TP's 2-D DTensors, FSDP's 1-D ones, plain tensors):
    ``torch.nn.utils`` stacks the per-tensor norms, which needs one kind. Each group's norm is
    ``get_total_norm`` (reduced over its mesh by ``full_tensor()``); the total is their L2 norm,
    and ``clip_grads_with_norm_`` scales each group by the same ``max_norm / total``."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    norms = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if not norms:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    if max_norm:
        with implicit_replication():
            for group in groups.values():
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.device))
    return total


def mixed_grads(params: Iterable[nn.Parameter]) -> bool:
    """True when the gradients are of several kinds (plain and DTensor, or DTensors of several meshes)."""
    from torch.distributed.tensor import DTensor

    kinds = {(p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
             for p in params if p.grad is not None}
    return len(kinds) > 1


def memory_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters and optimizer state (local shards of DTensors)."""
    from torch.distributed.tensor import DTensor

    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    params = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    state = sum(local(v).numel() * local(v).element_size() for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": params, "optimizer": state, "total": params + state}


__all__ = ["data_parallel", "check_layout", "device_mesh", "resolve_plan", "planned_modules", "apply_tp",
           "clip_grad_norm_", "mixed_grads", "memory_bytes"]
