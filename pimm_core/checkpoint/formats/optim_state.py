"""Optimizer state for DCP's state-dict functions, without stepping any optimizer the user can observe.

DCP's ``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` create the state of an
optimizer that has none by a real zero-gradient ``step()`` of it (``_init_optim_state``): the
optimizer's own and the global step hooks fire, and an optimizer with counters or a schedule
of its own (schedule-free, a user's subclass) is changed by a load, or by the save of a
stateless one (SGD without momentum). :func:`unstepped` is the context every pimm call of those
functions runs in: on a load it gives a fresh optimizer the state's structure from a step of a
*copy* over ``meta`` tensors, with every hook silenced; where no state is to be made it makes
DCP skip its step.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from typing import Any, Iterator

import torch
from torch import nn
from torch.optim import optimizer as _optimizer_module

from ..tensors.state import dtensor_type

_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
_GLOBAL_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


@contextlib.contextmanager
def _silent_global_hooks() -> Iterator[None]:
    """The global optimizer step hooks (``register_optimizer_step_pre_hook``/``post_hook``) are
    set aside while inside, and restored in their order after."""
    saved = []
    for name in _GLOBAL_HOOKS:
        hooks = getattr(_optimizer_module, name, None)
        if isinstance(hooks, dict):
            saved.append((hooks, list(hooks.items())))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.clear()
            hooks.update(items)


def _raw_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()`` without the hook wrapper ``torch.optim`` puts around every class's ``step``."""
    step = type(opt).step
    getattr(step, "__wrapped__", step)(opt)


def _shadow_state(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict[str, Any]]] | None:
    """Each parameter with the state a step gives it (tensor values on ``meta``, or real ones for
    scalars), from a step of a deep copy of ``optimizer`` whose parameters are ``meta`` stand-ins
    (one per distinct group, shape, strides and dtype: per-parameter state in ``torch.optim``
    depends on nothing else). The copy is never the user's object and runs no hook; its
    constructor is not called. A parameter frozen now (``requires_grad`` False) gets the state a
    step gave it while it trained; the caller drops it where the checkpoint has none. None when
    the copy cannot be made or stepped."""
    memo: dict[int, Any] = {}
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    dtensor = dtensor_type()  # (None: nothing is sharded)
    for g, group in enumerate(optimizer.param_groups):
        metas: dict[tuple, torch.Tensor] = {}
        for p in group["params"]:
            local = p.to_local() if dtensor is not None and isinstance(p, dtensor) else p
            if type(local) not in (torch.Tensor, nn.Parameter):
                return None
            key = (g, tuple(local.shape), tuple(local.stride()), local.dtype, p.requires_grad)
            if key not in metas:  # empty_like keeps the layout (channels_last, transposed), as zeros_like does
                m = metas[key] = torch.empty_like(local, device="meta").requires_grad_(True)
                m.grad = torch.empty_like(m)  # (a frozen parameter too: the state a step gave it before)
            memo[id(p)] = metas[key]
            pairs.append((p, metas[key]))
    try:
        shadow = copy.deepcopy(optimizer, memo)
        for group in shadow.param_groups:  # one stand-in of each kind is stepped once
            group["params"] = list({id(m): m for m in group["params"]}.values())
        for name in _HOOKS:
            if hasattr(shadow, name):
                setattr(shadow, name, OrderedDict())
        with _silent_global_hooks():
            _raw_step(shadow)
    except Exception:
        return None
    return [(p, dict(shadow.state.get(m, {}))) for p, m in pairs]


