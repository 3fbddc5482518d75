"""``status.json`` interpreted for a watcher: heartbeat age, pid liveness, a pending stop, "is it live" (torch-free)."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..process.stop import read_stop_file, stop_file
from ..run.layout import METRICS
from ..run.pids import pid_alive as alive
from ..run.status import RunStatus, read_run_status

#: States in which a trainer process should be alive.
LIVE_STATES = ("starting", "running", "stopping")
#: States in which a stop request makes sense.
STOPPABLE_STATES = ("starting", "running")
#: A heartbeat older than this (or 5x the observed logging interval, if longer) is stale.
STALE_MIN_S = 30.0


def stale_after_for(log_interval: float | None) -> float:
    """Seconds without a heartbeat after which a live state is stale: :data:`STALE_MIN_S`, or 5x the
    observed logging interval (``log_interval``, seconds; None: unknown) when that is longer."""
    return max(STALE_MIN_S, 5 * log_interval) if log_interval else STALE_MIN_S


def pid_alive(pid: Any) -> bool | None:
    """Whether process ``pid`` exists on this host (zombies count as gone); None if unknown."""
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return None
    return alive(pid) if pid > 0 else None
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
        record: the file's record (state None and ``problem`` set when missing or unreadable).
        heartbeat_age: seconds since the last heartbeat (None without one).
        stale: a live state whose heartbeat is older than ``stale_after``.
        pid_alive: rank 0's process exists (None: another host, or no pid recorded).
        stop_request: the pending ``control/stop`` content, or None.
        live: a trainer is believed to be running (live state, fresh heartbeat, process not gone).
        stoppable: ``live`` and in a state where a stop request makes sense.
        note: one line on why it is not live / what is odd, or None.
    """

    record: RunStatus
    heartbeat_age: float | None = None
    stale: bool = False
    stale_after: float = STALE_MIN_S
    pid_alive: bool | None = None
    stop_request: dict[str, Any] | None = None
    live: bool = False
    stoppable: bool = False
    note: str | None = None

    @property
    def state(self) -> str | None:
        """The recorded state (:data:`pimm_core.run.status.STATES`), or None when unknown."""
        return self.record.state

    @property
    def problem(self) -> str | None:
        """Why the file could not be used, or None."""
        return self.record.problem

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


def read_status(run_dir: Path, *, now: float | None = None, stale_after: float = STALE_MIN_S,
                record: RunStatus | None = None) -> StatusView:
    """Read and interpret ``status.json`` (never raises for a missing or damaged file).

    ``record``: the file's record, already read with :func:`~pimm_core.run.status.read_run_status`
    (a reader that needed the state first, to know how much else to read, does not read it twice)."""
    now = time.time() if now is None else now
    rec = read_run_status(run_dir) if record is None else record
    view = StatusView(rec, stale_after=stale_after)
    if rec.heartbeat is not None:
        view.heartbeat_age = max(0.0, now - rec.heartbeat)
    try:
        view.stop_request = read_stop_file(run_dir) if os.path.exists(stop_file(run_dir)) else None
    except OSError:
        view.stop_request = None
    if rec.state == "restarting":
        return _restarting(view, rec)
    if rec.state not in LIVE_STATES:
        return view
    if rec.host is None or rec.host == socket.gethostname():
        view.pid_alive = pid_alive(rec.pid)
    view.stale = view.heartbeat_age is None or view.heartbeat_age > stale_after
    if view.pid_alive is False:
        view.note = (f"process {rec.pid} is gone but status.json says {rec.state}: "
                     "the trainer crashed or was killed")
    elif view.stale:
        age = "no heartbeat recorded" if view.heartbeat_age is None else f"no heartbeat for {view.heartbeat_age:.0f} s"
        view.note = f"{age} (hung, or on another host that stopped)"
    else:
        view.live = True
        view.stoppable = rec.state in STOPPABLE_STATES
    return view



def liveness(run_dir: Path, *, now: float | None = None) -> StatusView:
    """:func:`read_status` with the console's staleness rule (:func:`stale_after_for` of the logging
    interval seen in ``metrics.jsonl``, read from its tail): the one verdict "is this run live" that
    ``pimm stop`` and the console share (never raises for missing or damaged files)."""
    from .metrics import MetricsTail

    metrics = MetricsTail(Path(run_dir) / METRICS, scan_head=False)  # (the interval needs the newest records only)
    try:
        metrics.poll()
    except OSError:
        pass
    return read_status(run_dir, now=now, stale_after=stale_after_for(metrics.log_interval()))


def _restarting(view: StatusView, rec: RunStatus) -> StatusView:
    """``restarting``: live while torchrun's agent (``agent_pid``, the launcher) is; no heartbeat meanwhile
    (the ranks are being started again: as long as their start-up and recovery take)."""
    agent = rec.extra.get("agent_pid")
    if rec.host is None or rec.host == socket.gethostname():
        view.pid_alive = pid_alive(agent)
    if view.pid_alive is False:
        view.note = f"the launcher (process {agent}) is gone but status.json says restarting: it was killed"
    else:
        view.live = True
    return view
