"""sha256 of checkpoint files computed while they are being written (torch-free).

The manifest records the sha256 of every file of a checkpoint. Hashing after the
write re-reads every byte on the save's critical path (~0.8 s per GiB on one core
here, as long as the write itself). :class:`FollowingHasher` instead hashes the files
on other threads as the writers append to them, the way a pipelined ``tee | sha256sum``
would: the hash overlaps the writes and is finished by :meth:`FollowingHasher.finish`.

The files this process writes itself (rank 0's own DCP shards, ``weights.pth``) are
written through a :class:`HashedFile`, which tells the hashing threads how far the bytes
have reached the kernel: no polling, and the hash of each file trails its writer by at
most ``LAG_MAX`` while the writer goes on to the next file and the save's other work
(benchmarks/README.md, "The hash trails the writer"). Reading the bytes back from the page
cache into a small buffer costs no more CPU than hashing the writer's own buffer did (the
copy lands in a cache-warm buffer). The follower thread remains for the files
other processes write (the node's other ranks' shards); with one local rank it is not
started.

Sound only for files written append-only, once: DCP's shard files (each tensor is
``torch.save``-d into the stream in order; nothing seeks back) and ``torch.save`` to a
new file, which is all it is used for. A followed file whose length at the end differs
from what was hashed, or that was seen shorter than what was already hashed, is left
out of the result and the caller hashes it the ordinary way; a file rewritten in place
from its start between two polls would not be noticed, so nothing else may be followed.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any, Callable

from ...pools import SharedPool

CHUNK = 8 << 20
# A file written through a HashedFile is hashed from its own bytes on a hashing thread,
# trailing its writer: the writer hands its bytes to the kernel every REPORT bytes and goes
# on, and waits only if the hash falls more than LAG_MAX behind (so what is hashed is still in
# the page cache). The hash of one file then overlaps the writes of the next and the save's
# other work, and two files are hashed at once on two cores.
REPORT = 1 << 20
LAG_MAX = 128 << 20
TRAIL_CHUNK = 4 << 20  # each hashing thread's read buffer (kept: its pages fault in once)
STEP = 32 << 20  # hashed per file per pass, so the writers' progress is seen (on_written) at least this often
POLL_S = 0.005


class _Followed:
    __slots__ = ("fd", "sha", "pos", "size", "ino", "broken")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.sha = hashlib.sha256()
        self.pos = 0
        self.size = 0
        self.ino = os.fstat(fd).st_ino
        self.broken = False


# The hashing threads, shared by every HashedFile (a file's bytes are hashed by one job at a
# time, in order; two files are hashed at once).
_hash_pool = SharedPool(2, "sha256-w")
_thread_buffers = threading.local()


def _hash_next(fd: int, sha: Any, buf: memoryview, pos: int, end: int) -> int:
    """Read the file's bytes from ``pos`` (at most to ``end``, at most ``len(buf)``) into ``buf`` and
    add them to ``sha``; the bytes read, 0 at the file's end."""
    n = os.preadv(fd, [buf[:min(len(buf), end - pos)]], pos)
    if n > 0:
        sha.update(buf[:n])  # (hashlib releases the GIL for large updates)
    return n


def _thread_buffer() -> memoryview:
    buf = getattr(_thread_buffers, "buf", None)
    if buf is None:
        buf = _thread_buffers.buf = memoryview(bytearray(TRAIL_CHUNK))
    return buf


