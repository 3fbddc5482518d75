"""DCP's FileSystemReader, reading tensors from a memory map of each shard file.

``dcp.FileSystemReader`` reads every tensor with ``torch.load`` into a newly allocated
buffer and then copies it into the tensor the caller asked to load into: two copies
and a fresh allocation per tensor (on this project's VMs fresh pages are the expensive
part). :class:`MappedFileSystemReader` maps each shard file once and unpickles each
tensor over the mapping, as ``torch.load(path, mmap=True)`` does for a whole file, so
the only copy is the one into the caller's tensor, straight from the page cache.

It relies on two private pieces of ``torch.serialization`` (``_open_zipfile_reader``
and ``_load`` with ``overall_storage``, the implementation of ``torch.load(mmap=True)``)
and falls back to DCP's own ``read_data`` (also weights-only) when they are missing and
for shards written with stream transforms (extensions).

It is also where a DCP read is made safe: ``read_metadata`` parses ``.metadata`` with
:func:`~pimm_core.checkpoint.tensors.safe_read.read_dcp_metadata` (DCP's own uses plain
``pickle.load``), and non-tensor (``BYTE_IO``) items, which DCP's planner reads with
``torch.load(weights_only=False)``, are refused. Every DCP read in pimm goes through it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ...errors import CheckpointParseError
from ..tensors.safe_read import load_failure, read_dcp_metadata
from .direct_read import Reads

try:
    from torch import _weights_only_unpickler
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.utils import _create_file_view
    from torch.serialization import _load, _open_zipfile_reader
except ImportError:  # another torch: DCP's reader is used unchanged
    _load = None

# DCP warns "assuming the intent is to save/load in a single process" whenever no process
# group exists; that is the intent (no_dist: one process, or a reader of a sharded
# checkpoint's weights). Filtered process-wide rather than around each call: an async save's
# write emits it later, on DCP's own thread. (Here: every DCP user in pimm imports this module.)
warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process.*", category=UserWarning)


class MappedFileSystemReader(dcp.FileSystemReader):
    """``dcp.FileSystemReader`` that runs no code from the checkpoint and whose tensor reads
    copy once, from a map of the shard file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``read_metadata`` through the restricted unpickler, parsed once per reader and
        file: a load asks for it three times (pimm's checks, then each ``dcp.load``), and the
        pure-Python unpickling was ~15 % of a 108 MiB load.

        Raises:
            CheckpointError: ``.metadata`` cannot be opened.
            CheckpointParseError: it is hostile or malformed (names the file).
        """
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        parsed = self.__dict__.setdefault("_pimm_parsed", {})
        if path not in parsed:
            parsed[path] = read_dcp_metadata(path)
        metadata = parsed[path]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the planned tensors into the planner's targets.

        Raises:
            CheckpointParseError: a non-tensor item is planned, or a shard's tensor record
                is refused by the weights-only unpickler (names the shard file).
        """
        mapped: dict[str, list[Any]] = {}
        rest = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointParseError(f"refusing to load {Path(self.path) / info.relative_path}: item "
                                           f"{item.storage_index.fqn!r} is not a tensor (pimm stores tensors only)")
            if _load is None or info.transform_descriptors:
                rest.append(item)
            else:
                mapped.setdefault(info.relative_path, []).append(item)
        for relative_path, items in mapped.items():
            self._read_mapped(Path(self.path) / relative_path, items, planner)
        if rest:
            return super().read_data(LoadPlan(rest, plan.storage_data, plan.planner_data), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_mapped(self, path: Path, items: list[Any], planner: LoadPlanner) -> None:
        whole = torch.UntypedStorage.from_file(str(path), False, path.stat().st_size)  # MAP_PRIVATE, lazy
        read: list[tuple[Any, torch.Tensor]] = []
        with open(path, "rb") as stream, Reads() as reads:  # (the reads end before the file is closed)
            for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                info = self.storage_data[item.storage_index]
                try:
                    with _open_zipfile_reader(_create_file_view(stream, info.offset, info.length)) as archive:
                        tensor = _load(archive, "cpu", _weights_only_unpickler,
                                       overall_storage=whole[info.offset:info.offset + info.length], weights_only=True)
                except Exception as e:  # weights_only refusal, a damaged record
                    raise CheckpointParseError(f"{load_failure(path, e)} (item {item.storage_index.fqn!r})") from None
                if not isinstance(tensor, torch.Tensor):
                    raise CheckpointParseError(f"refusing to load {path}: item {item.storage_index.fqn!r} is a "
                                               f"{type(tensor).__name__}, not a tensor")
                tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != tensor.size():
                    raise ValueError(f"{path}: item {item.storage_index} has size {tuple(tensor.size())}, "
                                     f"expected {tuple(target.size())}")
                if not reads.pread_into(stream.fileno(), whole, tensor, target):
                    target.copy_(tensor)
                read.append((item, target))
        for item, target in read:  # (each once its bytes are in)
            planner.commit_tensor(item, target)

