"""The weights of a sharded (FSDP2) model inside ``trainer.dcp/``.

When the model's parameters are ``DTensor`` shards (:func:`~..tensors.state.is_sharded`), a standard
save also puts the weights in ``trainer.dcp/``, each rank writing its own shards:

- ``model/<fqn>``: ``get_model_state_dict(model)`` (parameters sharded, buffers replicated);
- ``ema/<fqn>``: the EMA weight set, when the run keeps one;
- ``weights_aliases``: the packed ``{alias: kept}`` names the model ties to one tensor
  (stored once, under the kept name).

DCP reshards on load: a checkpoint written by N ranks loads into M ranks, into ``DTensor``
shards or plain full tensors. ``weights.pth`` is then the gathered copy; with
``checkpoint.gather_weights = false`` it is not written and the manifest says
``"weights": "trainer.dcp"`` (:data:`~..select.selection.WEIGHTS_FIELD`): readers without a
process group use :func:`read_checkpoint_weights`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ...errors import CheckpointError, CheckpointParseError
from ..select.selection import TRAINER_DCP
from ..tensors.state import pack, unpack
from ..tensors.ties import tied_groups
from .mapped_reader import MappedFileSystemReader
from ..tensors.safe_state import is_extra_state_key

MODEL = "model/"
EMA = "ema/"
ALIASES = "weights_aliases"


def model_aliases(plain: nn.Module, keys: Any) -> dict[str, str]:
    """``{alias: kept}`` for the names among ``keys`` that ``plain`` ties to one tensor
    (kept: the first of the group in registration order). The same on every rank."""
    keys = set(keys)
    out = {}
    for group in tied_groups(plain):
        present = [n for n in group if n in keys]
        out.update({n: present[0] for n in present[1:]})
    return out


def sharded_items(plain: nn.Module, ema_state_dict: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """The DCP items of a sharded model's weights: ``model/<fqn>``, ``ema/<fqn>`` (with an EMA
    weight set) and ``weights_aliases``; tied names are stored once."""
    sd = get_model_state_dict(plain)
    aliases = model_aliases(plain, sd)
    items: dict[str, Any] = {f"{MODEL}{k}": v for k, v in sd.items() if k not in aliases}
    if ema_state_dict is not None:
        items.update({f"{EMA}{k}": v for k, v in ema_state_dict.items() if k not in aliases})
    items[ALIASES] = pack(aliases)
    return items


def saved_names(saved: dict[str, Any], prefix: str) -> set[str]:
    """The names stored under ``prefix`` (``model/`` or ``ema/``) in DCP metadata ``saved``."""
    return {k[len(prefix):] for k in saved if k.startswith(prefix)}


def empty_targets(saved: dict[str, Any], keys: Any) -> dict[str, torch.Tensor]:
    """Uninitialized CPU tensors of the saved (global) shapes and dtypes, one per DCP key."""
    return {k: torch.empty(tuple(saved[k].size), dtype=saved[k].properties.dtype) for k in keys}


def mismatch(path: Path, what: str, target: dict[str, torch.Tensor], saved: dict[str, Any], prefix: str,
             extra_ok: bool = False) -> str | None:
    """What keeps ``target`` (name -> tensor, global shapes) from loading ``prefix`` items, or None."""
    have = saved_names(saved, prefix)
    missing = sorted(set(target) - have)
    extra = [] if extra_ok else sorted(have - set(target))
    shapes = sorted(f"{k} {tuple(saved[prefix + k].size)} vs {tuple(target[k].shape)}"
                    for k in set(target) & have if not is_extra_state_key(k)  # (an encoded one's length is its own)
                    and tuple(target[k].shape) != tuple(saved[prefix + k].size))
    parts = [f"{label}: {', '.join(keys[:3])}{f' (+{len(keys) - 3} more)' if len(keys) > 3 else ''}"
             for label, keys in (("missing", missing), ("unexpected", extra), ("shape mismatch (saved vs now)", shapes))
             if keys]
    return f"{what} in {path} do not match: {'; '.join(parts)}" if parts else None


def model_targets(plain: nn.Module, saved: dict[str, Any],
                  path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's own tensors (``DTensor`` shards or plain) that ``model/*`` loads into.

    Returns:
        ``(sd, target)``: ``get_model_state_dict(plain)`` (for ``set_model_state_dict``
        after the load) and its entries by name without tied aliases (what DCP fills).

    Raises:
        CheckpointError: names or shapes differ from the saved ones (names them).
    """
    sd = get_model_state_dict(plain)
    aliases = model_aliases(plain, sd)
    target = {k: v for k, v in sd.items() if k not in aliases}
    problem = mismatch(path, "model weights", target, saved, MODEL)
    if problem:
        raise CheckpointError(problem)
    for k in [k for k in target if is_extra_state_key(k) and tuple(target[k].shape) != tuple(saved[MODEL + k].size)]:
        # a module's encoded extra state (safe_state) read at its saved length; load_state_dict decodes it
        sd[k] = target[k] = torch.empty(tuple(saved[MODEL + k].size), dtype=saved[MODEL + k].properties.dtype)
    return sd, target


