"""``train.log``: rank 0's log, its writer (a logging handler) and an incremental reader (torch-free)."""

from __future__ import annotations

import logging
import os
from collections import deque
from pathlib import Path

from .entries import open_append
from .layout import LOG

#: One line per record: ``2026-11-29 12:00:00,123 INFO message``.
LOG_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(message)s")


class _LogFileHandler(logging.FileHandler):
    """``logging.FileHandler`` that opens its file with :func:`~pimm_core.run.entries.open_append`
    (never through a symbolic link)."""

    def _open(self):  # noqa: D102 - logging's hook for opening the stream
        return open_append(Path(self.baseFilename))


def log_handler(run_dir: Path) -> logging.FileHandler:
    """A handler appending to ``run_dir/train.log`` in :data:`LOG_FORMAT` (the caller adds and removes it).

    Raises:
        RunEntryError: ``train.log`` is a link or not a regular file, or the directory is read-only.
        OSError: the file cannot be opened.
    """
    handler = _LogFileHandler(Path(run_dir) / LOG)
    handler.setFormatter(LOG_FORMAT)
    return handler


class LogTail:
    """The last ``keep`` lines of a text log, read incrementally (first read: the last ``tail_bytes``).

    Memory is bounded by what it shows, whatever the file's size: a poll reads at most the
    last ``tail_bytes`` of what was appended, and a line longer than ``tail_bytes`` is kept
    as its first ``tail_bytes`` followed by `` [...]`` (a line whose start was skipped
    begins with ``[...] ``).

    Attributes:
        lines: the newest complete lines (an unfinished last line waits for its newline).
        version: increases whenever new lines were read.
    """

    def __init__(self, path: Path, keep: int = 200, tail_bytes: int = 32 << 10):
        self.path = Path(path)
        self.keep = keep
        self.tail_bytes = tail_bytes
        self.lines: deque[str] = deque(maxlen=keep)
        self.offset = 0
        self._partial = b""
        self._overlong = False  # the line in progress was cut at tail_bytes: the rest is skipped
        self._ident: tuple[int, int] | None = None
        self.version = 0

    def poll(self) -> bool:
        """Read what was appended since the last poll; True when new lines came. A file that
        shrank or was replaced is read again from its tail; a missing one is not an error."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        ident = (st.st_dev, st.st_ino)
        if self._ident is not None and (ident != self._ident or st.st_size < self.offset):
            self.lines.clear()
            self.offset, self._partial, self._overlong = 0, b"", False
        self._ident = ident
        if st.st_size == self.offset:
            return False
        start, skipped = self.offset, False
        if st.st_size - start > self.tail_bytes:  # only the last tail_bytes can be shown
            start, skipped = st.st_size - self.tail_bytes, True
            self._partial, self._overlong = b"", False
        try:
            with open(self.path, "rb") as f:
                f.seek(start - 1 if skipped else start)  # skipped: the byte before says if a line starts
                data = f.read(st.st_size - f.tell())
        except OSError:
            return False
        self.offset = start + len(data) - skipped
        if skipped:  # the first line may be cut: kept, marked as cut
            data = data[1:] if data[:1] == b"\n" else b"[...] " + data[1:]
        if self._overlong:
            nl = data.find(b"\n")
            if nl < 0:
                return False
            # the rest of a cut line is skipped; its kept start (if any) ends at this newline
            data, self._overlong = (data[nl:] if self._partial else data[nl + 1:]), False
        data = self._partial + data
        nl = data.rfind(b"\n")
        self._partial = data[nl + 1:]
        if len(self._partial) > self.tail_bytes:
            self._partial, self._overlong = self._partial[:self.tail_bytes] + b" [...]", True
        if nl < 0:
            return False
        for line in data[:nl].decode("utf-8", "replace").splitlines():
            self.lines.append(line)
        self.version += 1
        return True