class _Trail:
    """The sha256 of one file, computed on the hashing threads from the file's bytes (a
    read-only descriptor of its own) up to ``mark``: what its writer has handed to the kernel."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.sha = hashlib.sha256()
        self.hashed = 0
        self.mark = 0
        self.running = False  # a drain job is queued or running
        self.stopped = False
        self.error: BaseException | None = None
        self.cv = threading.Condition()

    def advance(self, mark: int, *, wait: bool = True) -> None:
        """Hash up to ``mark`` bytes; with ``wait``, wait while the hash trails it by more than ``LAG_MAX``."""
        lag_max = LAG_MAX if wait else None
        with self.cv:
            self.mark = mark
            if not self.running and self.hashed < mark and self.error is None:
                try:
                    _hash_pool.submit(self._drain)
                    self.running = True
                except RuntimeError as e:  # (no new threads at interpreter exit): hashed the ordinary way
                    self.error = e
            while lag_max is not None and self.running and self.mark - self.hashed > lag_max:
                self.cv.wait()

    def _drain(self) -> None:
        try:
            buf = _thread_buffer()
            while True:
                with self.cv:
                    start, end = self.hashed, min(self.mark, self.hashed + len(buf))
                    if self.stopped or end <= start:
                        self.running = False
                        self.cv.notify_all()
                        return
                n = _hash_next(self.fd, self.sha, buf, start, end)
                if n <= 0:
                    raise OSError(f"the file ended at {start} bytes, {self.mark} were written")
                with self.cv:
                    self.hashed = start + n
                    self.cv.notify_all()
        except BaseException as e:  # the file is then hashed the ordinary way
            with self.cv:
                self.error, self.running = e, False
                self.cv.notify_all()

    def result(self) -> str | None:
        """Wait for the hash to reach ``mark``; its hex digest, or None if it failed or was stopped."""
        with self.cv:
            while self.running:
                self.cv.wait()
            ok = self.error is None and not self.stopped and self.hashed == self.mark
        self.close()
        return self.sha.hexdigest() if ok else None

    def stop(self) -> None:
        """Stop hashing (a drain job ends after its current read) and close the descriptor."""
        with self.cv:
            self.stopped = True
            while self.running:
                self.cv.wait()
        self.close()

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _open_trail(f: Any) -> _Trail | None:
    """A trail reading the file ``f`` (open for writing) through a descriptor of its own, or None
    when the file cannot be opened again by its name as the same file (then it is not hashed here)."""
    name = getattr(f, "name", None)
    if not isinstance(name, (str, os.PathLike)):
        return None
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    mine, theirs = os.fstat(fd), os.fstat(f.fileno())
    if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):  # (renamed over since it was opened)
        os.close(fd)
        return None
    return _Trail(fd)


class HashedFile:
    """A binary file open for writing whose bytes are hashed as they are written through it.

    Made by :meth:`FollowingHasher.writing`. Every ``REPORT`` bytes the writer's buffer is
    flushed to the kernel and a hashing thread reads those bytes back (from the page cache,
    through a descriptor of its own) into the file's sha256, trailing the writer by up to
    ``LAG_MAX``; :meth:`write` never holds on to the caller's buffer. The hash is finished by
    :meth:`FollowingHasher.finish`, not at :meth:`close`, and recorded only if every byte went
    through :meth:`write` in order (a ``seek`` or ``truncate``, or a position that is not the
    bytes written so far, leaves the file to the ordinary hash).
    """

    def __init__(self, f: Any, owner: FollowingHasher) -> None:
        self._f, self._owner = f, owner
        self._pos = f.tell()
        self._broken = self._pos != 0  # (a file not written from its start is not hashed here)
        self._trail = None if self._broken else _open_trail(f)
        self._broken = self._broken or self._trail is None
        self._closed = False
        self._unreported = 0

    def write(self, b: Any) -> int:
        view = memoryview(b)
        n = self._f.write(view)
        if n is not None and n != view.nbytes:  # (a raw file's short write: the caller writes the rest)
            self._broken = True
        self._pos += view.nbytes
        self._unreported += view.nbytes
        if self._unreported >= REPORT:  # (in steps: a zip header's write is a few bytes)
            self._hand_over()
        return view.nbytes if n is None else n

    def _hand_over(self) -> None:
        """Flush to the kernel, let the hash follow, report the progress."""
        self._f.flush()
        if self._trail is not None and not self._broken:
            self._trail.advance(self._pos)
        n, self._unreported = self._unreported, 0
        if n:
            self._owner._wrote(n)

    def tell(self) -> int:
        pos = self._f.tell()
        if pos != self._pos:
            self._broken = True
        return pos

    def seek(self, *args: Any) -> int:
        self._broken = True
        return self._f.seek(*args)

    def truncate(self, *args: Any) -> int:
        self._broken = True
        return self._f.truncate(*args)

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    @property
    def closed(self) -> bool:
        return self._f.closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        key = None  # the file's (st_dev, st_ino) when it was written whole through write()
        try:
            self._hand_over()
            st = os.fstat(self._f.fileno())
            if not self._broken and st.st_size == self._pos:
                key = (st.st_dev, st.st_ino)
        finally:
            try:
                self._f.close()
            except BaseException:
                key = None  # (its last bytes may not have reached the file)
                raise
            finally:
                self._settle_trail(key)

    def _settle_trail(self, key: tuple[int, int] | None) -> None:
        """Hand the trail to the owner (its hash goes on; :meth:`FollowingHasher.finish` waits for
        it), or stop it and close its descriptor when the file is not recorded (``key`` None)."""
        trail, self._trail = self._trail, None
        if trail is None:
            return
        if key is None:
            trail.stop()
            return
        try:
            trail.advance(self._pos, wait=False)
            self._owner._trailing(key, self._pos, trail)
        except BaseException:
            trail.stop()
            raise

    def __enter__(self) -> HashedFile:
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        if kind is not None:
            self._broken = True  # (a failed write's partial file is never recorded)
        self.close()


class FollowingHasher:
    """Hash the files under ``root`` accepted by ``match`` while they are written, and those
    written through :meth:`writing` by their writer.

    Usage: :meth:`start` before the writers begin, :meth:`finish` after every writer has
    closed its file (it drains what is left and returns the hashes); :meth:`close` on any
    path that does not call :meth:`finish`.

    Args:
        root: directory the files appear in (searched recursively).
        match: called with the path relative to ``root`` (POSIX); True to follow it.
            None: no file is followed (no thread; only :meth:`writing`'s files are hashed).
        on_written: called at least once per ``STEP`` bytes hashed of each followed file
            and whenever the files grew (on the hashing thread), and for each ``REPORT``
            bytes written through :meth:`writing` and at its close (on the writer's thread),
            with the bytes written so far to all of them
            together (the previous checkpoint's pages are released in step with it:
            :class:`~pimm_core.fsio.PageRelease`; calls are serialized).
    """

    def __init__(self, root: Path, match: Callable[[str], bool] | None,
                 on_written: Callable[[int], None] | None = None) -> None:
        self.root = Path(root)
        self.match = match
        self.on_written = on_written
        self._files: dict[str, _Followed] = {}
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._buf = bytearray(CHUNK)
        self._thread = threading.Thread(target=self._run, name="pimm-sha256", daemon=True)
        self._lock = threading.Lock()
        self._followed_bytes = 0
        self._own_bytes = 0
        self._trails: list[tuple[tuple[int, int], int, _Trail]] = []
        self._accepting = True  # until finish() or close() takes the trails

    def start(self) -> FollowingHasher:
        if self.match is not None:
            self._thread.start()
        return self

    def writing(self, f: Any) -> HashedFile:
        """``f`` (a binary file just opened for writing, at its start) wrapped so that what is
        written through it is hashed on the way; :meth:`finish` returns it once it is closed."""
        return HashedFile(f, self)

    def _wrote(self, n: int) -> None:
        with self._lock:
            self._own_bytes += n
            if self.on_written is not None:
                self.on_written(self._own_bytes + self._followed_bytes)

    def _trailing(self, key: tuple[int, int], size: int, trail: _Trail) -> None:
        with self._lock:
            if self._accepting:
                self._trails.append((key, size, trail))
                return
        trail.stop()  # (closed after finish() or close(): nobody would wait for it)

    def _scan(self) -> None:
        for dirpath, _dirs, names in os.walk(self.root):
            for name in names:
                rel = (Path(dirpath) / name).relative_to(self.root).as_posix()
                if rel in self._files or not self.match(rel):
                    continue
                try:
                    self._files[rel] = _Followed(os.open(Path(dirpath) / name, os.O_RDONLY))
                except OSError:
                    pass  # gone again (renamed, removed): hashed the ordinary way if it matters

    def _advance(self, f: _Followed) -> bool:
        size = f.size = os.fstat(f.fd).st_size
        if size < f.pos:
            f.broken = True  # truncated under us: what was hashed is not the file any more
        if f.broken:
            return False
        view = memoryview(self._buf)
        moved = False
        end = min(size, f.pos + STEP)
        while f.pos < end:
            n = _hash_next(f.fd, f.sha, view, f.pos, end)
            if n <= 0:
                break
            f.pos += n
            moved = True
        return moved

    def _run(self) -> None:
        try:
            while True:
                done = self._done.is_set()  # read first: the pass below then sees every byte written before
                self._scan()
                moved = False
                for f in list(self._files.values()):
                    moved = self._advance(f) or moved
                with self._lock:
                    self._followed_bytes = sum(f.size for f in self._files.values())
                    if self.on_written is not None:
                        self.on_written(self._own_bytes + self._followed_bytes)
                if done and not moved:
                    return
                if not moved:
                    self._done.wait(POLL_S)
        except BaseException as e:  # reported by finish(); the caller falls back to hashing itself
            self._error = e

    def finish(self) -> dict[tuple[int, int], dict[str, Any]]:
        """Hash what is left and stop. Call after every writer has closed its files.

        Returns:
            ``{(st_dev, st_ino): {"size": bytes, "sha256": hex}}`` for each followed file
            hashed whole and each file written whole through :meth:`writing`, keyed by
            inode so a file renamed since (a temporary name moved into place) is still
            recognized. No followed file if the thread failed.
        """
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            trails, self._trails, self._accepting = self._trails, [], False
        out: dict[tuple[int, int], dict[str, Any]] = {}
        try:
            for key, size, trail in trails:
                digest = trail.result()
                if digest is not None:
                    out[key] = {"size": size, "sha256": digest}
            if self._error is None:
                for f in self._files.values():
                    st = os.fstat(f.fd)
                    if not f.broken and st.st_size == f.pos:
                        out[(st.st_dev, st.st_ino)] = {"size": f.pos, "sha256": f.sha.hexdigest()}
        finally:
            for _key, _size, trail in trails:
                trail.stop()  # (a no-op once its result is taken)
            self.close()
        return out

    def close(self) -> None:
        """Stop following and close every file (idempotent)."""
        self._done.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        with self._lock:
            trails, self._trails, self._accepting = self._trails, [], False
        for _key, _size, trail in trails:
            trail.stop()
        files, self._files = self._files, {}
        for f in files.values():
            try:
                os.close(f.fd)
            except OSError:
                pass
