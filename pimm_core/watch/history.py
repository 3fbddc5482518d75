"""The early part of a large ``metrics.jsonl``: evaluations and non-finite values found by a byte scan (torch-free).

A watcher opens a large file from its tail (and an evenly spaced sample of the rest, for the
plots); what the tail cannot say (every evaluation, where a metric stopped being finite) is
in the part before it. :class:`HeadScan` finds those records by a byte scan (lines without
``"val"``, ``NaN`` or ``Infinity`` are never parsed), ``budget`` bytes per call, so a
console can draw its first frame from the tail and read the rest a slice per poll
(:class:`HeadResults` holds what was found until the scan ends, then is merged as if it had
been read first).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable

from ..run.metrics import MAX_LINE, parse_record
from ..run.values import finite_number, json_number
from .series import NonFinite, RunningBest

#: Record fields that are bookkeeping, not metric values.
NOT_METRICS = frozenset(("step", "epoch", "iter", "split", "time"))

Record = dict[str, Any]


def lines_holding(body: bytes, token: bytes, begin: int = 0, stop: int | None = None):
    """``(offset, record)`` for each whole line of ``body[begin:stop]`` (which ends with a
    newline) that contains ``token`` and parses as a JSON object (byte scan: lines without
    the token are never parsed; nothing is copied but the lines parsed)."""
    stop = len(body) if stop is None else stop
    i = body.find(token, begin, stop)
    while i >= 0:
        start = body.rfind(b"\n", begin, i) + 1 or begin
        end = body.find(b"\n", i, stop)
        end = stop if end < 0 else end
        rec = parse_record(body[start:end])
        if rec is not None:
            yield start, rec
        i = body.find(token, end, stop)


def note_finite(into: dict[str, NonFinite], rec: Record, split: str, step: float | None) -> None:
    """Note NaN/+-Inf values of ``rec`` in ``into`` (key ``loss``; ``val/<name>`` for an
    evaluation), and finite ones after them."""
    prefix = "" if split == "train" else f"{split}/"
    for k, v in rec.items():
        if k in NOT_METRICS:
            continue
        f = json_number(v)
        if f is None:
            continue
        if math.isfinite(f):
            nf = into.get(prefix + k)
            if nf is not None:
                nf.finite(step)
        else:
            into.setdefault(prefix + k, NonFinite(prefix + k)).seen(step, f)


class HeadScan:
    """Byte scan of ``[start, end)`` of a ``metrics.jsonl`` (``end`` at a line start), resumable.

    Each :meth:`run` reads ``chunk`` bytes at a time from where the last one stopped; a line
    longer than :data:`~pimm_core.run.metrics.MAX_LINE` is dropped up to its newline.
    """

    def __init__(self, start: int, end: int, chunk: int):
        self.start, self.pos, self.end, self.chunk = start, start, end, chunk
        self._carry, self._skip = b"", False

    @property
    def done(self) -> bool:
        return self.pos >= self.end

    @property
    def fraction(self) -> float:
        """How much of the range was scanned (0..1)."""
        return 1.0 if self.end <= self.start else (self.pos - self.start) / (self.end - self.start)

    def run(self, f: Any, budget: int | None, odd_train: Callable[[Record], None],
            val: Callable[[Record], None]) -> bool:
        """Scan at most ``budget`` more bytes (None: to the end) of the open file ``f``: each
        training record holding ``NaN`` or ``Infinity`` goes to ``odd_train`` and each
        evaluation record to ``val``, in file order. Returns :attr:`done`."""
        limit = self.end if budget is None else min(self.end, self.pos + budget)
        f.seek(self.pos)
        while self.pos < limit:
            n = min(self.chunk, limit - self.pos)
            data = self._carry + f.read(n)  # (no second copy of the chunk: lines are found in place)
            self.pos += n
            begin = 0
            if self._skip:
                nl = data.find(b"\n")
                begin, self._skip = (len(data), True) if nl < 0 else (nl + 1, False)
            stop = data.rfind(b"\n", begin) + 1
            self._carry = data[max(stop, begin):]
            if len(self._carry) > MAX_LINE:
                self._carry, self._skip = b"", True
            # Training records with NaN/Infinity (the sample may have missed them), in file order.
            odd = {at: rec for token in (b"NaN", b"Infinity") for at, rec in lines_holding(data, token, begin, stop)
                   if rec.get("split", "train") == "train"}
            for _, rec in sorted(odd.items()):
                odd_train(rec)
            for _, rec in lines_holding(data, b'"val"', begin, stop):
                if rec.get("split") == "val":
                    val(rec)
            del data
        return self.done


class HeadResults:
    """What a :class:`HeadScan` found, kept apart from the tail read meanwhile, then merged
    into the reader (:meth:`merge_into`) with the result of a reader that scanned first."""

    def __init__(self, max_points: int):
        self.val: deque[Record] = deque(maxlen=max_points)
        self.best = RunningBest()
        self.nonfinite: dict[str, NonFinite] = {}
        self.records = 0

    def odd_train(self, rec: Record) -> None:
        note_finite(self.nonfinite, rec, "train", finite_number(rec.get("step")))

    def add_val(self, rec: Record) -> None:
        self.val.append(rec)
        self.best.add(rec, NOT_METRICS)
        note_finite(self.nonfinite, rec, "val", finite_number(rec.get("step")))
        self.records += 1

    def merge_into(self, tail: Any, first_finite: Callable[[dict[str, float]], dict[str, float]]) -> None:
        """Put these earlier records before what ``tail`` (a
        :class:`~pimm_core.watch.metrics.MetricsTail`) read after them: evaluations first, the
        best of each metric (an earlier one wins a tie), non-finite stretches joined (a stretch
        that ended here recovers at the first finite value read later: ``first_finite`` of
        ``{metric: its last non-finite step}`` gives those steps)."""
        waiting = {key: h.last_step for key, h in self.nonfinite.items()
                   if key not in tail.nonfinite and h.finite_again is None and h.last_step is not None}
        again_at = first_finite(waiting) if waiting else {}
        tail.val = deque([*self.val, *tail.val], maxlen=tail.val.maxlen)
        if tail.last_val is None and self.val:
            tail.last_val = self.val[-1]
        tail._best = self.best.then(tail._best)
        merged: dict[str, NonFinite] = {}
        for key, h in self.nonfinite.items():
            t = tail.nonfinite.get(key)
            if t is not None:  # still not finite in the tail: one stretch, counted whole
                if h.first_step is not None and (t.first_step is None or h.first_step < t.first_step):
                    t.first_step = h.first_step
                t.count += h.count
                merged[key] = t
                continue
            if key in again_at:
                h.finite_again = again_at[key]
            merged[key] = h
        for key, t in tail.nonfinite.items():
            merged.setdefault(key, t)
        tail.nonfinite = merged
        tail.records += self.records


def first_finite(path: Any, keys: dict[str, float], start: int, stop: int) -> dict[str, float]:
    """For each metric of ``keys`` (name -> the step after which to look), the first step at
    which the lines of ``path`` in ``[start, stop)`` (``start`` a line start) hold it finite:
    where a metric that stopped being finite before a reader's tail recovered (read again when
    the scan of the earlier part ends, not held meanwhile)."""
    found: dict[str, float] = {}
    try:
        with open(path, "rb") as f:
            f.seek(start)
            pos = start
            while len(found) < len(keys) and pos < stop:
                line = f.readline(MAX_LINE + 1)
                if not line:
                    break
                pos += len(line)
                rec = parse_record(line) if line.endswith(b"\n") else None
                if rec is None:
                    continue
                split, step = rec.get("split", "train"), finite_number(rec.get("step"))
                prefix = "" if split == "train" else f"{split}/"
                for k, v in rec.items():
                    after = keys.get(prefix + k)
                    if after is not None and prefix + k not in found and step is not None and step > after \
                            and finite_number(v) is not None:
                        found[prefix + k] = step
    except OSError:
        pass
    return found
