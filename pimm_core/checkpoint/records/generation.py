"""Reading one checkpoint generation whole while a live run replaces it (torch-free).

A run that saves replaces what a name holds: ``last`` is rotated (``last`` -> ``last.prev``,
``last.tmp`` -> ``last``; ``last.prev`` is then renamed away and removed), ``model_best.pth``
and ``model_last.pth`` are replaced by a rename with their sidecar manifests, a
single-format pointer is re-pointed, and retention deletes old files. The files inside a
published generation are never modified. A reader in another process therefore tells
whether what it read under a name is one generation by the name's :func:`identity` (the
inode and mtime of its directory or file, a pointer's target, and the same of its
manifest, which is only ever replaced by a rename) taken before and after the read: a
generation never comes back under a name it left, and a reused inode number comes with a
new manifest file, so equal identities mean every file opened in between belonged to that
generation.

:func:`read_whole` runs a read under that check and repeats it (a bounded number of
times) when a save overtook it; :func:`wait_for_rotation` covers the instant between a
rotation's two renames, when ``last`` is briefly absent.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from ...errors import CHANGED_EXIT_CODE, CheckpointError, IncompleteCheckpointError, WeightNotFoundError
from ...faults import point
from .manifest import COMPLETE, MANIFEST
from .outputs import EXPORT_JSON

T = TypeVar("T")

#: How many generations a reader tries before it reports that the checkpoint kept changing.
READ_TRIES = 5
#: How long (seconds) a reader waits for a name that a rotation is replacing to reappear.
ROTATION_WAIT_S = 1.0

Identity = tuple[Any, ...]


class GenerationChanged(CheckpointError):
    """A save replaced the checkpoint being read on every try: not a verdict on any checkpoint
    (exit code :data:`~pimm_core.errors.CHANGED_EXIT_CODE`, 75: try again)."""

    exit_code = CHANGED_EXIT_CODE


def _file_key(path: str) -> tuple[int, int, int] | None:
    """A manifest's identity: pimm replaces one only by a rename (a new inode), never in place."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def identity(path: str | os.PathLike[str]) -> Identity | None:
    """What generation ``path`` holds now; ``None`` when nothing is there.

    A directory: its device, inode and mtime, and its ``manifest.json``'s inode, size and
    mtime. A file (a pointer symlink is followed, and its target named): device, inode,
    size and mtime, and the same of the sidecar manifest ``<file>.json`` beside the target.
    """
    p = os.fspath(path)  # plain strings: a listing of a few hundred checkpoints calls this twice for each
    try:
        st = os.lstat(p)
        link = None
        if stat.S_ISLNK(st.st_mode):
            link, st = os.readlink(p), os.stat(p)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        return ("dir", link, st.st_dev, st.st_ino, st.st_mtime_ns, _file_key(os.path.join(p, MANIFEST)))
    real = os.path.realpath(p) if link is not None else p
    return ("file", link, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, _file_key(real + ".json"))


def unit_of(path: str | os.PathLike[str]) -> Path:
    """The checkpoint whose generation covers ``path``: a standard checkpoint directory for a
    file in it (``last/weights.pth``) or its ``trainer.dcp/``, an export directory for its
    model file, else ``path`` itself."""
    p = Path(path)
    if p.name and (p.parent / EXPORT_JSON).exists():
        return p.parent
    for d in (p.parent, p.parent.parent) if p.name else ():
        if (d / MANIFEST).exists() or (d / COMPLETE).exists():
            return d
    return p


def _pause(attempt: int) -> None:
    time.sleep(min(0.002 * 2 ** attempt, 0.05))


def read_whole(locate: Callable[[], Path], read: Callable[[Path], T], *, tries: int = READ_TRIES,
               what: str | None = None) -> T:
    """``read(locate())`` on one generation of the checkpoint ``locate`` names.

    ``locate`` (torch-free: resolve a source to the file to read) runs on every try (an
    error that a rotation could cause is raised when it repeats on the next try); the identity of that file's
    checkpoint (:func:`unit_of`) is taken before and after ``read``. A change, or an error
    raised while it changed (a file removed by a rotation), starts the next try; an error
    while it stayed the same is raised as it is.

    Raises:
        GenerationChanged: a save replaced the checkpoint during each of ``tries`` reads.
        whatever ``locate`` or ``read`` raise on a stable checkpoint.
    """
    unit: Path | None = None
    for attempt in range(1, tries + 1):
        try:
            target = locate()
        except (WeightNotFoundError, IncompleteCheckpointError, FileNotFoundError):
            if attempt > 1:
                raise
            _pause(attempt)  # what it found may have been rotated away under it: once more
            continue
        unit = unit_of(target)
        before = identity(unit)
        point("generation.located", target)  # (tests: a rotation lands here, between locate and read)
        try:
            result = read(target)
        except Exception:
            if before is not None and identity(unit) == before:
                raise
            _pause(attempt)
            continue
        if before is not None and identity(unit) == before:
            return result
        _pause(attempt)
    raise GenerationChanged(changed_message(what or str(unit), tries))


def changed_message(what: str, tries: int) -> str:
    """The one line a reader gives when saves kept replacing what it read."""
    return f"{what} changed while reading (a save replaced it; retried {tries} times); try again"


def rotating(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is absent and a rotation is visibly replacing it (``<path>.prev`` or
    ``<path>.tmp`` is there)."""
    p = Path(path)
    if not p.name or os.path.lexists(p):
        return False
    return any(os.path.lexists(p.with_name(p.name + suffix)) for suffix in (".prev", ".tmp"))


def wait_for_rotation(path: str | os.PathLike[str], timeout_s: float = ROTATION_WAIT_S) -> bool:
    """Wait (at most ``timeout_s``) for ``path`` to reappear while :func:`rotating` says a
    rotation is replacing it. Returns whether ``path`` exists now.

    A rotation's two renames are a directory fsync apart; a rotation that a crash
    interrupted leaves ``<path>.prev`` for good, and then this returns False after the wait.
    """
    deadline = time.monotonic() + timeout_s
    if rotating(path):
        point("generation.rotating", path)  # (tests: the rotation completes while a reader waits here)
    while rotating(path) and time.monotonic() < deadline:
        time.sleep(0.005)
    return os.path.lexists(path)
