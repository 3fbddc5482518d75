"""Writing one weight set to one file: safetensors or ``torch.save``, atomically and reproducibly.

Tied tensors (several names for one tensor, e.g. ``head.weight is embed.weight``):
safetensors stores each tensor once. The first name in sorted order keeps the data;
each other name is an *alias*, recorded as ``{alias: kept}`` in the file's
``pimm.aliases`` metadata; every reader in :mod:`..weights.read` puts the aliases back as
the same tensor object. ``model.bin`` keeps every name (``torch.save`` preserves sharing).

Equal contents give equal bytes: the safetensors header is written in one canonical
order (:func:`canonical_safetensors_header`) and a ``torch.save`` archive always names
its inner folder ``archive/``. Used by ``pimm export`` (:mod:`.model_dir`) and the
trainer's ``save_model``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ...fsio import atomic_write
from ..tensors.ties import find_aliases
from ..weights.read import StateDict


def _storage_sharing(sd: StateDict) -> set[str]:
    """Names whose storage is shared with another (non-alias) entry: they must be copied apart."""
    by_storage: dict[tuple[Any, int], list[str]] = {}
    for k, t in sd.items():
        if t.device.type != "meta" and t.numel() > 0:
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(k)
    return {k for names in by_storage.values() if len(names) > 1 for k in names}


def write_safetensors(sd: StateDict, path: Path, *, metadata: dict[str, str] | None = None) -> dict[str, str]:
    """Write ``sd`` as safetensors, atomically, storing tied tensors once.

    Tensors are moved to CPU and made contiguous; tensors that overlap in memory without
    being aliases are copied apart. ``metadata`` gets ``format = "pt"`` and
    ``pimm.aliases`` (JSON ``{alias: kept}``).

    Returns:
        The aliases that were dropped (``{alias: kept}``).

    Raises:
        OSError: the write failed (``path`` is untouched).
    """
    from safetensors.torch import save_file

    aliases = find_aliases(sd)
    kept = {k: v for k, v in sd.items() if k not in aliases}
    overlap = _storage_sharing(kept)
    tensors = {k: (v.detach().cpu().clone() if k in overlap else v.detach().cpu()).contiguous()
               for k, v in sorted(kept.items())}
    meta = {"format": "pt", **(metadata or {}), "pimm.aliases": json.dumps(aliases, sort_keys=True)}

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata=meta)
        canonical_safetensors_header(tmp)
        os.chmod(tmp, 0o644)  # safetensors creates the file owner-only

    atomic_write(path, write, points=None)
    return aliases


def canonical_safetensors_header(path: Path) -> None:
    """Rewrite a safetensors file's JSON header in one order, so equal contents give equal bytes.

    The safetensors library writes the ``__metadata__`` map in hash order, which differs
    from one call to the next. Here ``__metadata__`` comes first with its keys sorted, then
    the tensors in the order of their data; the header is padded with spaces to a multiple
    of 8 bytes, as safetensors does. The tensor data is not touched (rewritten in place
    when the header keeps its length, else copied once).
    """
    path = Path(path)
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        meta = header.pop("__metadata__", None)
        ordered: dict[str, Any] = {} if meta is None else {"__metadata__": dict(sorted(meta.items()))}
        ordered.update(sorted(header.items(), key=lambda kv: (kv[1]["data_offsets"], kv[0])))
        text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        text += b" " * (-len(text) % 8)
        if len(text) == n:
            f.seek(8)
            f.write(text)
            return
        other = path.with_name(path.name + ".header")
        try:
            with open(other, "wb") as out:
                out.write(len(text).to_bytes(8, "little"))
                out.write(text)
                f.seek(8 + n)
                shutil.copyfileobj(f, out, 16 << 20)
            os.replace(other, path)
        finally:
            other.unlink(missing_ok=True)


def write_bin(sd: StateDict, path: Path) -> None:
    """``torch.save`` of the state dict (CPU tensors, every name kept, sharing preserved), atomically.

    Saved through an open file, so the archive's inner folder is always ``archive/`` (a
    path would name it after the temporary file): equal contents give equal bytes.

    Raises:
        OSError: the write failed (``path`` is untouched).
    """
    cpu: dict[str, torch.Tensor] = {}
    moved: dict[int, torch.Tensor] = {}
    for k, v in sd.items():
        if v.device.type == "cpu":
            cpu[k] = v.detach()
        else:  # move each distinct tensor once so ties survive
            cpu[k] = moved.setdefault(id(v), v.detach().cpu())

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            torch.save(cpu, f)

    atomic_write(path, write, points=None)
