"""Reading a checkpoint's tensor bytes straight into the tensors they are loaded into.

A file mapped with ``torch.load(mmap=True)`` (or DCP's shards, :mod:`.mapped_reader`) is
unpickled without reading its tensor data; copying a mapped tensor into a parameter then
faults the map's pages in one by one, which costs 2-3x a ``preadv`` of the same bytes into
the parameter (80 MiB: 110 against 40 ms here, alternated; ``benchmarks/README.md``). The
map is kept for the unpickling: it gives each tensor's place in the file (its address minus
the map's), from which :meth:`Reads.pread_into` reads.

The reads of a file go to two reading threads (:class:`Reads`): ``preadv`` releases the GIL,
so the unpickling of a shard's next records goes on while the bytes of the last ones are read,
and a large tensor's bytes are read in pieces on both cores (most of a read's time is the
first touch of freshly allocated optimizer state; benchmarks/README.md, "Loads read on two
threads").
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...pools import SharedPool


def _place(whole: torch.UntypedStorage, mapped: torch.Tensor, target: Any) -> tuple[int, int] | None:
    """``(offset in the file, bytes)`` of ``mapped`` (a tensor over ``whole``) when reading them into
    ``target`` is what ``target.copy_(mapped)`` does: a plain CPU tensor of the same dtype and
    shape, both contiguous, the bytes all inside the map; else None."""
    nbytes = mapped.numel() * mapped.element_size()
    start = mapped.data_ptr() - whole.data_ptr()
    if (type(target) in (torch.Tensor, nn.Parameter) and target.layout == mapped.layout == torch.strided
            and not target.is_quantized and not mapped.is_quantized and target.is_cpu and target.dtype == mapped.dtype
            and target.shape == mapped.shape and target.is_contiguous() and mapped.is_contiguous()
            and not target.is_conj() and not target.is_neg() and 0 <= start and start + nbytes <= whole.nbytes()):
        return start, nbytes
    return None


READ_PIECE = 8 << 20  # a large tensor's bytes are read in pieces of this size, on both threads
INLINE_MAX = 256 << 10  # smaller reads are done at once on the calling thread (a hand-off costs more)

_read_pool = SharedPool(2, "read")


def _read_exact(fd: int, view: memoryview, offset: int) -> None:
    got = 0
    while got < view.nbytes:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise OSError(f"{view.nbytes - got} bytes missing at offset {offset + got}")
        got += n


class Reads:
    """Reads of tensor bytes on the reading threads; :meth:`wait` (or leaving the ``with``
    block) returns once every read queued has ended. The caller keeps ``fd`` open and does not
    use the targets until then."""

    def __init__(self) -> None:
        self._pending: list[Future[None]] = []

    def pread_into(self, fd: int, whole: torch.UntypedStorage, mapped: torch.Tensor, target: torch.Tensor) -> bool:
        """Queue the read of the bytes of ``mapped`` (a tensor over ``whole``, the map of file ``fd``)
        into ``target``. False, with nothing queued, where that would not be what
        ``target.copy_(mapped)`` does (:func:`_place`) or there is nothing to read; the caller copies then.

        Raises:
            OSError: a read done at once (under ``INLINE_MAX`` bytes) failed; a queued read's
                failure is raised by :meth:`wait`.
        """
        place = _place(whole, mapped, target)
        if place is None or not place[1]:
            return False
        start, nbytes = place
        view = memoryview(target.detach().reshape(-1).view(torch.uint8).numpy())
        if nbytes < INLINE_MAX:
            _read_exact(fd, view, start)
            return True
        for offset in range(0, nbytes, READ_PIECE):
            piece = view[offset:offset + READ_PIECE]
            try:
                self._pending.append(_read_pool.submit(_read_exact, fd, piece, start + offset))
            except RuntimeError:  # (no new threads at interpreter exit): read here
                _read_exact(fd, piece, start + offset)
        return True

    def wait(self) -> None:
        """Wait for every queued read.

        Raises:
            OSError: a read failed, or the file is shorter than its map (it shrank); raised
                after every other read has ended.
        """
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for f in pending:
            try:
                f.result()
            except BaseException as e:  # (the others still run: wait for them before raising)
                error = error or e
        if error is not None:
            raise error

    def __enter__(self) -> Reads:
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        try:
            self.wait()
        except Exception:
            if kind is None:
                raise  # (else the exception already raised is the one reported)


def mapped_load(path: Path) -> tuple[Any, torch.UntypedStorage] | None:
    """``torch.load(path, mmap=True, weights_only=True)`` that also returns the map (what
    ``torch.load`` does inside: the same private ``_load`` with ``overall_storage``); None
    where this torch has no such function or the file cannot be loaded this way (the caller
    loads it the ordinary way, which names the problem)."""
    try:
        from torch import _weights_only_unpickler
        from torch.serialization import _load, _open_zipfile_reader
    except ImportError:
        return None
    try:
        whole = torch.UntypedStorage.from_file(str(path), False, Path(path).stat().st_size)  # MAP_PRIVATE, lazy
        with open(path, "rb") as f, _open_zipfile_reader(f) as archive:
            return _load(archive, "cpu", _weights_only_unpickler, overall_storage=whole, weights_only=True), whole
    except Exception:
        return None


def _plain_loading(module: nn.Module) -> bool:
    """``load_state_dict`` of ``module`` only copies each entry into the tensor of the same name:
    no load hooks, no module that loads its own way or has extra state."""
    base = nn.Module
    for m in module.modules():
        kind = type(m)
        if (m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks or m._state_dict_hooks
                or getattr(m, "_state_dict_pre_hooks", None)
                or kind._load_from_state_dict is not base._load_from_state_dict
                or kind.get_extra_state is not base.get_extra_state
                or kind.state_dict is not base.state_dict or kind.load_state_dict is not base.load_state_dict):
            return False
    return True


def read_into_module(path: Path, whole: torch.UntypedStorage, module: nn.Module, sd: dict[str, torch.Tensor]) -> bool:
    """Read ``sd`` (the state dict of ``path``, mapped over ``whole``) into ``module``'s own tensors,
    where that is exactly what ``module.load_state_dict(sd)`` would do: the same keys, each
    tensor of the same dtype, shape and device (CPU), contiguous, and modules that load plainly.
    False, with nothing read, otherwise (the caller calls ``load_state_dict``).

    Raises:
        OSError: the file could not be read (its tensors may be partly loaded).
    """
    if not _plain_loading(module):
        return False
    own = module.state_dict(keep_vars=True)
    if own.keys() != sd.keys() or any(_place(whole, src, own[k]) is None for k, src in sd.items()):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        with torch.no_grad(), Reads() as reads:
            for k, src in sd.items():
                reads.pread_into(fd, whole, src, own[k])
    finally:
        os.close(fd)
    return True
