"""Weights files: the ``{"state_dict": ..., "ema_state_dict"?: ...}`` payload of ``weights.pth``,
``model_best.pth`` and ``iter_<step>.pth``, and the checks a load makes before it copies
anything into a model (keys, shapes, dtypes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import CheckpointError, CheckpointParseError
from ..publish.rotation import save_torch_file
from ..records.manifest import sha256_file, write_manifest
from ..tensors.safe_read import load_torch_file
from ..tensors.safe_state import is_extra_state_key
from ..tensors.state import full_state_dict, full_tensors, is_sharded


def weights_payload(model: nn.Module, ema_state_dict: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """``{"state_dict": raw}`` plus ``"ema_state_dict"`` when an EMA weight set exists.

    Unsharded: the live state dict and ``ema_state_dict`` as given. Sharded (FSDP2): a
    collective that every rank calls (:func:`~..tensors.state.full_state_dict`,
    :func:`~..tensors.state.full_tensors`); rank 0 gets full CPU tensors, the others empty dicts.
    """
    out: dict[str, Any] = {"state_dict": full_state_dict(model)}
    if ema_state_dict is not None:
        out["ema_state_dict"] = full_tensors(ema_state_dict)
    return out


def read_weights_file(path: Path, keep_map: bool = False) -> Any:
    """Read a standard weights file: ``{"state_dict": sd, "ema_state_dict"?: sd}``.

    The file is mapped, not read: ``load_state_dict`` then copies straight from the page
    cache into the parameters (the file is read once, into no intermediate buffer).
    With ``keep_map``: ``(weights, map)``, the map (``torch.UntypedStorage``) the tensors are
    views of, for :func:`.direct_read.read_into_module` (None when the file was read another way).

    Raises:
        CheckpointError: the file cannot be opened.
        CheckpointParseError: ``torch.load(weights_only=True)`` refused it, it is damaged,
            or it is not a pimm weights file.
    """
    from .direct_read import mapped_load

    loaded = mapped_load(path) if keep_map else None
    obj, whole = loaded if loaded is not None else (load_torch_file(path, mmap=True), None)
    ema = obj.get("ema_state_dict") if isinstance(obj, dict) else None
    if not isinstance(obj, dict) or not _is_tensor_dict(obj.get("state_dict")) or not (
            ema is None or _is_tensor_dict(ema)):
        raise CheckpointParseError(f"{path} is not a pimm weights file (expected a dict with a 'state_dict' key "
                                   "mapping names to tensors)")
    return (obj, whole) if keep_map else obj


def _is_tensor_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


DtypeCast = tuple[str, torch.dtype, torch.dtype]  # (tensor name, saved dtype, dtype now)


def dtype_casts(saved: dict[str, torch.dtype], now: dict[str, torch.dtype]) -> list[DtypeCast]:
    """The tensors present in both whose saved dtype differs from the one now, sorted by name."""
    return [(k, saved[k], now[k]) for k in sorted(saved.keys() & now.keys()) if saved[k] != now[k]]


def check_dtypes(path: Path, casts: list[DtypeCast], strict: bool) -> list[str]:
    """Refuse, or describe, a resume that would cast checkpoint tensors to other dtypes.

    A load copies each saved tensor into the model's (or optimizer's) own, converting
    silently; a model cast to bf16 after it was built, or fp32 moments loaded into bf16
    ones, must be a decision, never an accident.

    Returns:
        ``[]`` when nothing is cast; else one warning naming what is cast (strict False).

    Raises:
        CheckpointError: (exit code 2) ``strict`` and some dtype differs; names the first
            tensors with their dtypes saved -> now, and the fix.
    """
    if not casts:
        return []
    groups: dict[tuple[str, str], list[str]] = {}
    for name, saved, now in casts:
        groups.setdefault((_dtype_name(saved), _dtype_name(now)), []).append(name)

    def listed(limit: int) -> str:
        return "; ".join(f"{a} -> {b}: {', '.join(names[:limit])}"
                         f"{f' (+{len(names) - limit} more)' if len(names) > limit else ''}"
                         for (a, b), names in groups.items())

    if strict:
        raise CheckpointError(f"{path} holds tensors in other dtypes than this model and optimizer (saved -> now: "
                              f"{listed(3)}); build the model in the saved dtype, or set resume_strict_state = false "
                              "to cast them", exit_code=2)
    return [f"cast {len(casts)} tensors of {path} to this model's and optimizer's dtypes (resume_strict_state=false; "
            f"saved -> now: {listed(10)})"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_compatible(model: nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """Raise :class:`CheckpointError` naming missing, unexpected and shape-mismatched keys."""
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    shapes = sorted(f"{k} {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
                    for k in set(own) & set(sd) if not is_extra_state_key(k)  # (an encoded one's length is its own)
                    and tuple(own[k].shape) != tuple(sd[k].shape))
    if missing or unexpected or shapes:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
            if items:
                more = f" (+{len(items) - 3} more)" if len(items) > 3 else ""
                parts.append(f"{label}: {', '.join(items[:3])}{more}")
        raise CheckpointError(f"{source} does not match the model: " + "; ".join(parts))


def write_weights_file(path: Path, model: nn.Module | None, manifest: dict[str, Any],
                       ema_state_dict: dict[str, torch.Tensor] | None = None, *,
                       payload: dict[str, Any] | None = None) -> None:
    """Publish a weights-only file (``model_best.pth``, ``iter_<step>.pth``) with a sidecar manifest.

    The sidecar ``<name>.json`` records step, metrics and the file's size and sha256.

    Args:
        payload: what to write, already made with :func:`weights_payload` (for a sharded
            model every rank makes it, then rank 0 writes); else it is made here from
            ``model`` and ``ema_state_dict`` (an unsharded model: rank 0 alone may call it).

    Raises:
        RuntimeError: ``model`` is sharded over several ranks and no ``payload`` was given
            (the gather needs every rank; one rank alone would wait forever).
    """
    if payload is None:
        if model is not None and is_sharded(model) and torch.distributed.get_world_size() > 1:
            raise RuntimeError(f"writing {path}: the model is sharded (FSDP) over several ranks; make the payload "
                               "on every rank with weights_payload(model, ema) and pass payload= on rank 0")
        payload = weights_payload(model, ema_state_dict)
    save_torch_file(path, payload)
    write_manifest(path.with_name(path.name + ".json"), {
        "format": "weights", **manifest,
        "files": {path.name: {"size": path.stat().st_size, "sha256": sha256_file(path)}},
    })
