"""What a failed checkpoint write names: the path and the cause, in one line.

``torch.save``'s zip writer reports a failed write as a ``RuntimeError`` ("unexpected pos ...",
"iostream error"), and DCP wraps each rank's exception in a ``CheckpointException`` (a
``BaseException``); the ``OSError`` behind them (``File too large`` past ``RLIMIT_FSIZE``, ``No
space left on device``, ``Input/output error``) is found in the exception's chain, else read from
the file system while the partial files are still there (:func:`_probe`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from ...errors import first_line


def torch_save(obj: Any, path: Path, wrap: Callable[[Any], Any] | None = None) -> None:
    """``torch.save(obj, path)``; a write that failed is the ``OSError`` it was (``torch.save``'s zip
    writer says only "unexpected pos" or "iostream error"), read from the file system before the
    caller removes the partial file (:func:`_probe`).

    ``wrap``: given the file opened for writing, returns the file object ``torch.save`` writes
    through (:meth:`~.follow.FollowingHasher.writing`: hashed on the way); closed after.

    Raises:
        OSError: the write failed for a cause the file system shows (file size limit, no space).
        RuntimeError: ``torch.save``'s own, for any other cause.
    """
    try:
        if wrap is None:
            torch.save(obj, path)
        else:
            with wrap(open(path, "wb")) as f:
                torch.save(obj, f)
    except RuntimeError as e:
        found = _os_error_in(e) or _probe(path)
        if found is None:
            raise
        raise OSError(found.errno, found.strerror, str(path)) from e


def short_error(e: BaseException, where: Path | None = None) -> str:
    """One line for a save's error message: ``<path>: <cause>``.

    The cause is the OS error anywhere in ``e``'s chain (DCP wraps each rank's exception in a
    ``CheckpointException``; ``torch.save`` raises a ``RuntimeError`` of its zip writer, "unexpected
    pos ..."), else what the file system says now about ``where`` (the directory being written,
    before it is removed): a file at the ``RLIMIT_FSIZE`` limit is "File too large", a full file
    system "No space left on device"; else ``<class>: <first line>``.
    """
    found = _os_error_in(e) or (_probe(where) if where is not None else None)
    if found is not None:
        return f"{found.filename or where or '?'}: {_strerror(found)}"
    head = f"{where}: " if where is not None else ""
    return head + f"{e.__class__.__name__}: {first_line(e, empty='')}"


def _os_error_in(e: BaseException | None, depth: int = 0) -> OSError | None:
    """The first ``OSError`` with an errno in ``e``, its causes and contexts, and the failures a
    ``CheckpointException`` holds (DCP: ``{rank: (exception, traceback)}``)."""
    if e is None or depth > 8:
        return None
    if isinstance(e, OSError) and e.errno:
        return e
    failures = getattr(e, "failures", None)
    inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if isinstance(failures, dict) else []
    for nxt in (*inner, e.__cause__, e.__context__):
        if isinstance(nxt, BaseException):
            found = _os_error_in(nxt, depth + 1)
            if found is not None:
                return found
    return None


def _fsize_limit() -> int | None:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _strerror(e: OSError) -> str:
    import errno

    text = e.strerror or str(e)
    limit = _fsize_limit()
    if e.errno == errno.EFBIG and limit is not None:
        return f"{text} (RLIMIT_FSIZE: at most {limit} bytes per file; raise it with ulimit -f)"
    return text


def _probe(where: Path) -> OSError | None:
    """The cause a write under ``where`` (a file or a directory) failed with, read from the file
    system now: a file at the ``RLIMIT_FSIZE`` limit (EFBIG), or a file system without free space
    (ENOSPC); None when neither."""
    import errno
    import shutil

    limit = _fsize_limit()
    try:
        if limit is not None and where.exists():
            files = [where] if where.is_file() else [p for p in where.rglob("*") if p.is_file()]
            big = next((p for p in files if p.stat().st_size >= limit), None)
            if big is not None:
                return OSError(errno.EFBIG, os.strerror(errno.EFBIG), str(big))
        usage = shutil.disk_usage(where if where.exists() else where.parent)
    except OSError:
        return None
    if usage.free < min(1 << 20, usage.total // 20):
        return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({usage.free} bytes free of {usage.total})",
                       str(where))
    return None