def fill_empty_state(optimizer: torch.optim.Optimizer) -> str:
    """Give an optimizer without state uninitialized state tensors of the shapes and dtypes a step
    would make, for a load to fill (the caller clears them if the load fails).

    A ``DTensor`` parameter (FSDP2) is stepped as its local shard, and each state tensor shaped
    like the shard becomes a ``DTensor`` of the parameter's mesh, placements and global shape.

    Returns:
        ``"filled"``; ``"has_state"`` (untouched); ``"stateless"`` (a step makes no state: SGD
        without momentum); ``"failed"``: the structure could not be made without stepping the
        optimizer itself (a copy that cannot be made or stepped on ``meta``: ``fused``, a closure,
        a parameter that is not a plain tensor, state of a ``DTensor`` not shaped like its shard).
    """
    if optimizer.state:
        return "has_state"
    shadow = _shadow_state(optimizer)
    if shadow is None:
        return "failed"
    state: dict[torch.Tensor, dict[str, Any]] = {}
    dtensor = dtensor_type()  # (None: nothing is sharded)
    for p, saved in shadow:
        sharded = dtensor is not None and isinstance(p, dtensor)
        device = p.to_local().device if sharded else p.device
        local_shape = p.to_local().shape if sharded else p.shape
        state[p] = {}
        for key, value in saved.items():
            if isinstance(value, torch.Tensor):
                if not value.is_meta:
                    value = value.clone()
                elif sharded and value.shape != local_shape:
                    return "failed"
                else:
                    value = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
                    if sharded:
                        value = dtensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                                   shape=p.shape, stride=p.stride())
            state[p][key] = value
    if not any(state.values()):
        return "stateless"
    for p, st in state.items():
        if st:
            optimizer.state[p].update(st)
    return "filled"


@contextlib.contextmanager
def unstepped(optimizer: torch.optim.Optimizer | None, *, fill: bool) -> Iterator[None]:
    """Inside, DCP's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` of ``optimizer``
    step no optimizer the user can observe.

    Args:
        fill: a load: an optimizer without state gets its structure (:func:`fill_empty_state`).
            False (a save): the state is left as it is.

    Where no state is made (a save, a stateless optimizer) DCP's step is skipped: DCP steps only
    when no parameter has a gradient, so one parameter holds a zero gradient while inside. Where
    the structure cannot be made from a copy, DCP's own step runs with every hook silenced and
    the optimizer's attributes (counters) restored after it.
    """
    if optimizer is None or optimizer.state:
        yield
        return
    outcome = fill_empty_state(optimizer) if fill else "stateless"
    if outcome in ("filled", "has_state"):
        yield
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(p.grad is not None for p in params) or not params:
        yield  # DCP does not step an optimizer whose parameters have gradients
        return
    if outcome == "stateless":
        params[0].grad = torch.zeros_like(params[0])
        try:
            yield
        finally:
            params[0].grad = None
        return
    attrs = {k: v for k, v in vars(optimizer).items() if k not in ("state", "param_groups", *_HOOKS)}
    hooks = {name: getattr(optimizer, name) for name in _HOOKS if hasattr(optimizer, name)}
    for name in hooks:
        setattr(optimizer, name, OrderedDict())
    try:
        with _silent_global_hooks():
            yield
    finally:
        for name, value in hooks.items():
            setattr(optimizer, name, value)
        for k in [k for k in vars(optimizer) if k not in attrs and k not in ("state", "param_groups", *_HOOKS)]:
            delattr(optimizer, k)
        vars(optimizer).update(attrs)


@contextlib.contextmanager
def frozen_state_loaded(model: nn.Module, saved_state: Any) -> Iterator[None]:
    """Inside, the parameters frozen now (``requires_grad`` False) whose state ``saved_state`` (the
    ``"state"`` of an FQN-keyed optimizer state dict) holds count as trainable, so that
    ``set_optimizer_state_dict`` loads their state too (DCP drops the state of frozen parameters):
    a layer frozen mid-run keeps the optimizer state it trained with, as the uninterrupted run does.
    """
    saved = saved_state if isinstance(saved_state, dict) else {}
    thawed = [p for name, p in model.named_parameters() if not p.requires_grad and name in saved]
    for p in thawed:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in thawed:
            p.requires_grad_(False)
