"""Parsing checkpoint bytes without running code: the one place that decides how.

Every file pimm reads from a checkpoint is parsed as data:

=========================================  ==============================================
file                                       parsed with
=========================================  ==============================================
``manifest.json``, ``<file>.json``         ``json`` (:mod:`..records.manifest`)
``trainer.dcp/.metadata``                  :func:`read_dcp_metadata`: a restricted unpickler
                                           admitting only DCP's metadata classes,
                                           ``torch.Size``, dtypes, layouts and memory formats
``trainer.dcp/__<rank>_<n>.distcp``        each tensor with ``torch``'s weights-only
                                           unpickler (:mod:`..formats.mapped_reader`); the packed
                                           trainer state with ``torch.load(weights_only=True)``
``weights.pth``, ``model_best.pth``,       :func:`load_torch_file`: ``torch.load(weights_only=True)``
``iter_<step>.pth``, ``model_last.pth``,
``step_<step>.pth``, ``model.bin``
``model.safetensors``                      ``safetensors``
=========================================  ==============================================

A file that these refuse (it would run code, or is not what pimm writes) or cannot parse
raises :class:`~pimm_core.errors.CheckpointParseError` (exit code 2) naming the file;
nothing in it has run. A file that is not a PyTorch file at all (text, random bytes) is
named as such (``... is not a PyTorch checkpoint (a text file)``), from its first bytes
(:func:`..records.foreign.sniff`, which never unpickles).
"""

from __future__ import annotations

import functools
import io
import pathlib
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...errors import CheckpointError, CheckpointParseError, first_line
from ..records.foreign import not_a_checkpoint, sniff

if TYPE_CHECKING:
    from torch.distributed.checkpoint import metadata as dcp_metadata

_DCP_CLASSES = ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")

@functools.cache
def dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """``(module, name)`` of every global a DCP ``.metadata`` pickle written by pimm may name.

    Calling any of them with any arguments builds a value and nothing else. ``torch.<dtype>``
    names (``torch.float32``...) are admitted too. (A function: ``torch.distributed.checkpoint``
    is imported by the first read of DCP metadata, not by every import of this module.)
    """
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return {
        **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n)
           for n in _DCP_CLASSES if hasattr(dcp_metadata, n)},
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("pathlib", "PosixPath"): pathlib.PosixPath,  # StorageMeta.checkpoint_id: the directory DCP wrote to
    }


class _DcpMetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose globals are only :func:`dcp_metadata_globals` and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        found = dcp_metadata_globals().get((module, name))
        if found is None and module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            found = vars(torch)[name]  # vars(): no module __getattr__ (lazy imports) for a name the file chose
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which is not a DCP metadata type")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference, which DCP metadata never does")


def read_dcp_metadata(path: Path) -> "dcp_metadata.Metadata":
    """Read a DCP ``.metadata`` file admitting only DCP's metadata types.

    Besides the unpickler's allow-list, the result must describe tensors only (pimm never
    stores non-tensor DCP items: a ``BytesStorageMetadata`` entry would make DCP read that
    item with ``torch.load(weights_only=False)``) kept in files of the same directory.

    Raises:
        CheckpointError: the file cannot be opened (exit code 1).
        CheckpointParseError: it would run code, names anything but DCP metadata types,
            or is not well-formed DCP metadata of tensors (exit code 2).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        md = _DcpMetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # UnpicklingError (refused global), EOFError, ValueError, TypeError, ...
        raise CheckpointParseError(f"refusing to load {path}: {first_line(e)}; pimm reads DCP metadata admitting "
                                   "only DCP's metadata types and never runs code from a checkpoint") from None
    problem = _metadata_problem(md)
    if problem:
        raise CheckpointParseError(f"refusing to load {path}: {problem}")
    return md


def _metadata_problem(md: Any) -> str | None:
    """What makes ``md`` other than the metadata of tensor-only DCP files in one directory, or None."""
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if type(md) is not dcp_metadata.Metadata:
        return f"it holds a {type(md).__name__}, not DCP Metadata"
    items, storage = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if not isinstance(items, dict) or not isinstance(storage, dict):
        return "its state_dict_metadata or storage_data is not a dict"
    for key, item in items.items():
        if type(item) is not dcp_metadata.TensorStorageMetadata:
            return f"item {key!r} is a {type(item).__name__}, not a tensor (pimm stores tensors only)"
        dtype = getattr(getattr(item, "properties", None), "dtype", None)
        if (type(getattr(item, "size", None)) is not torch.Size or not isinstance(dtype, torch.dtype)
                or not isinstance(getattr(item, "chunks", None), list)):
            return f"item {key!r} has no well-formed size, dtype and chunks"
    for index, info in storage.items():
        if type(index) is not dcp_metadata.MetadataIndex or type(info) is not _StorageInfo:
            return "its storage_data is not a map of MetadataIndex to _StorageInfo"
        rel = info.relative_path
        if not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel or rel in (".", ".."):
            return f"item {index.fqn!r} names the file {rel!r}, not a file of its own directory"
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length)):
            return f"item {index.fqn!r} has a bad offset or length"
    return None


def load_torch_file(path: Path, *, mmap: bool = False, hint: str = "") -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``, with typed errors.

    Args:
        mmap: map the file (zip format); a file that cannot be mapped is read instead.
        hint: appended to the refusal message (e.g. how to re-save a user's own file).

    Raises:
        CheckpointError: the file cannot be opened (exit code 1).
        CheckpointParseError: ``weights_only`` refused it (it would run code or needs
            classes that are not tensors and plain containers), or it is not a readable
            PyTorch file (truncated, not a pickle or zip) (exit code 2).
    """
    path = Path(path)
    if mmap:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:
            pass  # not a zip-format file (mmap needs one), or damaged: the plain read names the problem
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    except Exception as e:  # UnpicklingError (weights_only refusal), RuntimeError (bad zip), EOFError, ...
        raise CheckpointParseError(load_failure(path, e, hint)) from None


def load_failure(path: Path, e: BaseException, hint: str = "") -> str:
    """One line for a ``torch.load(weights_only=True)`` of ``path`` that raised ``e``.

    A file that is not a PyTorch file at all (text, random bytes, a zip archive: see
    :func:`..records.foreign.sniff`) is called that, unless the unpickler refused a global it names
    (code that would have run): then the refusal is the message.
    """
    text = str(e)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not any("unsupported global" in ln.lower() for ln in lines):
        try:
            sniffed = sniff(path)
        except OSError:
            sniffed = None
        if sniffed is not None and sniffed.not_a_checkpoint:
            return not_a_checkpoint(path, sniffed.describe())
    reason = next((ln for ln in lines if "unsupported global" in ln.lower() or "Unsupported operand" in ln), None)
    if reason is not None or "Weights only load failed" in text or isinstance(e, pickle.UnpicklingError):
        reason = reason or (lines[0] if lines else e.__class__.__name__)
        return (f"refusing to load {path}: torch.load(weights_only=True) rejected it ({reason}); a checkpoint file "
                f"may hold only tensors and plain containers and pimm never runs code from a checkpoint{hint}")
    return f"cannot load {path}: {e.__class__.__name__}: {lines[0] if lines else ''}".rstrip(": ")
