"""pimm's own temporary directories in ``$TMPDIR``: remote downloads (``pimm-remote-*``) and remote
exports being written (``pimm-export-*``), and the clean-up of those a killed process left.

A process killed mid-download (``kill -9``, the OOM killer, a node's job limit) never runs its
``finally``: its directory, weights and all, would stay in ``$TMPDIR`` for good. So each
directory ``<TMPDIR>/pimm-remote-XXXX/`` comes with an owner file beside it,
``<TMPDIR>/pimm-remote-XXXX.lock``, that the process holds an exclusive ``flock`` on for as
long as the directory is in use. The kernel releases a ``flock`` when its holder dies, however
it dies, so whoever creates the next such directory (:func:`owned_temp_dir`) removes every
directory whose owner file it can lock: its owner is gone. One that is in use is never touched
(its owner holds the lock; several pimm processes on one node share ``$TMPDIR`` safely).

The owner file is created first (``mkstemp``: a fresh name), locked, then given the owner's pid
and host, then the directory beside it is made. A process killed in between leaves an owner
file without a directory (removed like the rest), or an empty one: an empty owner file younger
than :data:`FRESH_S` seconds may be one being created this instant, and is left to a later
clean-up. Directories of these names without an owner file (an older pimm's) are not
recognisable as pimm's and are left alone. Torch-free.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterator

from ...fsio import remove_tree

PREFIXES = ("pimm-remote-", "pimm-export-")
OWNER_SUFFIX = ".lock"
FRESH_S = 60.0  # an empty owner file younger than this may be one being created right now


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def remove_stale(tmp: Path | None = None) -> list[str]:
    """Remove pimm's temporary directories in ``tmp`` (default: ``$TMPDIR``) whose owner process is
    gone, with their owner files; returns the directory names removed. Never raises."""
    root = Path(tmp or tempfile.gettempdir())
    removed: list[str] = []
    try:
        owners = [p for p in root.iterdir() if p.name.endswith(OWNER_SUFFIX) and p.name.startswith(PREFIXES)]
    except OSError:
        return removed
    for owner in owners:
        try:
            fd = os.open(owner, os.O_RDWR)
        except OSError:
            continue  # removed meanwhile, or not ours to open
        try:
            if not _try_lock(fd):
                continue  # its owner is alive
            st = os.fstat(fd)
            try:
                if os.stat(owner).st_ino != st.st_ino:
                    continue  # removed and made anew under the same name since we opened it
            except FileNotFoundError:
                continue
            if st.st_size == 0 and time.time() - st.st_mtime < FRESH_S:
                continue  # may be one that is being created this instant
            directory = owner.with_name(owner.name[: -len(OWNER_SUFFIX)])
            remove_tree(directory)
            owner.unlink(missing_ok=True)  # last, while locked: the directory is gone first
            removed.append(directory.name)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def make_owned_dir(prefix: str) -> tuple[Path, int]:
    """Create ``$TMPDIR/<prefix>XXXX/`` and its held owner file (see the module docstring);
    stale ones of earlier processes are removed first. Returns ``(directory, owner fd)``; give
    both to :func:`release` when done."""
    assert prefix in PREFIXES, prefix
    remove_stale()
    while True:
        fd, owner = tempfile.mkstemp(prefix=prefix, suffix=OWNER_SUFFIX)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh file: nobody else holds it
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        directory = Path(owner[: -len(OWNER_SUFFIX)])
        try:
            directory.mkdir(mode=0o700)
            return directory, fd
        except FileExistsError:  # a directory of that name that is not ours: another name
            os.unlink(owner)
            os.close(fd)


def release(directory: Path, fd: int) -> None:
    """Remove ``directory`` and then its owner file, and let the owner file's lock go."""
    try:
        remove_tree(directory)
        Path(f"{directory}{OWNER_SUFFIX}").unlink(missing_ok=True)
    finally:
        os.close(fd)


@contextlib.contextmanager
def owned_temp_dir(prefix: str) -> Iterator[Path]:
    """A fresh ``$TMPDIR/<prefix>XXXX/`` (``pimm-remote-`` or ``pimm-export-``), removed on exit;
    one a killed process left is removed by the next call (see the module docstring)."""
    directory, fd = make_owned_dir(prefix)
    try:
        yield directory
    finally:
        release(directory, fd)
