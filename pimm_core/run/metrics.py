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
import time
from pathlib import Path
from typing import Any

from ..fsio import atomic_write_bytes, fsync_file
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


def parse_record(line: bytes | str) -> dict[str, Any] | None:
    """One line of ``metrics.jsonl`` as its record, or None when it is not a JSON object (damaged)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl``, in file order; lines that do not parse (damaged, or
    a last line cut short by a crash) are skipped; a missing file has none."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return []
    return [rec for line in data.splitlines() if (rec := parse_record(line)) is not None]


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
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    keep: list[bytes] = []
    moved: list[bytes] = []
    for line in data.splitlines():
        if line.strip():
            (moved if superseded(parse_record(line), step, eval_done) else keep).append(line)
    if not moved:
        return 0
    aside = path.with_name(SUPERSEDED)
    with open_append(aside) as f:
        f.write(b"\n".join(moved).decode("utf-8", "replace") + "\n")
        f.flush()
    fsync_file(aside)
    atomic_write_bytes(path, b"".join(line + b"\n" for line in keep))
    return len(moved)
