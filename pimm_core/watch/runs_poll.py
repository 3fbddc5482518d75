"""The runs table, read again and again for a live view (torch-free): :func:`~.runs.summarize`
of each run under a root, skipping the runs whose files did not change.

A finished, stopped or failed run whose ``status.json``, ``metrics.jsonl`` and ``model/``
are unchanged keeps its row (only its age moves on), so a root of hundreds of finished runs
costs a few ``stat`` calls per poll; a run in a live state (``live``, ``starting``,
``stopping``) is summarized on every poll because whether it turned stale depends on the
clock, not on its files.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from ..run.layout import METRICS, MODEL
from .runs import RunRow, find_runs, summarize

#: States whose row is read again on every poll: a live state turns stale with the clock alone
#: (a stale, finished or unreadable run changes only when its files do).
_MOVING = frozenset({"live", "restarting", "starting", "stopping"})


def _stamp(run_dir: Path) -> tuple[tuple[int, int] | None, ...]:
    """``(mtime_ns, size)`` of the files a row is read from (None for a missing one)."""
    out = []
    for name in ("status.json", METRICS, MODEL, f"{MODEL}/model_best.pth.json"):
        try:
            st = os.stat(run_dir / name)
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


class RunsPoller:
    """The rows of every run under ``root`` (:func:`~.runs.find_runs`), re-read cheaply.

    Attributes:
        root: the directory listed (a run root, a group, or one run).
        rows: the newest rows, in :func:`~.runs.find_runs` order (by path).
        summarized: how many runs the last :meth:`poll` read again (the others were unchanged).
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.rows: list[RunRow] = []
        self.summarized = 0
        self._cache: dict[Path, tuple[tuple, float, RunRow]] = {}

    def poll(self, *, now: float | None = None) -> list[RunRow]:
        """Find the runs again and return their rows (never raises for damaged runs)."""
        now = time.time() if now is None else now
        rows: list[RunRow] = []
        cache: dict[Path, tuple[tuple, float, RunRow]] = {}
        self.summarized = 0
        for path in find_runs(self.root):
            stamp = _stamp(path)
            old = self._cache.get(path)
            if old is not None and old[0] == stamp and old[2].state not in _MOVING:
                _, then, row = old
                if row.age_s is not None:  # the same row, older by the time since it was read
                    row = dataclasses.replace(row, age_s=round(row.age_s + (now - then), 1))
                cache[path] = (stamp, now, row)
            else:
                row = summarize(path, self.root, now=now)
                self.summarized += 1
                cache[path] = (stamp, now, row)
            rows.append(row)
        self._cache = cache
        self.rows = rows
        return rows
