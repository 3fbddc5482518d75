"""Crash-safe file publishing (torch-free): the bottom layer, the filesystem I/O every other layer imports.

The rule everywhere: write under a temporary name, ``fsync`` the file, rename it
into place, ``fsync`` the directory. A crash at any instant leaves either the old
file or the new one under the final name, never a partial one.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Collection

from .faults import point, register
from .pools import SharedPool

register("atomic.written", "atomic.synced", "atomic.renamed")

TMP_SUFFIX = ".tmp"


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(text: str) -> str | None:
    """The scheme of ``text`` when it is a URL (``s3://b/p`` -> ``"s3"``; any ``scheme://``), else None.

    A local path never has one; pimm takes such a string as a URL, never as a directory named ``s3:``.
    """
    m = _URL.match(text)
    return m.group(1).lower() if m else None


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


# fsyncs issued together: ext4's journal (jbd2) commits concurrent fsyncs in one transaction, so
# the 5-8 small fsyncs before a checkpoint's rename cost about one (16.8 -> 3.5 ms for 8 here;
# benchmarks/README.md). A few threads, started once, reused by every save.
_sync_pool = SharedPool(4, "fsync")


def _fsync_key(fd: int) -> tuple[int, int]:
    os.fsync(fd)
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _fsync_path(path: Path) -> tuple[int, int]:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        return _fsync_key(fd)
    finally:
        os.close(fd)


def fsync_tree_together(root: Path, skip: Collection[tuple[int, int]] = ()) -> None:
    """:func:`fsync_tree` with the fsyncs issued at once (a few threads), leaving out the files
    whose ``(st_dev, st_ino)`` is in ``skip`` (already fsynced since their last write, e.g. by
    :class:`BackgroundSync`). Every directory is fsynced.

    Raises:
        OSError: an fsync (or open) failed; the first failure, after all have finished.
    """
    paths = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            st = p.stat()
            if (st.st_dev, st.st_ino) not in skip:
                paths.append(p)
        paths.append(Path(dirpath))
    futures = [_sync_pool.submit(_fsync_path, p) for p in paths]
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


class BackgroundSync:
    """fsync of files a writer has just written, in the background, while it writes the next one.

    :meth:`add` takes a file descriptor of a file being written (it is duplicated: the writer
    closes its own, and a rename of the file does not matter); :meth:`start` fsyncs them all
    on the fsync threads; :meth:`wait` returns when they are durable. A checkpoint's DCP
    shards are fsynced this way while rank 0 writes ``weights.pth`` (the disk writes one
    file while the CPU serializes the next), instead of before it.
    """

    def __init__(self) -> None:
        self._fds: list[int] = []
        self._futures: list[Future] = []

    def add(self, fd: int) -> None:
        self._fds.append(os.dup(fd))

    def start(self) -> BackgroundSync:
        self._futures = [_sync_pool.submit(_fsync_key, fd) for fd in self._fds]
        return self

    def wait(self) -> set[tuple[int, int]]:
        """Block until every added file is fsynced; returns their ``(st_dev, st_ino)``.

        Raises:
            OSError: an fsync failed (the first failure).
        """
        try:
            keys, first = set(), None
            for f in self._futures:
                e = f.exception()
                if e is None:
                    keys.add(f.result())
                elif first is None:
                    first = e
            if first is not None:
                raise first
            return keys
        finally:
            self.close()

    def close(self) -> None:
        """Wait for the fsyncs in flight (not their outcome) and close the descriptors (idempotent)."""
        for f in self._futures:
            f.exception()
        fds, self._fds, self._futures = self._fds, [], []
        for fd in fds:
            os.close(fd)


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


class PageRelease:
    """Release the page cache of a published tree step by step, a fixed distance ahead of a writer.

    :func:`release_cached_pages` of the whole previous checkpoint just before the next one
    is written frees all its pages at once; on a VM with free page reporting the pages the
    writer has not taken within about a second go back to the host and fault in again at
    host speed, so a save that runs longer than that (a big checkpoint, a busy machine)
    pays for most of its bytes twice. Released ``ahead`` bytes in front of what has been
    written, the freed pages are taken again within milliseconds. Advice only, as
    :func:`release_cached_pages`: the bytes stay on disk.

    Args:
        old: the previous checkpoint (a file or a tree; absent: nothing to release).
        ahead: how many bytes beyond the ones written to have released at any time.
    """

    GRAIN = 2 << 20

    def __init__(self, old: Path, ahead: int = 128 << 20) -> None:
        old = Path(old)
        files = [old] if old.is_file() else sorted(Path(d) / n for d, _, names in os.walk(old) for n in names)
        self._files: list[tuple[Path, int]] = []
        for f in files:
            try:
                self._files.append((f, f.stat().st_size))
            except OSError:
                pass
        self.ahead = ahead
        self._index = 0  # the file being released, and how far into it (a GRAIN multiple)
        self._offset = 0
        self.released = 0

    def advance(self, written: int) -> None:
        """Release up to ``written + ahead`` bytes of the old tree, in file order.

        Within a file, ranges end on a ``GRAIN`` boundary (a file's end: to its end): the
        kernel drops only the page-cache folios (up to 2 MiB each) a range covers whole.
        """
        advise = getattr(os, "posix_fadvise", None)
        target = written + self.ahead
        while self.released < target and self._index < len(self._files):
            path, size = self._files[self._index]
            end = self._offset + min(size - self._offset, target - self.released)
            if end < size:
                end = end // self.GRAIN * self.GRAIN
                if end <= self._offset:
                    return  # (not a whole grain further yet)
            if advise is not None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        advise(fd, self._offset, end - self._offset if end < size else 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
                except OSError:
                    pass  # (gone, unreadable: nothing to release)
            self.released += end - self._offset
            self._offset = end
            if end >= size:
                self._index, self._offset = self._index + 1, 0

    def finish(self) -> None:
        """Release whatever is left."""
        self.advance(sum(size for _, size in self._files))


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
            if isinstance(exc, FileNotFoundError):
                return  # removed meanwhile by another remover: what this call was for
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
