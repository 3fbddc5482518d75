"""Turning trainer state into tensors that load with ``weights_only=True``.

``torch.distributed.checkpoint`` stores non-tensor values as pickles and reads
them back with ``weights_only=False``. pimm never does that: every non-tensor
value (scheduler, scaler, counters, RNG, loader cursor) is serialised with
``torch.save`` into a ``uint8`` tensor (:func:`pack`) and read back with
``torch.load(weights_only=True)`` (:func:`unpack`), which refuses code execution.
"""

from __future__ import annotations

import io
import random
import sys
from typing import Any

import numpy as np
import torch

from .safe_state import UnloadableStateError, decode, decode_extra_states, encode, encode_extra_states
from .ties import tied_groups

TENSOR_MARK = "__tensor__"


def pack(obj: Any) -> torch.Tensor:
    """Serialise ``obj`` (dicts/lists/tuples of tensors, numbers, strings, None, numpy values) to a 1-D
    uint8 tensor; numpy values are encoded so that :func:`unpack` reads them back
    (:func:`~.safe_state.encode`).

    Raises:
        UnloadableStateError: ``obj`` holds a value ``torch.load(weights_only=True)`` would refuse.
    """
    buf = io.BytesIO()
    torch.save(encode(obj), buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def unpack(t: torch.Tensor) -> Any:
    """Inverse of :func:`pack`, with ``weights_only=True``.

    Raises:
        pickle.UnpicklingError: the bytes hold anything but plain containers, numbers,
            strings and tensors.
    """
    return decode(torch.load(io.BytesIO(t.cpu().numpy().tobytes()), weights_only=True, map_location="cpu"))


def load_problem(obj: Any) -> str | None:
    """Why a resume could not read ``obj`` back (:func:`pack` then :func:`unpack`, as a save and
    a resume do), in one line with the fix; None when it round-trips.

    A value of a class (an enum, a user class) is what ``torch.load(weights_only=True)`` refuses
    unless the class is registered with ``torch.serialization.add_safe_globals``.
    """
    import pickle
    import re

    try:
        unpack(pack(obj))
    except UnloadableStateError as e:
        return str(e)
    except pickle.UnpicklingError as e:
        m = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = m.group(1) if m else "a value"
        short = what.rsplit(".", 1)[-1]
        return (f"it holds {what}, which torch.load(weights_only=True) refuses; return plain values (numbers, "
                f"strings, lists, dicts, tensors) from state_dict(), or call "
                f"torch.serialization.add_safe_globals([{short}]) in the module that defines it")
    except Exception as e:  # pickling failed (a lambda, a lock, an open file)
        return (f"it cannot be serialised ({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                "return plain values (numbers, strings, lists, dicts, tensors) from state_dict()")
    return None


def split_tensors(tree: Any, prefix: str) -> tuple[dict[str, torch.Tensor], Any]:
    """Separate the tensors of a nested state from its structure.

    Returns:
        ``(tensors, skeleton)``: ``tensors`` maps a path (``prefix/key/...``) to each
        tensor; ``skeleton`` is ``tree`` with every tensor replaced by
        ``{"__tensor__": path}``, safe to :func:`pack`.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[path] = node
            return {TENSOR_MARK: path}
        if isinstance(node, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, f"{path}/{i}") for i, v in enumerate(node))
        return node

    return tensors, walk(tree, prefix)


def join_tensors(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_tensors`."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {TENSOR_MARK}:
            return tensors[skeleton[TENSOR_MARK]]
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(join_tensors(v, tensors) for v in skeleton)
    return skeleton


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU, every CUDA device, numpy global, python ``random``."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def is_parallel_wrapper(model: Any) -> bool:
    """True for a data-parallel wrapper (DDP, DataParallel, FSDP) whose ``.module`` is the model."""
    return isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)) or \
        type(model).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under data-parallel (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers.

    The one rule: ``.module`` is followed only on a data-parallel wrapper, so a user's model
    with a submodule named ``module`` is not mistaken for one.
    """
    while True:
        inner = getattr(model, "module", None) if is_parallel_wrapper(model) else getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


# ------------------------------------------------------------------ sharded models (FSDP2)
def dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor``, or None while that module is not imported: then no
    tensor can be one. (Importing it, and ``torch.distributed.checkpoint``, adds ~40 % to ``import torch``:
    a run that shards nothing and saves nothing before its first step does not.)"""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_sharded(model: torch.nn.Module) -> bool:
    """True when any parameter of the (unwrapped) model is a ``DTensor`` (``fully_shard``)."""
    dtensor = dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in unwrap(model).parameters())


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) state dict, keys as ``unwrap(model).state_dict()``'s.

    Unsharded: ``unwrap(model).state_dict()`` itself (the live tensors, on their device).
    Sharded (:func:`is_sharded`): a collective, every rank must call it:
    ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``; rank 0 gets CPU
    tensors of the global shapes (names the model ties share one tensor), the other ranks
    ``{}``. At world size 1 an entry may share memory with the parameter: copy it before
    the parameters change if it must outlive them.
    """
    plain = unwrap(model)
    if not is_sharded(plain):
        return encode_extra_states(plain.state_dict())
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(plain, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for group in tied_groups(plain):  # gathered once per name: make the tied names one tensor again
        present = [n for n in group if n in sd]
        for n in present[1:]:
            sd[n] = sd[present[0]]
    return sd


def full_tensors(sd: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """A state dict with its ``DTensor`` entries gathered (an EMA weight set under FSDP).

    Without any ``DTensor`` in it, ``sd`` itself is returned (any rank, no copy). Otherwise
    it is a collective (every rank calls it with the same keys): each ``DTensor`` is
    gathered with ``full_tensor()``; rank 0 gets every entry as a CPU tensor (entries that
    were one tensor object stay one), the other ranks ``{}``. None gives None.
    """
    dtensor = dtensor_type()
    if sd is None or dtensor is None or not any(isinstance(v, dtensor) for v in sd.values()):
        return sd
    keep = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    made: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if id(v) not in made:
            t = v.full_tensor() if isinstance(v, dtensor) else v.detach()
            made[id(v)] = t.cpu() if keep else t
        if keep:
            out[k] = made[id(v)]
    return out


def load_full_state_dict(model: torch.nn.Module, sd: dict[str, torch.Tensor], strict: bool = True) -> Any:
    """Copy a full state dict (tensors of the global shapes, on any device) into ``model``.

    Unsharded: ``unwrap(model).load_state_dict(sd, strict)``. Sharded: every rank must call
    it with the full ``sd``: ``set_model_state_dict(full_state_dict=True)`` gives each rank
    its shards (a collective).

    Returns:
        ``load_state_dict``'s missing/unexpected keys.

    Raises:
        RuntimeError: ``strict`` and keys differ, or a shape differs (``load_state_dict``'s).
    """
    plain = unwrap(model)
    if not is_sharded(plain):  # (a module's encoded extra state is decoded for set_extra_state: safe_state)
        return plain.load_state_dict(decode_extra_states(sd), strict=strict)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # (a copy: set_model_state_dict puts its own entries into the dict it is given)
    return set_model_state_dict(plain, dict(sd), options=StateDictOptions(full_state_dict=True, strict=strict))
