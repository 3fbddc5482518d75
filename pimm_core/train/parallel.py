"""How the ranks share the model: ``train.strategy``, ``train.blocks``, activation
checkpointing and ``train.compile``, applied in that order by :func:`parallelize`.

- ``ddp`` (default): every rank holds the whole model, gradients and optimizer state;
  ``DistributedDataParallel`` all-reduces the gradients (one process: the plain model).
- ``fsdp``: ``torch.distributed.fsdp.fully_shard`` (FSDP2) shards parameters, gradients
  and optimizer state across the ranks as DTensors; each of ``train.blocks`` is a unit
  whose parameters are all-gathered for its forward/backward and freed after, then the
  root takes the rest. The ``[fsdp]`` table gives the mixed-precision policy,
  ``reshard_after_forward`` and CPU offload. The order (blocks, then the root) and the
  per-block units follow torchtitan's ``apply_fsdp``.

With ``[parallel] tp = T`` (:mod:`.tensor_parallel`) the ranks form a 2-D mesh ``("dp", "tp")``:
the plan's layers are split across each row of ``T`` ranks first (``parallelize_module``), then
FSDP shards over ``dp``, as torchtitan orders them; DDP wraps nothing then (``dp = 1``).

Activation checkpointing wraps each block's ``forward`` in ``torch.utils.checkpoint``
(non-reentrant), and ``train.compile`` uses ``nn.Module.compile`` (in place): neither
changes a parameter's name, so state dicts, checkpoints and exports carry no
``_checkpoint_wrapped_module.`` or ``_orig_mod.`` prefix.
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch
from torch import nn

from ..config import Config
from ..errors import ConfigError
from ..process.dist import DistInfo
from ..targets import TargetSpec, call, is_target

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parallelize(model: nn.Module, cfg: Config, info: DistInfo, device: torch.device,
                config_path=None) -> nn.Module:
    """The model as the ranks train it: ``model`` already on ``device``; returns the DDP
    wrapper, or ``model`` itself (sharded in place under FSDP, or alone in one process).

    Raises:
        ConfigError: ``train.blocks`` names no module of the model, or a target that fails;
            under FSDP, blocks that split a tied parameter across units.
    """
    t = cfg.train
    blocks = check_blocks(model, cfg, config_path)
    mesh = None
    if cfg.parallel.tp > 1:
        from .tensor_parallel import apply_tp, check_layout, device_mesh, planned_modules, resolve_plan

        check_layout(cfg, info.world_size)
        plan = resolve_plan(model, cfg, config_path)
        planned_modules(model, plan, cfg.parallel.tp)  # (refuses before any module is changed)
        mesh = device_mesh(device, info.world_size, cfg.parallel.tp)
        apply_tp(model, plan, mesh["tp"])
    if t.activation_checkpointing:
        for block in blocks:
            checkpoint_activations(block)
    if t.strategy == "fsdp":
        shard(model, blocks, cfg, device, mesh["dp"] if mesh is not None else None)
    if t.compile:
        model.compile()  # in place: parameter names unchanged (no _orig_mod.)
    if t.strategy == "ddp" and info.distributed and mesh is None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, find_unused_parameters=t.find_unused_parameters)
    return model


def check_blocks(model: nn.Module, cfg: Config, config_path=None) -> list[nn.Module]:
    """The blocks :func:`parallelize` will use (:func:`find_blocks`), checked as it checks
    them (under FSDP, :func:`check_tied_units` too) without changing ``model``; ``--dry-run``
    calls it so a ``train.blocks`` the launch refuses fails there the same way.

    Raises:
        ConfigError: as :func:`find_blocks` and :func:`check_tied_units`.
    """
    blocks = find_blocks(model, cfg.train.blocks, config_path) if cfg.train.blocks else []
    if cfg.train.strategy == "fsdp":
        check_tied_units(model, blocks)
    return blocks


def find_blocks(model: nn.Module, names: list[str], config_path=None) -> list[nn.Module]:
    """The submodules ``train.blocks`` names: instances of a class of that name (``type(m).__name__``),
    or the modules a target ``"pkg.mod:fn"`` returns as ``fn(model)``; the root excluded, a
    module named twice listed once. In model order, a block nested in another block before
    it (post-order: FSDP2 shards inner units first).

    Raises:
        ConfigError: an entry matches no submodule, or a target returns something else.
    """
    found: dict[int, nn.Module] = {}
    for entry in names:
        if is_target(entry):
            spec = TargetSpec("train.blocks", entry)
            picked = list(_as_modules(call(spec, model, config_path=config_path), entry, model))
        else:
            picked = [m for m in model.modules() if type(m).__name__ == entry and m is not model]
        if not picked:
            classes = sorted({type(m).__name__ for m in model.modules() if m is not model})
            raise ConfigError(f"train.blocks: {entry!r} matches no submodule of the model; its module classes "
                              f"are {classes[:12]}")
        for m in picked:
            found.setdefault(id(m), m)
    order: dict[int, int] = {}
    _post_order(model, order)
    return sorted(found.values(), key=lambda m: order[id(m)])


def _post_order(module: nn.Module, order: dict[int, int]) -> None:
    for child in module.children():
        if id(child) not in order:
            _post_order(child, order)
    order.setdefault(id(module), len(order))


def _as_modules(value, entry: str, model: nn.Module) -> Iterable[nn.Module]:
    members = {id(m) for m in model.modules() if m is not model}
    fix = "return the model's own blocks, e.g. list(model.layers)"
    if isinstance(value, nn.Module):
        items = [value]
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes, dict)):
        items = list(value)
    else:
        raise ConfigError(f"train.blocks: {entry} returned {type(value).__name__}, not a list of modules; {fix}")
    for m in items:
        if m is model:
            raise ConfigError(f"train.blocks: {entry} returned the model itself; the root is always its own "
                              f"unit: {fix}")
        if not isinstance(m, nn.Module) or id(m) not in members:
            raise ConfigError(f"train.blocks: {entry} returned {type(m).__name__}, not a submodule of the model; "
                              f"{fix}")
    return items


def check_tied_units(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Refuse blocks that split a tied parameter across FSDP units (``fully_shard`` would
    raise deep inside torch): every name of a shared parameter must fall in one unit.

    Raises:
        ConfigError: naming the two parameter names and the fix.
    """
    ids = {id(b) for b in blocks}
    prefixes = {name: id(m) for name, m in model.named_modules(remove_duplicate=False) if id(m) in ids}
    seen: dict[int, tuple[str, int]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        parts = name.split(".")
        unit = next((prefixes[".".join(parts[:i])] for i in range(len(parts) - 1, 0, -1)
                     if ".".join(parts[:i]) in prefixes), id(model))
        first = seen.setdefault(id(p), (name, unit))
        if first[1] != unit:
            raise ConfigError(f"train.blocks: parameter {first[0]!r} is tied to {name!r}, and train.blocks puts "
                              "them in different FSDP units; leave the modules holding them out of train.blocks "
                              "(the root unit then holds both), or name a block that contains both")


def checkpoint_activations(block: nn.Module) -> None:
    """Recompute ``block``'s activations during backward instead of keeping them
    (``torch.utils.checkpoint.checkpoint``, non-reentrant, RNG state restored so dropout
    masks match)."""
    from torch.utils.checkpoint import checkpoint

    forward = block.forward
    block.forward = functools.wraps(forward)(functools.partial(checkpoint, forward, use_reentrant=False))


def shard(model: nn.Module, blocks: list[nn.Module], cfg: Config, device: torch.device, mesh=None) -> None:
    """``fully_shard`` each block, then the root (in place), over ``mesh`` (the data-parallel
    dimension under TP), else all ranks of the default group; ``blocks`` as :func:`check_blocks`
    returns them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    f = cfg.fsdp
    if mesh is None:
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES.get(f.param_dtype or ""),
                              reduce_dtype=_DTYPES.get(f.reduce_dtype or ""))
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if f.cpu_offload else OffloadPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=f.reshard_after_forward, mp_policy=mp,
                    offload_policy=offload)
    # the root's parameters are used last in backward: no reason to free them after forward
    fully_shard(model, mesh=mesh, reshard_after_forward=False if blocks else f.reshard_after_forward,
                mp_policy=mp, offload_policy=offload)


def is_fsdp(model: nn.Module) -> bool:
    """True when ``model`` was sharded by :func:`shard` (an FSDP2 module)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: nn.Module) -> None:
    """Free every FSDP unit's gathered parameters and register its shards again.

    A forward without a backward (an evaluation) leaves the units that do not reshard after
    forward (the root when ``train.blocks`` is set, every unit with
    ``fsdp.reshard_after_forward = false``) holding the gathered values: the next training
    forward would reuse them (stale after an EMA swap), and ``get_optimizer_state_dict``
    cannot map the unsharded parameters to the optimizer's. No-op for unsharded models.
    """
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()

