"""``metrics.jsonl``: one JSON object per logged step or evaluation, its writer and reader (torch-free).

Records carry ``step`` (global step), ``epoch``, ``iter`` (micro-batch in the epoch),
``split`` (``train``/``val``), ``time`` (UNIX seconds, added by the writer) plus metric
values (``loss``, ``lr``, ``samples_per_s``, ``acc``...). A value may be ``NaN`` or
``Infinity`` (Python's json writes them). Only rank 0 writes; a crash can leave a last
line without its newline, which readers skip. The console's incremental reader is
:class:`pimm_core.watch.metrics.MetricsTail`; it parses lines with :func:`parse_record`.

After a resume each step is in the file once: :func:`supersede_after` moves the records
the interrupted run wrote after the resumed position to ``metrics.superseded.jsonl``
(appended, never deleted) before the resumed run appends its own.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..fsio import atomic_write, fsync_file
from .layout import SUPERSEDED


class MetricsWriter:
    """Append-only ``metrics.jsonl``; each record is one line, flushed at once."""

    def __init__(self, path: Path):
        """Raises: RunEntryError: ``path`` is a link or not a regular file (:func:`~.entries.open_append`)."""
        from .entries import open_append

        self._f = open_append(path)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` plus ``time`` (UNIX seconds, 3 decimals)."""
        self._f.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


#: Longest line a reader parses (bytes); a longer one is damaged, skipped without being held in memory.
MAX_LINE = 1 << 20


def parse_record(line: bytes | str) -> dict[str, Any] | None:
    """One line of ``metrics.jsonl`` as its record, or None when it is not a JSON object
    (damaged, or nested too deeply for the parser)."""
    if len(line) > MAX_LINE:
        return None
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) else None


def iter_metrics(path: Path, *, block: int = 1 << 20) -> Iterator[dict[str, Any] | None]:
    """The records of a ``metrics.jsonl`` in file order, read ``block`` bytes at a time
    (memory: one block plus one line of at most :data:`MAX_LINE`).

    Yields:
        Each complete line's record, or None for a damaged line (not a JSON object, nested
        too deeply, or longer than :data:`MAX_LINE`). A last line without its newline (a
        write cut short) is not yielded; a missing or unreadable file yields nothing.
    """
    try:
        f = open(path, "rb")
    except OSError:
        return
    with f:
        carry, oversize = b"", False
        while data := f.read(block):
            parts = (carry + data).split(b"\n")
            carry = parts.pop()
            for line in parts:
                if oversize:
                    oversize = False
                    yield None
                elif line.strip():
                    yield parse_record(line)
            if len(carry) > MAX_LINE:
                carry, oversize = b"", True


def records_from_end(path: Path, *, block: int = 1 << 20) -> Iterator[dict[str, Any] | None]:
    """The records of a ``metrics.jsonl``, newest first, read backwards ``block`` bytes at a
    time: a reader that needs the latest records stops early, and memory is one block plus
    one line of at most :data:`MAX_LINE`, whatever the file's size.

    Yields:
        As :func:`iter_metrics`, in reverse order.
    """
    try:
        f = open(path, "rb")
    except OSError:
        return
    with f:
        pos = f.seek(0, os.SEEK_END)
        carry, oversize, unfinished = b"", False, True
        while pos > 0:
            n = min(block, pos)
            pos -= n
            f.seek(pos)
            parts = (f.read(n) + carry).split(b"\n")
            carry = parts[0]  # the start of this line may be in the block before
            for line in reversed(parts[1:]):
                if unfinished:  # after the last newline: a line still being written (or b"")
                    unfinished = oversize = False
                elif oversize:
                    oversize = False
                    yield None
                elif line.strip():
                    yield parse_record(line)
            if len(carry) > MAX_LINE:
                carry, oversize = b"", True
        if not unfinished and (oversize or carry.strip()):
            yield None if oversize else parse_record(carry)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl``, in file order (:func:`iter_metrics`: damaged lines
    and a last line cut short by a crash are skipped); a missing file has none. Memory grows
    with the file: a reader that shows part of it iterates instead."""
    return [rec for rec in iter_metrics(path) if rec is not None]


def superseded(rec: dict[str, Any] | None, step: int, eval_done: bool) -> bool:
    """Whether a record of an interrupted run is replaced by a run resumed at global step ``step``.

    Records after ``step`` are; an evaluation record at ``step`` is too unless the checkpoint
    holds that evaluation (``eval_done``: the resumed run does not evaluate it again). A line
    that is not a record (damaged, or cut short by the crash) is superseded.
    """
    if rec is None:
        return True
    at = rec.get("step")
    if not isinstance(at, (int, float)) or isinstance(at, bool):
        return False
    return at > step or (at == step and rec.get("split", "train") != "train" and not eval_done)


def _any_superseded(path: Path, step: int, eval_done: bool) -> bool:
    """Whether ``path`` holds a record :func:`superseded` by a resume at ``step``: read from the end
    (records are in step order) and stopped at the first record before ``step``."""
    for rec in records_from_end(path):
        if superseded(rec, step, eval_done):
            return True
        at = rec.get("step") if rec is not None else None
        if isinstance(at, (int, float)) and not isinstance(at, bool) and at < step:
            return False
    return False


def supersede_after(path: Path, step: int, *, eval_done: bool) -> int:
    """Move the records of ``path`` (a ``metrics.jsonl``) that a run resumed at ``step`` replaces
    (:func:`superseded`) to :data:`SUPERSEDED` beside it, keeping the others in order.

    The moved lines are appended there and synced first, then ``path`` is replaced atomically:
    a crash in between leaves them in both files, never in neither.

    Returns:
        The number of lines moved (0: nothing was rewritten).

    Raises:
        RunEntryError: ``metrics.superseded.jsonl`` is a link or not a regular file.
        OSError: the write failed (``path`` is then unchanged).
    """
    from .entries import open_append

    path = Path(path)
    if not _any_superseded(path, step, eval_done):
        return 0  # (the usual resume: nothing after the checkpoint; the file is not rewritten)
    aside = path.with_name(SUPERSEDED)
    moved = 0

    def split(tmp: Path) -> None:  # streamed: memory is one line, whatever the file's size
        nonlocal moved
        out = None
        with open(path, "rb") as src, open(tmp, "wb") as keep:
            for line in src:
                if not line.strip():
                    continue
                if superseded(parse_record(line), step, eval_done):
                    out = out or open_append(aside)
                    out.write(line.rstrip(b"\n").decode("utf-8", "replace") + "\n")
                    moved += 1
                else:
                    keep.write(line if line.endswith(b"\n") else line + b"\n")
        if out is not None:
            out.flush()
            out.close()
            fsync_file(aside)  # the moved lines are safe aside before the file loses them

    atomic_write(path, split, points=None)
    return moved
