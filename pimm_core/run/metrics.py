"""``metrics.jsonl``: one JSON object per logged step or evaluation, its writer and reader (torch-free).

Records carry ``step`` (global step), ``epoch``, ``iter`` (micro-batch in the epoch),
``split`` (``train``/``val``), ``time`` (UNIX seconds, added by the writer) plus metric
values (``loss``, ``lr``, ``samples_per_s``, ``acc``...). A value may be ``NaN`` or
``Infinity`` (Python's json writes them). Only rank 0 writes; a crash can leave a last
line without its newline, which readers skip. The console's incremental reader is
:class:`pimm_core.watch.metrics.MetricsTail`; it parses lines with :func:`parse_record`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


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