def ema_targets(ema_target: dict[str, torch.Tensor] | None, saved: dict[str, Any],
                path: Path) -> dict[str, torch.Tensor]:
    """The tensors ``ema/*`` loads into: ``ema_target`` (the EMA's own, any dtype: the copy
    casts), else new full CPU tensors of every saved entry.

    Raises:
        CheckpointError: a name of ``ema_target`` is not saved, or its shape differs.
    """
    if ema_target is None:
        return {k[len(EMA):]: v for k, v in empty_targets(saved, [k for k in saved if k.startswith(EMA)]).items()}
    problem = mismatch(path, "EMA weights", ema_target, saved, EMA, extra_ok=True)
    if problem:
        raise CheckpointError(problem)
    return dict(ema_target)


def read_checkpoint_weights(ckpt_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The full weights of a standard checkpoint from ``trainer.dcp/``, without a process group.

    Reads ``model/*`` (and ``ema/*``) into new CPU tensors of the saved global shapes and
    dtypes (whatever world size wrote them), the names tied when saved restored as one
    tensor. For ``pimm export``, warm start and ``load_weights`` on a checkpoint written with
    ``checkpoint.gather_weights = false``.

    Returns:
        ``{"state_dict": sd}`` plus ``"ema_state_dict"`` when the run kept EMA weights
        (the layout of ``weights.pth``).

    Raises:
        CheckpointError: no ``model/*`` items (the checkpoint's weights are in
            ``weights.pth``), or a shard cannot be read.
        CheckpointParseError: the metadata or a shard is hostile or malformed.
    """
    path = Path(ckpt_dir) / TRAINER_DCP
    reader = MappedFileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    keys = [k for k in saved if k.startswith((MODEL, EMA))]
    if not any(k.startswith(MODEL) for k in keys):
        raise CheckpointError(f"{path} holds no model weights (written unsharded: read {Path(ckpt_dir) / 'weights.pth'})")
    request = empty_targets(saved, keys)
    if ALIASES in saved:
        request[ALIASES] = torch.empty(tuple(saved[ALIASES].size), dtype=torch.uint8)
    try:
        dcp.load(request, storage_reader=reader, no_dist=True)
    except CheckpointException as e:
        first = next(iter(e.failures.values()))[0] if isinstance(e.failures, dict) and e.failures else e
        if isinstance(first, CheckpointError):
            raise first from None
        raise CheckpointError(f"cannot load {path}: {first.__class__.__name__}: {str(first).splitlines()[0]}") from None
    aliases = unpack_aliases(request.pop(ALIASES, None), path)
    out = {}
    for name, prefix in (("state_dict", MODEL), ("ema_state_dict", EMA)):
        sd = {k[len(prefix):]: v for k, v in request.items() if k.startswith(prefix)}
        if sd:
            out[name] = retied(sd, aliases)
    return out


def unpack_aliases(t: torch.Tensor | None, path: Path) -> dict[str, str]:
    """The ``weights_aliases`` item, checked ({} when absent).

    Raises:
        CheckpointParseError: it is not a dict of names.
    """
    if t is None:
        return {}
    try:
        aliases = unpack(t)
    except Exception as e:
        raise CheckpointParseError(f"cannot read item {ALIASES!r} of {path}: {e.__class__.__name__}") from None
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise CheckpointParseError(f"{path}: item {ALIASES!r} is not a dict of tensor names")
    return aliases


def retied(sd: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """``sd`` with each alias name added as its kept name's tensor object (kept names absent are skipped)."""
    for alias, kept in sorted(aliases.items()):
        if kept in sd:
            sd[alias] = sd[kept]
    return sd
