"""Watching a run from outside: what the console and ``pimm checkpoints diff`` read (torch-free).

Everything here reads files of a run directory (see :mod:`pimm_core.run`) and never
imports torch or Textual, so both the CLI and the console (``pimm_tui``) use it:

- :func:`read_status`: ``status.json`` with heartbeat age, pid liveness, a pending stop
  request, and the verdict "is this run live" (:class:`StatusView`).
- :class:`MetricsTail`: ``metrics.jsonl`` read incrementally by byte offset. A large
  file is opened from its tail plus an evenly spaced sample of the earlier lines (so
  a million-line log opens in milliseconds); evaluation records are found by a byte
  scan. A truncated last line waits until it is completed; corrupt lines are counted.
- :class:`LogTail`: the last lines of ``train.log``, incrementally.
- :class:`RunReader`: all of the above plus the checkpoint candidates, polled together
  into one immutable :class:`RunSnapshot` (for a worker thread).
- :func:`resume_diff`: what the checkpoint a resume would pick recorded vs. the planned
  resume (world size, per-rank workers, config diff, code/torch version, data
  fingerprint) and the resume-policy row of :func:`pimm_core.topology.plan_resume`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import socket
import time
import tomllib
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .checkpoint.selection import Candidate, select_resume
from .errors import CheckpointError, ConfigError, UsageError
from .run import CONFIG, LOG, METRICS, MODEL, PROVENANCE, STATUS, read_json, recorded_launch, recorded_world_size
from .stop import read_stop_file, stop_file

#: A directory is a run directory when it holds at least one of these.
RUN_MARKERS = (CONFIG, STATUS, METRICS, MODEL)
#: States in which a trainer process should be alive.
LIVE_STATES = ("starting", "running", "stopping")
#: States in which a stop request makes sense.
STOPPABLE_STATES = ("starting", "running")
#: A heartbeat older than this (or 5x the observed logging interval, if longer) is stale.
STALE_MIN_S = 30.0


# ----------------------------------------------------------------- run dir
def run_markers(path: Path) -> list[str]:
    """The :data:`RUN_MARKERS` present in ``path``."""
    p = Path(path)
    return [m for m in RUN_MARKERS if (p / m).exists()]


def is_run_dir(path: Path) -> bool:
    """True when ``path`` is a directory holding config.toml, status.json, metrics.jsonl or model/."""
    return Path(path).is_dir() and bool(run_markers(path))


def check_run_dir(path: Path) -> Path:
    """``path`` if it is a run directory.

    Raises:
        UsageError: it does not exist, is not a directory, or has none of :data:`RUN_MARKERS`.
    """
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p} does not exist; pass a run directory such as exp/<group>/<run>")
    if not p.is_dir():
        raise UsageError(f"{p} is a file, not a run directory; pass exp/<group>/<run>")
    if not run_markers(p):
        raise UsageError(f"{p} is not a run directory (no config.toml, status.json, metrics.jsonl or model/); "
                         "pass exp/<group>/<run>")
    return p


# ------------------------------------------------------------------ status
def pid_alive(pid: Any) -> bool | None:
    """Whether process ``pid`` exists on this host (zombies count as gone); None if unknown."""
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[-1].split()[0]
        if state in (b"Z", b"X"):
            return False
    except (OSError, IndexError):
        pass
    return True


@dataclass
class StatusView:
    """``status.json`` interpreted for a watcher.

    Attributes:
        state: the recorded state (:data:`pimm_core.run.STATES`), or None when unknown.
        raw: the file's object ({} when missing or unreadable).
        problem: why the file could not be used, or None.
        heartbeat_age: seconds since the last heartbeat (None without one).
        stale: a live state whose heartbeat is older than ``stale_after``.
        pid_alive: rank 0's process exists (None: another host, or no pid recorded).
        stop_request: the pending ``control/stop`` content, or None.
        live: a trainer is believed to be running (live state, fresh heartbeat, process not gone).
        stoppable: ``live`` and in a state where a stop request makes sense.
        note: one line on why it is not live / what is odd, or None.
    """

    state: str | None
    raw: dict[str, Any]
    problem: str | None = None
    heartbeat_age: float | None = None
    stale: bool = False
    stale_after: float = STALE_MIN_S
    pid_alive: bool | None = None
    stop_request: dict[str, Any] | None = None
    live: bool = False
    stoppable: bool = False
    note: str | None = None

    @property
    def display_state(self) -> str:
        """``state``, shown as ``stopping`` while a stop request is pending on a running run."""
        if self.state is None:
            return "unknown"
        if self.state in STOPPABLE_STATES and self.stop_request is not None and self.live:
            return "stopping"
        return self.state

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "display_state": self.display_state, "problem": self.problem,
                "heartbeat_age": self.heartbeat_age, "stale": self.stale, "pid_alive": self.pid_alive,
                "stop_request": self.stop_request, "live": self.live, "stoppable": self.stoppable,
                "note": self.note}


def _status_file(run_dir: Path) -> tuple[dict[str, Any], str | None]:
    path = Path(run_dir) / STATUS
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}, "no status.json (the trainer has not started, or this is not a run it wrote)"
    except OSError as e:
        return {}, f"cannot read status.json ({e.__class__.__name__})"
    try:
        data = json.loads(text)
    except ValueError:
        return {}, "status.json is not valid JSON (damaged)"
    if not isinstance(data, dict):
        return {}, "status.json is not a JSON object (damaged)"
    return data, None


def read_status(run_dir: Path, *, now: float | None = None, stale_after: float = STALE_MIN_S) -> StatusView:
    """Read and interpret ``status.json`` (never raises for a missing or damaged file)."""
    now = time.time() if now is None else now
    raw, problem = _status_file(run_dir)
    state = raw.get("state") if isinstance(raw.get("state"), str) else None
    view = StatusView(state, raw, problem, stale_after=stale_after)
    hb = _finite(raw.get("heartbeat"))
    if hb is not None:
        view.heartbeat_age = max(0.0, now - hb)
    try:
        view.stop_request = read_stop_file(run_dir) if stop_file(run_dir).exists() else None
    except OSError:
        view.stop_request = None
    if state not in LIVE_STATES:
        return view
    host = raw.get("host")
    if host is None or host == socket.gethostname():
        view.pid_alive = pid_alive(raw.get("pid"))
    view.stale = view.heartbeat_age is None or view.heartbeat_age > stale_after
    if view.pid_alive is False:
        view.note = (f"process {raw.get('pid')} is gone but status.json says {state}: "
                     "the trainer crashed or was killed")
    elif view.stale:
        age = "no heartbeat recorded" if view.heartbeat_age is None else f"no heartbeat for {view.heartbeat_age:.0f} s"
        view.note = f"{age} (hung, or on another host that stopped)"
    else:
        view.live = True
        view.stoppable = state in STOPPABLE_STATES
    return view


# ----------------------------------------------------------------- metrics
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


def _num(v: Any) -> float | None:
    """``v`` as a float when it is a JSON number (NaN and +-Inf included), else None."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _finite(v: Any) -> float | None:
    """``v`` as a float when it is a finite number, else None (NaN and +-Inf are None)."""
    f = _num(v)
    return f if f is not None and math.isfinite(f) else None


