"""sha256 of checkpoint files computed while they are being written (torch-free).

The manifest records the sha256 of every file of a checkpoint. Hashing after the
write re-reads every byte on the save's critical path (~0.8 s per GiB on one core
here, as long as the write itself). :class:`FollowingHasher` instead tails the files
on a second thread as the writers append to them, so the hash is ready about when the
write is, the way a pipelined ``tee | sha256sum`` would be.

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

CHUNK = 8 << 20
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


class FollowingHasher:
    """Hash the files under ``root`` accepted by ``match`` while they are written.

    Usage: :meth:`start` before the writers begin, :meth:`finish` after every writer has
    closed its file (it drains what is left and returns the hashes); :meth:`close` on any
    path that does not call :meth:`finish`.

    Args:
        root: directory the files appear in (searched recursively).
        match: called with the path relative to ``root`` (POSIX); True to follow it.
        on_written: called on the hashing thread, at least once per ``STEP`` bytes hashed
            of each file and whenever the files grew, with the bytes written so far to the
            followed files together (the previous checkpoint's pages are released in step
            with it: :class:`~pimm_core.fsio.PageRelease`).
    """

    def __init__(self, root: Path, match: Callable[[str], bool],
                 on_written: Callable[[int], None] | None = None) -> None:
        self.root = Path(root)
        self.match = match
        self.on_written = on_written
        self._files: dict[str, _Followed] = {}
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._buf = bytearray(CHUNK)
        self._thread = threading.Thread(target=self._run, name="pimm-sha256", daemon=True)

    def start(self) -> FollowingHasher:
        self._thread.start()
        return self

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
            n = os.preadv(f.fd, [view[:min(CHUNK, end - f.pos)]], f.pos)
            if n <= 0:
                break
            f.sha.update(view[:n])  # hashlib releases the GIL for large updates
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
                if self.on_written is not None:
                    self.on_written(sum(f.size for f in self._files.values()))
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
            hashed whole, keyed by inode so a file renamed since (a temporary name moved
            into place) is still recognized. Empty if the thread failed.
        """
        self._done.set()
        self._thread.join()
        out: dict[tuple[int, int], dict[str, Any]] = {}
        try:
            if self._error is None:
                for f in self._files.values():
                    st = os.fstat(f.fd)
                    if not f.broken and st.st_size == f.pos:
                        out[(st.st_dev, st.st_ino)] = {"size": f.pos, "sha256": f.sha.hexdigest()}
        finally:
            self.close()
        return out

    def close(self) -> None:
        """Stop following and close every file (idempotent)."""
        self._done.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        files, self._files = self._files, {}
        for f in files.values():
            try:
                os.close(f.fd)
            except OSError:
                pass
