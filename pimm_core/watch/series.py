"""What a watcher keeps of a metric: a decimated plot series, and where a metric stopped being finite (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..run.values import finite_number
from .fmt import fmt_value


class Series:
    """A decimated ``(x, y)`` series: at most ``max_points`` kept, evenly thinned as it grows."""

    def __init__(self, max_points: int = 2000):
        self.max_points = max(16, max_points)
        self.xs: list[float] = []
        self.ys: list[float] = []
        self.stride = 1
        self._seen = 0
        self.last: tuple[float, float] | None = None

    def add(self, x: float, y: float) -> None:
        """Add a point; a non-finite ``x`` or ``y`` is ignored (see :class:`NonFinite`)."""
        if not (math.isfinite(x) and math.isfinite(y)):
            return
        self.last = (x, y)
        if self._seen % self.stride == 0:
            self.xs.append(x)
            self.ys.append(y)
            if len(self.xs) > self.max_points:
                self.xs, self.ys = self.xs[::2], self.ys[::2]
                self.stride *= 2
        self._seen += 1

    def points(self) -> tuple[list[float], list[float]]:
        """Copies of the kept points, with the newest point appended if it was thinned out."""
        xs, ys = list(self.xs), list(self.ys)
        if self.last is not None and (not xs or xs[-1] != self.last[0]):
            xs.append(self.last[0])
            ys.append(self.last[1])
        return xs, ys

    def __len__(self) -> int:
        return len(self.xs)



def _step_text(step: float | None) -> str:
    return "?" if step is None else str(int(step))



@dataclass
class NonFinite:
    """Where one logged metric stopped being finite (NaN, +Inf or -Inf in ``metrics.jsonl``).

    Attributes:
        key: ``loss``, ``lr``, ... for training records; ``val/<name>`` for evaluation ones.
        first_step, last_step: global steps of the first and newest non-finite value.
        count: non-finite values seen.
        last_value: the newest non-finite value (NaN, inf or -inf).
        finite_again: the global step from which the metric has been finite again since
            ``last_step`` (None: it is still not finite).
    """

    key: str
    first_step: float | None = None
    last_step: float | None = None
    count: int = 0
    last_value: float = math.nan
    finite_again: float | None = None

    def seen(self, step: float | None, value: float) -> None:
        self.count += 1
        self.last_value = value
        if step is not None:
            if self.first_step is None or step < self.first_step:
                self.first_step = step
            if self.last_step is None or step >= self.last_step:
                self.last_step = step
                self.finite_again = None
        else:
            self.finite_again = None

    def finite(self, step: float | None) -> None:
        if step is None or self.last_step is None or step <= self.last_step:
            return
        if self.finite_again is None or step < self.finite_again:
            self.finite_again = step

    @property
    def recovered(self) -> bool:
        return self.finite_again is not None

    def note(self) -> str:
        """One line: ``loss not finite from step 2 (NaN at step 3)``."""
        first, last = _step_text(self.first_step), _step_text(self.last_step)
        if self.recovered:
            span = f"step {first}" if first == last else f"steps {first}-{last}"
            return (f"{self.key} was not finite at {span} ({self.count} value{'s' * (self.count != 1)}); "
                    f"finite again from step {_step_text(self.finite_again)}")
        if self.count == 1 or first == last:
            return f"{self.key} not finite from step {first} ({fmt_value(self.last_value)})"
        return f"{self.key} not finite from step {first} ({fmt_value(self.last_value)} at step {last})"

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "first_step": self.first_step, "last_step": self.last_step, "count": self.count,
                "last_value": fmt_value(self.last_value), "finite_again": self.finite_again}


class RunningBest:
    """The best record of each metric seen so far, both ways (max and min), kept as records
    arrive: memory is one entry per metric name (at most ``max_names``), not per record.
    NaN and +-Inf are never best; on a tie the earlier record stays."""

    def __init__(self, max_names: int = 256):
        self.max_names = max_names
        self._best: dict[str, list[tuple[float, dict[str, Any]]]] = {}

    def add(self, rec: dict[str, Any], skip: frozenset[str] = frozenset()) -> None:
        for k, v in rec.items():
            f = finite_number(v) if k not in skip else None
            if f is None:
                continue
            best = self._best.get(k)
            if best is None:
                if len(self._best) < self.max_names:
                    self._best[k] = [(f, rec), (f, rec)]
                continue
            if f > best[0][0]:
                best[0] = (f, rec)
            if f < best[1][0]:
                best[1] = (f, rec)

    def then(self, later: RunningBest) -> RunningBest:
        """This one with the records ``later`` saw after them added (a tie keeps this one's); returns self."""
        for key, (hi, lo) in later._best.items():
            mine = self._best.get(key)
            if mine is None:
                if len(self._best) < self.max_names:
                    self._best[key] = [hi, lo]
                continue
            if hi[0] > mine[0][0]:
                mine[0] = hi
            if lo[0] < mine[1][0]:
                mine[1] = lo
        return self

    def best(self, key: str, mode: str) -> dict[str, Any] | None:
        """The record with the highest (``mode="max"``) or lowest value of ``key``, or None."""
        best = self._best.get(key)
        return None if best is None else best[0 if mode == "max" else 1][1]