def fmt_size(n: int | None) -> str:
    """A byte count in binary units: ``512 B``, ``1.5 KiB`` ... ``2.0 TiB``; ``-`` for None (the CLI and the console)."""
    if n is None or not math.isfinite(n):
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


def fmt_value(v: Any) -> str:
    """A logged number for a note: ``NaN``, ``inf``, ``-inf`` as Python's json writes them, else ``%g``."""
    f = _num(v)
    if f is None:
        return "-"
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return f"{f:g}"


def _step_text(step: float | None) -> str:
    return "?" if step is None else str(int(step))


#: Record fields that are bookkeeping, not metric values.
_NOT_METRICS = frozenset(("step", "epoch", "iter", "split", "time"))


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


def _lines_holding(body: bytes, token: bytes):
    """``(offset, record)`` for each whole line of ``body`` that contains ``token`` and parses
    as a JSON object (byte scan: lines without the token are never parsed)."""
    i = body.find(token)
    while i >= 0:
        start = body.rfind(b"\n", 0, i) + 1
        end = body.find(b"\n", i)
        try:
            rec = json.loads(body[start:end])
        except ValueError:
            rec = None
        if isinstance(rec, dict):
            yield start, rec
        i = body.find(token, end)


class MetricsTail:
    """Incremental reader of ``metrics.jsonl``.

    :meth:`poll` reads only the bytes appended since the last call. The first poll of a
    file larger than ``full_read_bytes`` reads its last ``tail_bytes`` fully and samples
    ``sample_lines`` evenly spaced lines before that (the plot's early history), and
    byte-scans the earlier part for evaluation (``"val"``) records.

    Attributes:
        loss, lr: decimated ``(step, value)`` series of training records.
        recent: the last training records (for rate and ETA).
        last_train, last_val: the newest training / evaluation record.
        val: every evaluation record, in file order.
        bad_lines: lines that were not JSON objects (skipped).
        pending: bytes of an unfinished last line (waiting for its newline).
        sampled: the early history was sampled, not read line by line.
        records: complete lines read (sampled lines count once).
        version: increases whenever something new was read.
    """

    def __init__(self, path: Path, *, full_read_bytes: int = 8 << 20, tail_bytes: int = 2 << 20,
                 sample_lines: int = 2000, max_points: int = 2000, chunk: int = 8 << 20):
        self.path = Path(path)
        self.full_read_bytes = full_read_bytes
        self.tail_bytes = tail_bytes
        self.sample_lines = sample_lines
        self.max_points = max_points
        self.chunk = chunk
        self._reset()

    def _reset(self) -> None:
        self.offset = 0
        self._ident: tuple[int, int] | None = None
        self._partial = b""
        self.loss = Series(self.max_points)
        self.lr = Series(self.max_points)
        self.recent: deque[dict[str, Any]] = deque(maxlen=64)
        self.last_train: dict[str, Any] | None = None
        self.last_val: dict[str, Any] | None = None
        self.val: list[dict[str, Any]] = []
        self.bad_lines = 0
        self.sampled = False
        self.records = 0
        self.version = 0
        self.exists = False
        self.nonfinite: dict[str, NonFinite] = {}

    @property
    def pending(self) -> int:
        return len(self._partial)

    def _take(self, rec: dict[str, Any], *, sampled: bool = False, odd: bool = True) -> None:
        """Apply one record; ``odd=False``: its line has no ``NaN``/``Infinity`` token (skip the check
        for non-finite values unless one was seen before: then finite values say where it recovered)."""
        split = rec.get("split", "train")
        step = _finite(rec.get("step"))
        if split == "train":
            if step is not None:
                # Non-finite values are not plotted: :attr:`nonfinite` says where they are.
                loss, lr = _finite(rec.get("loss")), _finite(rec.get("lr"))
                if loss is not None:
                    self.loss.add(step, loss)
                if lr is not None:
                    self.lr.add(step, lr)
            if not sampled:
                self.last_train = rec
                self.recent.append(rec)
        elif split == "val" and not sampled:
            self.val.append(rec)
            self.last_val = rec
        if not sampled and split in ("train", "val") and (odd or self.nonfinite):
            self._check_finite(rec, split, step)

    def _check_finite(self, rec: dict[str, Any], split: str, step: float | None) -> None:
        """Note NaN/+-Inf values of ``rec`` in :attr:`nonfinite` (and finite ones after them)."""
        prefix = "" if split == "train" else f"{split}/"
        for k, v in rec.items():
            if k in _NOT_METRICS:
                continue
            f = _num(v)
            if f is None:
                continue
            if math.isfinite(f):
                nf = self.nonfinite.get(prefix + k)
                if nf is not None:
                    nf.finite(step)
            else:
                self.nonfinite.setdefault(prefix + k, NonFinite(prefix + k)).seen(step, f)

    def _parse_lines(self, data: bytes) -> None:
        for line in data.split(b"\n"):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                self.bad_lines += 1
                continue
            if not isinstance(rec, dict):
                self.bad_lines += 1
                continue
            self.records += 1
            self._take(rec, odd=b"NaN" in line or b"Infinity" in line)

    def _open_large(self, f: Any, size: int) -> None:
        """First read of a large file: sampled history + val scan of the head, full tail."""
        head_end = max(0, size - self.tail_bytes)
        f.seek(head_end)
        tail = f.read(size - head_end)
        if head_end > 0:
            nl = tail.find(b"\n")
            cut = nl + 1 if nl >= 0 else len(tail)
            head_end += cut
            tail = tail[cut:]
        # Evenly spaced sample of the head: the first whole line after each probe offset.
        probes = min(self.sample_lines, max(1, head_end // 64))
        last_start = -1
        vals: list[tuple[int, dict[str, Any]]] = []
        for i in range(probes):
            pos = head_end * i // probes
            f.seek(max(0, pos - 1))
            buf = f.read(4096)
            if pos > 0:
                nl = buf.find(b"\n")
                if nl < 0:
                    continue
                start, buf = pos + nl, buf[nl + 1:]
            else:
                start = 0
            if start <= last_start or start >= head_end:
                continue
            last_start = start
            end = buf.find(b"\n")
            if end < 0:
                continue
            try:
                rec = json.loads(buf[:end])
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("split", "train") == "train":
                self._take(rec, sampled=True)
        # Every evaluation record in the head, by a byte scan (no JSON parse of training lines).
        f.seek(0)
        pos, carry = 0, b""
        odd: dict[int, dict[str, Any]] = {}
        while pos < head_end:
            block = f.read(min(self.chunk, head_end - pos))
            if not block:
                break
            base = pos - len(carry)
            data = carry + block
            pos += len(block)
            last_nl = data.rfind(b"\n")
            if last_nl < 0:
                carry = data
                continue
            body, carry = data[:last_nl + 1], data[last_nl + 1:]
            # Training records with NaN/Infinity (the sample may have missed them).
            for token in (b"NaN", b"Infinity"):
                for at, rec in _lines_holding(body, token):
                    if rec.get("split", "train") == "train":
                        odd[base + at] = rec
            vals += [(base + at, rec) for at, rec in _lines_holding(body, b'"val"') if rec.get("split") == "val"]
        for _, rec in sorted(odd.items()):
            self._check_finite(rec, "train", _finite(rec.get("step")))
        for _, rec in vals:
            self._take(rec)
        self.sampled = True
        self.records += len(vals)
        self._consume(tail)

    def _consume(self, data: bytes) -> None:
        data = self._partial + data
        nl = data.rfind(b"\n")
        if nl < 0:
            self._partial = data
            return
        self._partial = data[nl + 1:]
        self._parse_lines(data[:nl])

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
            return False
        try:
            with open(self.path, "rb") as f:
                if self.offset == 0 and st.st_size > self.full_read_bytes:
                    self._open_large(f, st.st_size)
                    self.offset = st.st_size
                else:
                    f.seek(self.offset)
                    data = f.read(st.st_size - self.offset)
                    self.offset += len(data)
                    self._consume(data)
        except OSError:
            return False
        self.version += 1
        return True

    # ------------------------------------------------------------ summaries
    def rate(self) -> tuple[float | None, float | None]:
        """``(steps_per_s, samples_per_s)`` from the newest training records of the current session."""
        recs = [r for r in self.recent if _finite(r.get("time")) is not None and _finite(r.get("step")) is not None]
        sps = _finite(self.last_train.get("samples_per_s")) if self.last_train else None
        if len(recs) < 2:
            return None, sps
        # Walk back while steps and times increase (a resume or a long pause breaks the window).
        j = len(recs) - 1
        while j > 0 and recs[j - 1]["step"] < recs[j]["step"] and 0 < recs[j]["time"] - recs[j - 1]["time"] < 600:
            j -= 1
            if len(recs) - j > 20:
                break
        a, b = recs[j], recs[-1]
        dt, ds = b["time"] - a["time"], b["step"] - a["step"]
        return (ds / dt if dt > 0 and ds > 0 else None), sps

    def log_interval(self) -> float | None:
        """Median seconds between the newest training records (how often the heartbeat comes)."""
        times = [_finite(r.get("time")) for r in self.recent]
        times = [t for t in times if t is not None]
        gaps = sorted(b - a for a, b in zip(times, times[1:]) if b > a)
        return gaps[len(gaps) // 2] if gaps else None

    def best_val(self, metric: str, mode: str) -> dict[str, Any] | None:
        """The best evaluation record for ``metric`` (``val/acc`` reads the record's ``acc``);
        NaN and +-Inf values are never best."""
        key = metric.split("/", 1)[1] if "/" in metric else metric
        best = None
        for rec in self.val:
            v = _finite(rec.get(key))
            if v is None:
                continue
            if best is None or (v > best[0] if mode == "max" else v < best[0]):
                best = (v, rec)
        return best[1] if best else None


class LogTail:
    """The last ``keep`` lines of a text log, read incrementally (first read: the last ``tail_bytes``)."""

    def __init__(self, path: Path, keep: int = 200, tail_bytes: int = 32 << 10):
        self.path = Path(path)
        self.keep = keep
        self.tail_bytes = tail_bytes
        self.lines: deque[str] = deque(maxlen=keep)
        self.offset = 0
        self._partial = b""
        self._ident: tuple[int, int] | None = None
        self.version = 0

    def poll(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        ident = (st.st_dev, st.st_ino)
        if self._ident is not None and (ident != self._ident or st.st_size < self.offset):
            self.lines.clear()
            self.offset, self._partial = 0, b""
        self._ident = ident
        if st.st_size == self.offset:
            return False
        start, skipped = self.offset, False
        if start == 0 and st.st_size > self.tail_bytes:
            start, skipped = st.st_size - self.tail_bytes, True
        try:
            with open(self.path, "rb") as f:
                f.seek(start)
                data = f.read(st.st_size - start)
        except OSError:
            return False
        self.offset = start + len(data)
        if skipped:  # started inside the file: drop the first, partial line
            nl = data.find(b"\n")
            data = data[nl + 1:] if nl >= 0 else b""
        data = self._partial + data
        nl = data.rfind(b"\n")
        if nl < 0:
            self._partial = data
            return False
        self._partial = data[nl + 1:]
        for line in data[:nl].decode("utf-8", "replace").splitlines():
            self.lines.append(line)
        self.version += 1
        return True


# --------------------------------------------------------------- snapshot
@dataclass(frozen=True)
class RunSnapshot:
    """Everything a watcher shows, read at one moment (safe to hand across threads).

    ``metrics_version``/``log_version``/``candidates_key`` change only when the
    underlying data did, so a UI redraws only what changed.
    """

    run_dir: Path
    time: float
    status: StatusView
    markers: tuple[str, ...]
    problems: tuple[str, ...]
    step: int | None
    total_steps: int | None
    epoch: int | None
    epochs: int | None
    steps_per_s: float | None
    samples_per_s: float | None
    eta_s: float | None
    last_train: dict[str, Any] | None
    last_val: dict[str, Any] | None
    best_val: dict[str, Any] | None
    metric: str
    mode: str
    loss: tuple[tuple[float, ...], tuple[float, ...]]
    lr: tuple[tuple[float, ...], tuple[float, ...]]
    metrics_version: int
    metrics_records: int
    metrics_sampled: bool
    log_lines: tuple[str, ...]
    log_version: int
    candidates: tuple[Candidate, ...]
    chosen: str | None
    candidates_key: tuple[Any, ...]
    config: dict[str, Any] | None
    provenance: dict[str, Any] | None
    #: metrics that were NaN or +-Inf somewhere in metrics.jsonl (copies; key order of first sight)
    nonfinite: tuple[NonFinite, ...] = ()
    #: :func:`candidate_identity` of each of ``candidates`` (same order)
    candidate_ids: tuple[tuple[Any, ...], ...] = ()

    def nonfinite_of(self, key: str) -> NonFinite | None:
        """The :class:`NonFinite` record of metric ``key`` (``loss``, ``lr``, ``val/loss``), or None."""
        return next((n for n in self.nonfinite if n.key == key), None)


def _read_toml(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8")), None
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        return None, f"config.toml is unreadable ({e.__class__.__name__}: {e})"


def _int(v: Any) -> int | None:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    f = _finite(v)
    return None if f is None else int(f)


class RunReader:
    """Reads a run directory incrementally; call :meth:`poll` (from one thread at a time)."""

    def __init__(self, run_dir: Path, *, checkpoint_every_s: float = 2.0, **metrics_kw: Any):
        self.run_dir = Path(run_dir)
        self.metrics = MetricsTail(self.run_dir / METRICS, **metrics_kw)
        self.log = LogTail(self.run_dir / LOG)
        self.checkpoint_every_s = checkpoint_every_s
        self._cands: tuple[tuple[Candidate, ...], str | None, tuple[Any, ...]] = ((), None, ())
        self._ids: tuple[tuple[Any, ...], ...] = ()
        self._cands_at = 0.0
        self._model_key: Any = None
        self._config: tuple[Any, dict[str, Any] | None, str | None] = (None, None, None)
        self._prov: tuple[Any, dict[str, Any] | None] = (None, None)

    def _mtime_key(self, path: Path) -> Any:
        try:
            st = path.stat()
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return None

    def _read_config(self) -> tuple[dict[str, Any] | None, str | None]:
        key = self._mtime_key(self.run_dir / CONFIG)
        if key != self._config[0]:
            cfg, problem = _read_toml(self.run_dir / CONFIG)
            self._config = (key, cfg, problem)
        return self._config[1], self._config[2]

    def _read_provenance(self) -> dict[str, Any] | None:
        key = self._mtime_key(self.run_dir / PROVENANCE)
        if key != self._prov[0]:
            self._prov = (key, read_json(self.run_dir / PROVENANCE))
        return self._prov[1]

    def _read_candidates(self, now: float, force: bool) -> tuple[tuple[Candidate, ...], str | None, tuple[Any, ...]]:
        model = self.run_dir / MODEL
        key = self._mtime_key(model)
        if not force and key == self._model_key and now - self._cands_at < self.checkpoint_every_s:
            return self._cands
        self._cands_at = now
        # A save that rotates `last` (or replaces a file and then its sidecar) while the
        # candidates are hashed can make an intact checkpoint look corrupt for a moment:
        # read again until model/ did not change during the read (at most 3 times).
        for _ in range(3):
            try:
                chosen, cands = select_resume(model)
            except OSError:
                chosen, cands = None, []
            after = self._mtime_key(model)
            if after == key:
                break
            key = after
        self._model_key = key
        ids = tuple(candidate_identity(c) for c in cands)
        ckey = tuple((c.name, c.complete, c.step, c.size, c.reason, c.created, i) for c, i in zip(cands, ids))
        self._cands = (tuple(cands), chosen.name if chosen else None, ckey)
        self._ids = ids
        return self._cands

    def poll(self, *, now: float | None = None, force_checkpoints: bool = False) -> RunSnapshot:
        """Read what changed and return a snapshot (never raises for damaged files)."""
        now = time.time() if now is None else now
        m = self.metrics
        m.poll()
        self.log.poll()
        interval = m.log_interval()
        stale_after = max(STALE_MIN_S, 5 * interval) if interval else STALE_MIN_S
        status = read_status(self.run_dir, now=now, stale_after=stale_after)
        config, config_problem = self._read_config()
        prov = self._read_provenance()
        cands, chosen, ckey = self._read_candidates(now, force_checkpoints)
        markers = tuple(run_markers(self.run_dir))

        problems: list[str] = []
        if not self.run_dir.is_dir():
            problems.append("the run directory does not exist (yet)")
        elif not markers:
            problems.append("empty run directory: no config.toml, status.json, metrics.jsonl or model/ yet")
        if status.problem and markers:
            problems.append(status.problem)
        if status.note:
            problems.append(status.note)
        if config_problem:
            problems.append(config_problem)
        elif config is None and markers:
            problems.append("no config.toml (half-created run?)")
        if not m.exists and markers:
            problems.append("no metrics.jsonl yet")
        if m.bad_lines:
            problems.append(f"metrics.jsonl: {m.bad_lines} damaged line(s) skipped")
        if m.pending and not status.live:
            problems.append(f"metrics.jsonl ends with an unfinished line ({m.pending} bytes, ignored)")
        if status.state == "failed" and status.raw.get("error"):
            problems.append(f"run failed: {status.raw.get('error')}")
        nonfinite = tuple(dataclasses.replace(n) for n in m.nonfinite.values())
        if nonfinite:
            problems.append("; ".join(n.note() for n in nonfinite))
        bad_manifests = [c.name for c in cands if c.reason and "unreadable" in c.reason]
        if bad_manifests:
            problems.append(f"damaged manifest: {', '.join(bad_manifests)}")

        st = status.raw
        last = m.last_train or {}
        step = _int(st.get("step"))
        last_step = _int(last.get("step"))
        if step is None or (last_step is not None and status.live and last_step > step):
            step = last_step if last_step is not None else step
        epoch = _int(st.get("epoch"))
        if epoch is None:
            epoch = _int(last.get("epoch"))
        total = _int(st.get("total_steps"))
        epochs = _int(st.get("epochs"))
        if epochs is None and config:
            epochs = _int((config.get("train") or {}).get("epochs"))
        steps_per_s, samples_per_s = m.rate()
        eta = None
        if status.live and steps_per_s and total is not None and step is not None:
            eta = max(0.0, (total - step) / steps_per_s)
        ev = (config or {}).get("eval") or {}
        metric = ev.get("metric") if isinstance(ev.get("metric"), str) else "val/acc"
        mode = ev.get("mode") if ev.get("mode") in ("max", "min") else "max"
        lx, ly = m.loss.points()
        rx, ry = m.lr.points()
        return RunSnapshot(
            run_dir=self.run_dir, time=now, status=status, markers=markers, problems=tuple(problems),
            step=step, total_steps=total, epoch=epoch, epochs=epochs, steps_per_s=steps_per_s,
            samples_per_s=samples_per_s,
            eta_s=eta, last_train=m.last_train, last_val=m.last_val, best_val=m.best_val(metric, mode),
            metric=metric, mode=mode, loss=(tuple(lx), tuple(ly)), lr=(tuple(rx), tuple(ry)),
            metrics_version=m.version, metrics_records=m.records, metrics_sampled=m.sampled,
            log_lines=tuple(self.log.lines), log_version=self.log.version,
            candidates=cands, chosen=chosen, candidates_key=ckey, config=config, provenance=prov,
            nonfinite=nonfinite, candidate_ids=self._ids,
        )


# ------------------------------------------------------------- candidates
def candidate_age(c: Candidate, now: float | None = None) -> float | None:
    """Seconds since the candidate was written (manifest ``created``, else the file's mtime)."""
    now = time.time() if now is None else now
    when = None
    if c.created:
        try:
            when = datetime.fromisoformat(c.created).timestamp()
        except ValueError:
            when = None
    if when is None:
        try:
            when = Path(c.path).lstat().st_mtime
        except OSError:
            return None
    return max(0.0, now - when)


def candidate_identity(c: Candidate) -> tuple[Any, ...]:
    """Which checkpoint a row shows: its name and the generation written under that name.

    ``last`` names a new checkpoint after every save; its manifest's ``created`` time, step
    and files table (sizes and sha256) tell the generations apart. A candidate without a manifest (a legacy file without
    its sidecar, a temporary leftover) is told apart by its file's inode and mtime (this
    stats the file: call it off the event loop).
    """
    if c.manifest is not None and (c.created is not None or c.step is not None):
        files = c.manifest.get("files")
        digest = hashlib.sha256(json.dumps(files, sort_keys=True, default=str).encode()).hexdigest()[:16] \
            if isinstance(files, dict) else None
        return (c.name, c.created, c.step, digest)
    try:
        st = os.stat(c.path)
        return (c.name, None, c.step, st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        return (c.name, None, c.step, None, c.size, None)


def _generation(c: Candidate) -> tuple[Any, ...]:
    """What must not change while a candidate is hashed: its manifest, and what its path
    (and its sidecar manifest) are on disk."""
    p = Path(c.path)

    def stat(q: Path) -> tuple[int, int, int] | None:
        try:
            st = os.stat(q)
        except OSError:
            return None
        return st.st_ino, st.st_size if not os.path.isdir(q) else 0, st.st_mtime_ns

    try:
        link = os.readlink(p) if p.is_symlink() else None
    except OSError:
        link = None
    manifest = json.dumps(c.manifest, sort_keys=True, default=str) if c.manifest is not None else None
    return (c.name, link, stat(p), stat(p.with_name(p.name + ".json")), manifest)


@dataclass
class VerifyResult:
    """The outcome of :func:`verify_checkpoint` for one generation of one candidate.

    Attributes:
        name: the candidate's name (``last``, ``iter_40.pth``, ...).
        identity: :func:`candidate_identity` of the generation that was hashed.
        step: its global step.
        outcome: ``ok``; ``failed`` (``problems`` says why); ``changed``: a save replaced it
            on every try (not a verdict on any checkpoint: check again).
        problems: one line per problem.
        tries: how many generations were read.
    """

    name: str
    identity: tuple[Any, ...]
    step: int | None
    outcome: str
    problems: list[str]
    tries: int = 1

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def find_candidate(model_dir: Path, name: str) -> Candidate | None:
    """The candidate named ``name`` in ``model_dir`` as it is now (None if there is none)."""
    from .checkpoint.selection import list_candidates

    return next((c for c in list_candidates(Path(model_dir)) if c.name == name), None)


def verify_checkpoint(model_dir: Path, name: str, *, tries: int = 3, settle_s: float = 0.3) -> VerifyResult:
    """Verify the current generation of candidate ``name``: its files against its own manifest.

    The candidate is listed afresh (a snapshot's manifest may be older than the files now
    under ``model/last``), hashed, and listed again: if a save rotated it in between (the
    path, its manifest or sidecar changed) the result is discarded and the new generation is
    checked, up to ``tries`` times; then the outcome is ``changed``, never a mismatch that
    is not there. A mismatch is confirmed after ``settle_s`` (a file replaced just before
    its sidecar manifest). Hashes are cached per file inode, size and mtime
    (:func:`pimm_core.checkpoint.selection.verify_candidate`).
    """
    seen: Candidate | None = None
    for attempt in range(1, tries + 1):
        c = find_candidate(model_dir, name)
        if c is None:  # between the two renames of a rotation, or deleted
            time.sleep(settle_s)
            continue
        seen = c
        before = _generation(c)
        try:
            problems = candidate_problems(c)
        except OSError as e:  # a file went away under the hash (a rotation), or cannot be read
            problems = [f"{Path(e.filename).name if e.filename else name}: {e.strerror or e.__class__.__name__}"]
        if problems:
            time.sleep(settle_s)
        again = find_candidate(model_dir, name)
        if again is not None and _generation(again) == before:
            return VerifyResult(name, candidate_identity(c), c.step, "failed" if problems else "ok", problems, attempt)
    if seen is None:
        return VerifyResult(name, (name,), None, "changed",
                            [f"{name} is no longer in {model_dir} (removed or being replaced); press v again"], tries)
    return VerifyResult(name, candidate_identity(seen), seen.step, "changed",
                        [f"{name} changed while it was checked (a save replaced it {tries} times); press v again"],
                        tries)


def candidate_problems(c: Candidate) -> list[str]:
    """What an operator is told is wrong with a candidate; one line per problem (empty: ok).

    Sizes and sha256 against its manifest
    (:func:`pimm_core.checkpoint.selection.verify_candidate`, the check resume applies), plus
    what that check lets pass: no manifest to verify against, or an incomplete candidate.
    """
    from .checkpoint.selection import verify_candidate as verify_files_of

    if c.manifest is None:
        return [c.reason or "no manifest: nothing to verify against"]
    if not isinstance(c.manifest.get("files"), dict):
        return ["manifest has no files table"]
    problems = verify_files_of(c)  # the same check resume applies before loading
    if not c.complete:
        problems.insert(0, c.reason or "incomplete")
    return problems


# ------------------------------------------------------------ resume diff
def human_duration(seconds: float | None) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 10 min``, ``3 d 4 h``; ``-`` for None."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def _installed_torch_version() -> str | None:
    """``torch.__version__`` of the installed torch, read from its ``version.py`` without importing it."""
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            try:
                text = (Path(loc) / "version.py").read_text(encoding="utf-8")
            except OSError:
                continue
            m = re.search(r"^__version__\s*(?::\s*str\s*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
            if m:
                return m.group(1)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


@dataclass
class ResumeDiff:
    """What a checkpoint recorded vs. a planned resume, and the policy row that applies.

    Attributes:
        candidate: the checkpoint compared (a resume's choice unless one was named).
        selected_by: ``resume`` (what ``--train.resume`` would load) or ``name``.
        recorded, planned: ``world_size``, ``workers_per_rank``, ``code_version``,
            ``torch_version``, ``data_fingerprint`` (planned: None where only a launch knows:
            the data fingerprint, which the launch computes as it loads the data).
        config_diff: ``key: saved -> planned`` lines (:func:`pimm_core.topology.config_diff`).
        plan: :class:`pimm_core.topology.ResumePlan` as JSON, or None (weights-only file).
        notes: lines on what could not be compared and why.
    """

    run_dir: str
    candidate: dict[str, Any]
    selected_by: str
    recorded: dict[str, Any]
    planned: dict[str, Any]
    config_diff: list[str]
    plan: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": 1, "run_dir": self.run_dir, "candidate": self.candidate,
                "selected_by": self.selected_by, "recorded": self.recorded, "planned": self.planned,
                "config_diff": self.config_diff, "plan": self.plan, "notes": self.notes}

    def lines(self) -> list[str]:
        """The human report (``pimm checkpoints diff``)."""
        c = self.candidate
        out = [f"checkpoint: {c['name']} ({c['path']}) step {c.get('step')}, epoch {c.get('epoch')}, "
               f"iter {c.get('iter')}" + (" [resume would pick this]" if self.selected_by == "resume" else "")]
        out.append(f"{'':22}{'recorded':>24}  {'planned':<24}")
        for key, label in DIFF_ROWS:
            a, b = self.recorded.get(key), self.planned.get(key)
            mark = "" if b is None or a is None or a == b else "  <- changed"
            out.append(f"{label:22}{_show(a):>24}  {_show(b, planned=True, key=key):<24}{mark}".rstrip())
        out.append("config diff:" + (" none" if not self.config_diff else ""))
        out += [f"  {line}" for line in self.config_diff]
        p = self.plan
        if p is None:
            out.append("policy: weights only: this file cannot resume a run (warm-start with --train.weight)")
        else:
            out.append(f"policy: {p['description']}")
            out.append(f"restore: {', '.join(p['restored'])}")
            out.append(f"discard: {', '.join(p['discarded']) or 'nothing'}")
            rb = p.get("replay_boundary")
            if rb:
                out.append(f"replay boundary: epoch {rb['epoch']} restarts at step {rb['step']}; "
                           f"the {rb['from_iter']} batches already run in that epoch train again")
            else:
                out.append(f"replay boundary: none ({'exact continuation' if p['exact'] else 'nothing to replay'}) "
                           f"at step {p['step']}, epoch {p['epoch']}, iter {p['iter']}")
            out += [f"warning: {w}" for w in p.get("warnings", [])]
        out += [f"note: {n}" for n in self.notes]
        return out


DIFF_ROWS = (("world_size", "world size"), ("batch_size", "per-rank micro-batch"),
             ("grad_accum", "accumulation window"), ("workers_per_rank", "per-rank workers"),
             ("code_version", "code version"), ("torch_version", "torch version"),
             ("data_fingerprint", "data fingerprint"))


#: What the planned side shows for a value only a launch knows (it loads the data to hash it).
PLANNED_AT_LAUNCH = {"data_fingerprint": "computed at launch"}


def planned_text(key: str, v: Any) -> str:
    """The planned side of a diff row: the value, or why there is none (``computed at launch``)."""
    if v is None:
        return PLANNED_AT_LAUNCH.get(key, "unknown")
    return str(v)


def _show(v: Any, planned: bool = False, key: str = "") -> str:
    if v is None:
        return f"({planned_text(key, v)})" if planned else "-"
    return str(v)


_CODE_VERSION: list[str | None] = []


def current_code_version() -> str | None:
    """``git describe`` of the pimm checkout (cached for the process)."""
    if not _CODE_VERSION:
        from .run import code_version

        _CODE_VERSION.append(code_version())
    return _CODE_VERSION[0]


def resume_diff(run_dir: Path, *, world_size: int | None = None, workers: int | None = None,
                overrides: list[str] | tuple[str, ...] = (), candidate: str | None = None) -> ResumeDiff:
    """Compare a run's checkpoint with a planned resume (torch-free).

    Args:
        run_dir: the run directory.
        world_size: planned world size (ranks); None: the run's recorded launch (what ``pimm
            resume RUN_DIR`` would start).
        workers: planned per-rank loader workers; None: ``data.num_workers`` of the plan's config.
        overrides: ``key=value`` config overrides applied to the run's own ``config.toml``.
        candidate: a candidate name in ``model/`` (default: what a resume would select).

    Raises:
        UsageError: not a run directory; bad world size or workers; unknown candidate.
        ConfigError: the run's config.toml is missing or invalid, or an override is.
        CheckpointError: no complete checkpoint to resume from (exit code 1).
    """
    from .config import load_config
    from .topology import config_diff, plan_resume

    run_dir = check_run_dir(run_dir)
    if world_size is None:
        world_size = recorded_world_size(recorded_launch(run_dir))
    if world_size < 1:
        raise UsageError(f"world size must be at least 1 (got {world_size})")
    if workers is not None and workers < 0:
        raise UsageError(f"per-rank workers must be 0 or more (got {workers})")
    cfg_path = run_dir / CONFIG
    if not cfg_path.is_file():
        raise ConfigError(f"{run_dir} has no config.toml, so there is no plan to compare with; "
                          "pass a run directory written by pimm launch")
    ovr = list(overrides)
    if workers is not None:
        ovr.append(f"data.num_workers={workers}")
    cfg = load_config(cfg_path, ovr)
    saved, _ = _read_toml(cfg_path)
    chosen, cands = select_resume(run_dir / MODEL)
    if candidate is not None:
        found = [c for c in cands if c.name == candidate or c.path == str(candidate)]
        if not found:
            names = ", ".join(c.name for c in cands) or "none"
            raise UsageError(f"no checkpoint named {candidate!r} in {run_dir / MODEL} (candidates: {names})")
        cand, selected_by = found[0], ("resume" if chosen is not None and found[0].path == chosen.path else "name")
    else:
        if chosen is None:
            from .checkpoint.selection import explain

            found_lines = "; ".join(explain(cands, None)) or "nothing"
            raise CheckpointError(f"no complete checkpoint in {run_dir / MODEL} (found: {found_lines}); "
                                  "a launch would start fresh")
        cand, selected_by = chosen, "resume"
    manifest = cand.manifest or {}
    prov = read_json(run_dir / PROVENANCE) or {}
    notes: list[str] = []
    recorded: dict[str, Any] = {}
    for key, _label in DIFF_ROWS:
        v = manifest.get(key)
        if v is None and prov.get(key) is not None:
            v = prov.get(key)
            notes.append(f"{key} taken from provenance.json (the manifest does not record it)")
        recorded[key] = v
    if not cand.complete:
        notes.append(f"{cand.name} is incomplete ({cand.reason}); a resume would refuse it")
    if cand.manifest is None:
        notes.append(f"{cand.name} has no readable manifest: recorded values are unknown")
    planned = {"world_size": world_size, "workers_per_rank": cfg.data.num_workers,
               "batch_size": cfg.data.batch_size, "grad_accum": cfg.train.grad_accum,
               "code_version": current_code_version(), "torch_version": _installed_torch_version(),
               "data_fingerprint": None}
    if recorded.get("data_fingerprint") is not None:
        notes.append("the planned data fingerprint is computed when the launch loads the data; "
                     "the resume warns if it differs from the recorded one")
    plan = None
    if cand.resumable:
        plan = plan_resume(manifest, world_size=world_size, workers_per_rank=cfg.data.num_workers,
                           strict=cfg.resume_strict_state, grad_accum=cfg.train.grad_accum,
                           batch_size=cfg.data.batch_size, legacy=cand.format == "legacy").to_json()
    diff = config_diff(saved or {}, cfg.to_dict())
    cj = cand.to_json()
    return ResumeDiff(str(run_dir), cj, selected_by, recorded, planned, diff, plan, notes)
