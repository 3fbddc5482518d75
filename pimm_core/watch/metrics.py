"""``metrics.jsonl`` read incrementally for a watcher: plot series, rate, evaluations, non-finite values (torch-free).

A large file is opened from its tail plus an evenly spaced sample of the earlier lines
(so a million-line log opens in milliseconds); evaluation records are found by a byte
scan. A truncated last line waits until it is completed; corrupt lines are counted.
Memory is bounded by what the console shows, whatever the file's size: bytes are read
``chunk`` at a time, a line longer than :data:`~pimm_core.run.metrics.MAX_LINE` is
counted as damaged without being held, and of the evaluations only the newest
``max_points`` and the best value of each metric are kept.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import Any

from ..run.metrics import MAX_LINE, parse_record
from ..run.values import finite_number
from .history import NOT_METRICS, HeadResults, HeadScan, first_finite, note_finite
from .series import NonFinite, RunningBest, Series


class MetricsTail:
    """Incremental reader of ``metrics.jsonl``.

    :meth:`poll` reads only the bytes appended since the last call. The first poll of a
    file larger than ``full_read_bytes`` reads its last ``tail_bytes`` fully and samples
    ``sample_lines`` evenly spaced lines before that (the plot's early history), and
    byte-scans the earlier part for evaluation (``"val"``) records (``scan_head=False``: not
    scanned, for a reader that needs only the tail, like ``pimm runs ls``: then what it reads
    is bounded by ``tail_bytes`` plus ``sample_lines`` short reads, whatever the file's size).

    ``lazy_history=True`` (the console): the first poll reads only the tail and the sample, so
    its cost does not grow with the file; each later poll scans at most ``scan_budget`` more
    bytes of the earlier part (:mod:`.history`) until :attr:`history_pending` is None, and what it
    finds is merged as if it had been read first (the evaluations, best values and non-finite
    stretches are then what an eager open gives).

    Attributes:
        loss, lr: decimated ``(step, value)`` series of training records.
        recent: the last training records (for rate and ETA).
        last_train, last_val: the newest training / evaluation record.
        val: the newest ``max_points`` evaluation records, in file order.
        bad_lines: lines that were not JSON objects (skipped).
        pending: bytes of an unfinished last line (waiting for its newline).
        sampled: the early history was sampled, not read line by line.
        records: complete lines read (sampled lines count once).
        version: increases whenever something new was read.
        history_pending: the fraction (0..1) of the earlier part scanned so far while a lazy
            scan is under way, else None.
    """

    def __init__(self, path: Path, *, full_read_bytes: int = 8 << 20, tail_bytes: int = 2 << 20,
                 sample_lines: int = 2000, max_points: int = 2000, chunk: int = 8 << 20, scan_head: bool = True,
                 lazy_history: bool = False, scan_budget: int = 64 << 20):
        self.path = Path(path)
        self.full_read_bytes = full_read_bytes
        self.tail_bytes = tail_bytes
        self.sample_lines = sample_lines
        self.max_points = max_points
        self.chunk = chunk
        self.scan_head = scan_head
        self.lazy_history = lazy_history
        self.scan_budget = scan_budget
        self._reset()

    def _reset(self) -> None:
        self.offset = 0
        self._ident: tuple[int, int] | None = None
        self._partial = b""
        self._overlong = False  # inside a line longer than MAX_LINE: skipped up to its newline
        self.loss = Series(self.max_points)
        self.lr = Series(self.max_points)
        self.recent: deque[dict[str, Any]] = deque(maxlen=64)
        self.last_train: dict[str, Any] | None = None
        self.last_val: dict[str, Any] | None = None
        self.val: deque[dict[str, Any]] = deque(maxlen=self.max_points)
        self._best = RunningBest()
        self.bad_lines = 0
        self.sampled = False
        self.records = 0
        self.version = 0
        self.exists = False
        self.nonfinite: dict[str, NonFinite] = {}
        self._history: HeadScan | None = None  # a lazy scan of the part before the tail, under way
        self._head: HeadResults | None = None

    @property
    def pending(self) -> int:
        return len(self._partial)

    @property
    def history_pending(self) -> float | None:
        return None if self._history is None else self._history.fraction

    def _take(self, rec: dict[str, Any], *, sampled: bool = False, odd: bool = True) -> None:
        """Apply one record; ``odd=False``: its line has no ``NaN``/``Infinity`` token (skip the check
        for non-finite values unless one was seen before: then finite values say where it recovered)."""
        split = rec.get("split", "train")
        step = finite_number(rec.get("step"))
        if split == "train":
            if step is not None:
                # Non-finite values are not plotted: :attr:`nonfinite` says where they are.
                loss, lr = finite_number(rec.get("loss")), finite_number(rec.get("lr"))
                if loss is not None:
                    self.loss.add(step, loss)
                if lr is not None:
                    self.lr.add(step, lr)
            if not sampled:
                self.last_train = rec
                self.recent.append(rec)
        elif split == "val" and not sampled:
            self.val.append(rec)
            self._best.add(rec, NOT_METRICS)
            self.last_val = rec
        if not sampled and split in ("train", "val") and (odd or self.nonfinite):
            self._check_finite(rec, split, step)

    def _check_finite(self, rec: dict[str, Any], split: str, step: float | None) -> None:
        """Note NaN/+-Inf values of ``rec`` in :attr:`nonfinite` (and finite ones after them)."""
        note_finite(self.nonfinite, rec, split, step)

    def _parse_lines(self, data: bytes) -> None:
        for line in data.split(b"\n"):
            if not line.strip():
                continue
            rec = parse_record(line)
            if rec is None:
                self.bad_lines += 1
                continue
            self.records += 1
            self._take(rec, odd=b"NaN" in line or b"Infinity" in line)

    def _open_large(self, f: Any, size: int, start: int = 0) -> None:
        """A large read (the first of a large file, or a large append from ``start``, a line
        start): sampled history + val scan of the head, full tail."""
        head_end = max(start, size - self.tail_bytes)
        f.seek(head_end)
        tail = f.read(size - head_end)
        if head_end > start:
            nl = tail.find(b"\n")
            cut = nl + 1 if nl >= 0 else len(tail)
            head_end += cut
            tail = tail[cut:]
        # Evenly spaced sample of the head: the first whole line after each probe offset.
        probes = min(self.sample_lines, max(1, (head_end - start) // 64))
        last_start = -1
        for i in range(probes):
            pos = start + (head_end - start) * i // probes
            f.seek(max(0, pos - 1))
            buf = f.read(4096)
            if pos > start:
                nl = buf.find(b"\n")
                if nl < 0:
                    continue
                at, buf = pos + nl, buf[nl + 1:]
            else:
                at = start
            if at <= last_start or at >= head_end:
                continue
            last_start = at
            end = buf.find(b"\n")
            if end < 0:
                continue
            rec = parse_record(buf[:end])
            if rec is not None and rec.get("split", "train") == "train":
                self._take(rec, sampled=True)
                self.last_train = rec  # the newest known, until the tail has one
        # Every evaluation record (and training record with NaN/Infinity) in the head, by a byte
        # scan: now, or (lazy, on a first open) a slice per later poll.
        if self.scan_head:
            scan = HeadScan(start, head_end, self.chunk)
            if self.lazy_history and start == 0:
                self._history, self._head = scan, HeadResults(self.max_points)
            else:
                scan.run(f, None, self._odd_train, self._val_record)
        self.sampled = True
        self._consume(tail)

    def _odd_train(self, rec: dict[str, Any]) -> None:
        self._check_finite(rec, "train", finite_number(rec.get("step")))

    def _val_record(self, rec: dict[str, Any]) -> None:
        self._take(rec)
        self.records += 1

    def _advance_history(self) -> bool:
        """Scan the next ``scan_budget`` bytes of a lazy scan; merge its results once it ends."""
        scan, head = self._history, self._head
        if scan is None or head is None:
            return False
        try:
            with open(self.path, "rb") as f:
                done = scan.run(f, self.scan_budget, head.odd_train, head.add_val)
        except OSError:
            return False
        if done:
            head.merge_into(self, lambda keys: first_finite(self.path, keys, scan.end, self.offset))
            self._history, self._head = None, None
        return True

    def _consume(self, data: bytes) -> None:
        if self._overlong:
            nl = data.find(b"\n")
            if nl < 0:
                return
            data, self._overlong = data[nl + 1:], False
        data = self._partial + data
        nl = data.rfind(b"\n")
        if nl < 0:
            self._partial = data
        else:
            self._partial = data[nl + 1:]
            self._parse_lines(data[:nl])
        if len(self._partial) > MAX_LINE:  # too long to be a record: damaged, not held
            self._partial, self._overlong = b"", True
            self.bad_lines += 1

    def poll(self) -> bool:
        """Read what was appended since the last poll. Returns True when something new was read.

        A file that shrank or was replaced (a fresh start rewrites it) is read again from
        the beginning. A missing file is not an error (``exists`` is False).
        """
        try:
            st = os.stat(self.path)
        except OSError:
            if self.exists:
                self._reset()
                self.version += 1
                return True
            return False
        ident = (st.st_dev, st.st_ino)
        if self._ident is not None and (ident != self._ident or st.st_size < self.offset):
            self._reset()
        self._ident = ident
        self.exists = True
        if st.st_size == self.offset:
            if self._advance_history():
                self.version += 1
                return True
            return False
        lazy_now = self._history is not None
        try:
            with open(self.path, "rb") as f:
                self._read(f, st.st_size)
        except OSError:
            return False
        if lazy_now:  # (not on the poll that started it: that one is the first paint)
            self._advance_history()
        self.version += 1
        return True

    def _read(self, f: Any, size: int) -> None:
        """Read ``[offset, size)``: sampled when large (the first read, or an append of more
        than ``full_read_bytes``: the line in progress is finished, then the rest is opened
        as :meth:`_open_large` opens a file), else ``chunk`` bytes at a time."""
        f.seek(self.offset)
        while (self._partial or self._overlong) and size - self.offset > self.full_read_bytes:
            block = f.read(min(self.chunk, size - self.offset))
            if not block:
                return
            nl = block.find(b"\n")
            if nl >= 0:
                block = block[:nl + 1]
                f.seek(self.offset + len(block))
            self.offset += len(block)
            self._consume(block)
        if size - self.offset > self.full_read_bytes:
            self._open_large(f, size, self.offset)
            self.offset = size
            return
        while self.offset < size:
            data = f.read(min(self.chunk, size - self.offset))
            if not data:
                break
            self.offset += len(data)
            self._consume(data)

    # ------------------------------------------------------------ summaries
    def rate(self) -> tuple[float | None, float | None]:
        """``(steps_per_s, samples_per_s)`` of the newest training record: both of training time
        (:mod:`pimm_core.train.rate`: evaluation and saving left out); a record without
        ``steps_per_s`` (a run of an earlier pimm) gets it from the wall-clock :meth:`wall_steps_per_s`."""
        last = self.last_train or {}
        steps = finite_number(last.get("steps_per_s"))
        return (steps if steps is not None else self.wall_steps_per_s()), finite_number(last.get("samples_per_s"))

    def wall_steps_per_s(self) -> float | None:
        """Steps per wall-clock second over the newest training records of the current session
        (evaluation and saving included: what an ETA needs)."""
        recs = [r for r in self.recent if finite_number(r.get("time")) is not None and finite_number(r.get("step")) is not None]
        if len(recs) < 2:
            return None
        # Walk back while steps and times increase (a resume or a long pause breaks the window).
        j = len(recs) - 1
        while j > 0 and recs[j - 1]["step"] < recs[j]["step"] and 0 < recs[j]["time"] - recs[j - 1]["time"] < 600:
            j -= 1
            if len(recs) - j > 20:
                break
        a, b = recs[j], recs[-1]
        dt, ds = b["time"] - a["time"], b["step"] - a["step"]
        return ds / dt if dt > 0 and ds > 0 else None

    def log_interval(self) -> float | None:
        """Median seconds between the newest training records (how often the heartbeat comes)."""
        times = [finite_number(r.get("time")) for r in self.recent]
        times = [t for t in times if t is not None]
        gaps = sorted(b - a for a, b in zip(times, times[1:]) if b > a)
        return gaps[len(gaps) // 2] if gaps else None

    def best_val(self, metric: str, mode: str) -> dict[str, Any] | None:
        """The best evaluation record for ``metric`` (``val/acc`` reads the record's ``acc``);
        NaN and +-Inf values are never best."""
        key = metric.split("/", 1)[1] if "/" in metric else metric
        return self._best.best(key, mode)

