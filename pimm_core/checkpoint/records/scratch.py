"""pimm's own temporary directories in ``$TMPDIR``: remote downloads (``pimm-remote-*``) and remote
exports being written (``pimm-export-*``), and the clean-up of those a killed process left; the
same for a local export's hidden directories beside its output (``.OUT.pimm-export-*.tmp``,
:mod:`.outputs`).

A process killed mid-download (``kill -9``, the OOM killer, a node's job limit) never runs its
``finally``: its directory, weights and all, would stay in ``$TMPDIR`` for good. So each
directory ``<TMPDIR>/pimm-remote-XXXX/`` comes with an owner file beside it,
``<TMPDIR>/pimm-remote-XXXX.lock``, that the process holds a ``filelock.FileLock`` on (an
exclusive ``flock``, the mechanism of the run lock in :mod:`pimm_core.process.lock` too) for as long as
the directory is in use. The kernel releases a ``flock`` when its holder dies, however it dies,
so whoever creates the next such directory (:func:`owned_temp_dir`) removes every directory
whose owner file it can lock without waiting (``acquire(blocking=False)``): its owner is gone. One
that is in use is never touched (its owner holds the lock; several pimm processes on one node
share ``$TMPDIR`` safely).

The owner file is created first (``mkstemp``: a fresh name) and locked, then the directory beside
it is made. A process killed in between leaves an owner file without a directory; one younger
than :data:`FRESH_S` seconds may be one being created this instant, and is left to a later
clean-up. Directories of these names without an owner file (an older pimm's) are not
recognisable as pimm's and are left alone. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock, Timeout

from ...fsio import remove_tree

PREFIXES = ("pimm-remote-", "pimm-export-")
OWNER_SUFFIX = ".lock"
FRESH_S = 60.0  # an owner file without its directory younger than this may be one being created right now
_OWN_WAIT_S = 10.0  # a fresh owner file of ours: another process's clean-up may hold it for a moment


def owner_lock(owner: Path) -> FileLock:
    """The lock on an owner file (one holder at a time; shared by the threads of a process; no soft
    fallback: a lock that outlives its dead holder would keep its directory for good)."""
    return FileLock(str(owner), thread_local=False, fallback_to_soft=False)


def remove_stale(tmp: Path | None = None, prefixes: tuple[str, ...] = PREFIXES, *,
                 settle: Callable[[Path], bool] | None = None) -> list[str]:
    """Remove pimm's temporary directories in ``tmp`` (default: ``$TMPDIR``) whose names start with
    one of ``prefixes`` and whose owner process is gone, with their owner files; returns the
    directory names removed. Never raises.

    Args:
        settle: called (under the owner's lock) with a stale directory before it is removed; True
            when it dealt with the directory itself (moved it back into place): it is not removed.
    """
    root = Path(tmp or tempfile.gettempdir())
    removed: list[str] = []
    try:
        owners = [p for p in root.iterdir() if p.name.endswith(OWNER_SUFFIX) and p.name.startswith(prefixes)]
    except OSError:
        return removed
    for owner in owners:
        lock = owner_lock(owner)
        try:
            lock.acquire(blocking=False)
        except (Timeout, OSError):
            continue  # its owner is alive (or the file is gone, or not ours to open)
        try:
            directory = owner.with_name(owner.name[: -len(OWNER_SUFFIX)])
            if not owner.exists():
                continue  # removed meanwhile by another clean-up
            if not directory.exists() and time.time() - owner.stat().st_mtime < FRESH_S:
                continue  # may be one that is being created this instant
            if not (settle is not None and directory.exists() and settle(directory)):
                remove_tree(directory)
            owner.unlink(missing_ok=True)  # last, while locked: the directory is gone first
            removed.append(directory.name)
        except OSError:
            continue
        finally:
            lock.release()
    return removed


def make_owned_dir(prefix: str, *, parent: Path | None = None, suffix: str = "",
                   mode: int = 0o700) -> tuple[Path, FileLock]:
    """Create ``<parent>/<prefix>XXXX<suffix>/`` (default ``parent``: ``$TMPDIR``) and its held owner
    file (see the module docstring); stale ones of earlier processes of the same ``prefix`` are
    removed first (in ``$TMPDIR``: of every prefix of :data:`PREFIXES`). ``mode`` is given to
    ``mkdir`` (the umask applies): private scratch by default; a directory that becomes the
    user's output is made with ``0o777`` so that it gets the permissions any directory they
    make would. Returns ``(directory, owner lock)``; give both to :func:`release` when done."""
    if parent is None:
        assert prefix in PREFIXES, prefix
        remove_stale()
    while True:
        fd, owner = tempfile.mkstemp(prefix=prefix, suffix=suffix + OWNER_SUFFIX, dir=parent)
        os.close(fd)
        lock = owner_lock(Path(owner))
        lock.acquire(timeout=_OWN_WAIT_S)  # a fresh name: at most another clean-up's look holds it
        directory = Path(owner[: -len(OWNER_SUFFIX)])
        try:
            directory.mkdir(mode=mode)
            return directory, lock
        except FileExistsError:  # a directory of that name that is not ours: another name
            os.unlink(owner)
            lock.release()


def release(directory: Path, lock: FileLock) -> None:
    """Remove ``directory`` and then its owner file, and let the owner file's lock go."""
    try:
        remove_tree(directory)
        Path(f"{directory}{OWNER_SUFFIX}").unlink(missing_ok=True)
    finally:
        lock.release()


@contextlib.contextmanager
def owned_temp_dir(prefix: str) -> Iterator[Path]:
    """A fresh ``$TMPDIR/<prefix>XXXX/`` (``pimm-remote-`` or ``pimm-export-``), removed on exit;
    one a killed process left is removed by the next call (see the module docstring)."""
    directory, lock = make_owned_dir(prefix)
    try:
        yield directory
    finally:
        release(directory, lock)
