"""Crash-safe file publishing (torch-free): the bottom layer, the filesystem I/O every other layer imports.

The rule everywhere: write under a temporary name, ``fsync`` the file, rename it
into place, ``fsync`` the directory. A crash at any instant leaves either the old
file or the new one under the final name, never a partial one.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

from .faults import point, register

register("atomic.written", "atomic.synced", "atomic.renamed")

TMP_SUFFIX = ".tmp"


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (renames, creations) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory below ``root`` (and ``root`` itself)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def temp_path(path: Path) -> Path:
    """The temporary name ``path`` is written under before its rename: ``.<name>.<pid>.tmp`` beside it."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def atomic_write(path: Path, write: Callable[[Path], None], *, durable: bool = True, points: str | None = "atomic",
                 before_replace: Callable[[], None] | None = None) -> None:
    """Replace ``path`` atomically with what ``write(tmp)`` writes to a temporary file beside it.

    The one copy of the rule: write the temporary file, fsync it, rename it over ``path``,
    fsync the directory. The temporary file is removed if any step fails.

    Args:
        durable: fsync the file and its directory. ``False`` is for frequently
            replaced status files where atomicity matters but durability does not.
        points: prefix of the fault-injection points fired after the write, the fsync
            and the rename (``<points>.written``, ``.synced``, ``.renamed``); ``None``: none.
        before_replace: called after the fsync, just before the rename (a checkpoint
            file drops its stale sidecar manifest there).

    Raises:
        OSError: the write, fsync or rename failed (the old ``path`` is untouched).
    """
    path = Path(path)
    tmp = temp_path(path)
    try:
        write(tmp)
        if durable:
            if points:
                point(f"{points}.written", tmp)
            fsync_file(tmp)
            if points:
                point(f"{points}.synced", tmp)
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        if points:
            point(f"{points}.renamed", path)
        fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically (:func:`atomic_write`; fault points ``atomic.*``).

    The temporary file lives next to ``path`` (same filesystem, so ``os.replace``
    is atomic) and is removed if the write fails.

    Args:
        durable: fsync the file and its directory. ``False`` is for frequently
            replaced status files where atomicity matters but durability does not.

    Raises:
        OSError: the write, fsync or rename failed (the old ``path`` is untouched).
    """

    def write(tmp: Path) -> None:
        # never through a link planted under the temporary name
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    atomic_write(path, write, durable=durable)


def release_cached_pages(path: Path) -> None:
    """Drop the page cache of a published (fsynced) file or tree; the bytes stay on disk.

    Called on the previous checkpoint just before the next one is written, so the new
    write takes the pages the old one held instead of fresh ones. A checkpoint is rarely
    read back, so this keeps checkpointing's page-cache footprint at one checkpoint rather
    than evicting the dataset's pages for a second one. On VMs that hand free memory back
    to the host (free page reporting, as on this project's Firecracker machines) it is
    also much faster: page-cache pages freed a second or more before a write fault in
    from the host again, ~2.3 s/GiB against ~0.25 s/GiB for pages freed just before
    (``benchmarks/README.md``, "Page cache on this VM").

    Advice only (``posix_fadvise(POSIX_FADV_DONTNEED)``; dirty pages are not dropped):
    a file that cannot be opened, or a platform without ``posix_fadvise``, is skipped.
    """
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    path = Path(path)
    files = [path] if path.is_file() else [Path(d) / n for d, _, names in os.walk(path) for n in names]
    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def keep_aside(path: Path, tag: str = "corrupt") -> Path:
    """Rename ``path`` to the first free ``<name>.<tag>-<n>`` (n = 1, 2, ...) beside it,
    never replacing an existing file (a hard link, then the unlink), and fsync the directory.

    Returns:
        The new path.

    Raises:
        OSError: the rename failed (``path`` is untouched).
    """
    path = Path(path)
    n = 1
    while True:
        dest = path.with_name(f"{path.name}.{tag}-{n}")
        try:
            os.link(path, dest)
            break
        except FileExistsError:
            n += 1
    os.unlink(path)
    fsync_dir(path.parent)
    return dest


def remove_tree(path: Path) -> None:
    """Remove a file or directory tree if present.

    Raises:
        OSError: the first entry that could not be removed, its ``filename`` the entry's full
            path (not the name relative to its directory that ``shutil.rmtree`` reports).
    """
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        def named(_func: Any, where: str, exc: BaseException) -> None:
            if isinstance(exc, OSError):
                raise OSError(exc.errno, exc.strerror, where) from exc
            raise exc

        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=named)
        else:
            shutil.rmtree(path, onerror=lambda func, where, info: named(func, where, info[1]))


def remove_stale_temporaries(directory: Path) -> list[str]:
    """Remove ``*.tmp`` entries (files and directories) that saves killed mid-write left in ``directory``.

    Their names carry the dead writer's pid (``.iter_14.pth.<pid>.tmp``), so no later
    save replaces them. Call only as the run's single writer (``pimm launch`` holds the
    run lock), before this process saves anything. ``last.prev`` is never touched: it
    may be the only complete candidate.
    """
    directory = Path(directory)
    removed = sorted(p.name for p in directory.iterdir() if p.name.endswith(TMP_SUFFIX))
    for name in removed:
        remove_tree(directory / name)
    if removed:
        fsync_dir(directory)
    return removed
