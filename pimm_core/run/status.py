"""``status.json``: the run's heartbeat, as a typed record, with its writer and reader (torch-free).

Rank 0 replaces the file atomically at every state change and after logged steps: a state change
at once, on the training thread; a logged step's ``running`` on a writer thread
(:class:`StatusWriter`), so the training thread pays no JSON encoding and no file system call for
it, at most every :attr:`StatusWriter.min_interval_s` (the newest logged step's record; the
step-by-step record is ``metrics.jsonl``). Readers (the console, ``pimm stop``, the launch's
finished-run check, the run lock) take it through :func:`read_run_status`, which never raises: a
missing or damaged file reads as a record with ``state`` None and ``problem`` saying why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from ..faults import point
from .jsonfile import write_json
from .layout import STATUS
from .values import finite_number, json_int

#: What ``state`` may say, in the order a run goes through them. ``restarting``: a rank failed and
#: torchrun's agent (``pimm launch --max-restarts K``, restarts left) is starting the ranks again;
#: ``agent_pid`` then names the agent's process (the launcher), which is what is alive meanwhile.
STATES = ("starting", "running", "restarting", "stopping", "stopped", "finished", "failed")


def now_iso() -> str:
    """Current UTC time, ISO 8601 with offset (e.g. ``2026-11-29T12:00:00+00:00``)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


@dataclass
class RunStatus:
    """One ``status.json`` record.

    Attributes:
        state: one of :data:`STATES` as written (another string is kept as it is); None when
            the file is missing or damaged (``problem`` says which).
        host, pid: where rank 0 runs (``socket.gethostname()``, its pid).
        updated: when it was written (ISO 8601, UTC).
        heartbeat: the same, in UNIX seconds (what staleness is measured from).
        pids: every rank's pid, rank order.
        step, epoch, iter: the global step (optimizer steps), the epoch, the micro-batch in the epoch.
        total_steps: the step the run ends at (the LR schedule's horizon).
        steps_per_epoch, epochs, world_size: the run's shape.
        stop_reason: why the run stopped early (``operator``, ``signal SIGTERM``...); None otherwise.
        error: ``"<ExceptionClass>: <message>"`` of a failed run (written only then), or, when a rank died
            without saying it (killed) or another rank's death caused rank 0's error, the launcher's line
            naming the cause (``rank 1 was killed by SIGKILL; ...``, :func:`mark_failed`).
        memory_step: with ``checkpoint.memory_every_steps``: the newest step every rank can reach in
            the memory tier (:mod:`pimm_core.run.memory_index`); written only when set.
        recovery: where the latest restart of the ranks (``pimm launch --max-restarts``) took its
            state from: ``{"tier": "memory"|"disk"|"remote", "step": S, "restart": K, "saved_world_size": W0,
            "world_size": W}`` (the world sizes before and after the restart); written only when set.
        extra: keys this version does not know, kept so a record reads back unchanged.
        problem: why the file could not be used (never written to the file).
    """

    state: str | None
    host: str | None = None
    pid: int | None = None
    updated: str | None = None
    heartbeat: float | None = None
    pids: list[int] = field(default_factory=list)
    step: int | None = None
    epoch: int | None = None
    iter: int | None = None
    total_steps: int | None = None
    steps_per_epoch: int | None = None
    epochs: int | None = None
    world_size: int | None = None
    stop_reason: str | None = None
    error: str | None = None
    memory_step: int | None = None
    recovery: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    problem: str | None = field(default=None, compare=False)

    #: Written only when set (every other field is always written, null when unknown).
    _WHEN_SET = ("error", "memory_step", "recovery")

    def to_json(self) -> dict[str, Any]:
        """The file's object: the fields above in order (``error`` only when set), then ``extra``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("extra", "problem"):
                continue
            v = getattr(self, f.name)
            if v is None and f.name in self._WHEN_SET:
                continue
            out[f.name] = list(v) if f.name == "pids" else v
        return {**out, **{k: v for k, v in self.extra.items() if k not in out}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunStatus:
        """The record of a ``status.json`` object; a missing key or one of the wrong type reads as None
        (``pids``: only its integers), unknown keys go to ``extra``."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "problem"}
        pids = data.get("pids")
        return cls(
            state=_str(data.get("state")), host=_str(data.get("host")), pid=json_int(data.get("pid")),
            updated=_str(data.get("updated")), heartbeat=finite_number(data.get("heartbeat")),
            pids=[p for p in (json_int(x) for x in pids) if p is not None] if isinstance(pids, list) else [],
            step=json_int(data.get("step")), epoch=json_int(data.get("epoch")), iter=json_int(data.get("iter")),
            total_steps=json_int(data.get("total_steps")), steps_per_epoch=json_int(data.get("steps_per_epoch")),
            epochs=json_int(data.get("epochs")), world_size=json_int(data.get("world_size")),
            stop_reason=_str(data.get("stop_reason")), error=_str(data.get("error")),
            memory_step=json_int(data.get("memory_step")),
            recovery=data.get("recovery") if isinstance(data.get("recovery"), dict) else None,
            extra={k: v for k, v in data.items() if k not in known},
        )

    @classmethod
    def unreadable(cls, problem: str) -> RunStatus:
        """The record of a missing or damaged file: no state, and why."""
        return cls(state=None, problem=problem)


def write_status(run_dir: Path, state: str, **fields: Any) -> None:
    """Atomically replace ``status.json`` (not fsynced: it is rewritten every logged step).

    Args:
        state: one of :data:`STATES`.
        fields: the other :class:`RunStatus` fields (``step``, ``epoch``, ``stop_reason``, ...);
            ``host``, ``pid``, ``updated`` and ``heartbeat`` are this process's and now. A
            name that is not a field is written as it is (:attr:`RunStatus.extra`).

    Raises:
        OSError: the write failed.
    """
    names = {f.name for f in dataclasses.fields(RunStatus)} - {"extra", "problem"}
    record = RunStatus(state, host=socket.gethostname(), pid=os.getpid(), updated=now_iso(), heartbeat=time.time())
    record = dataclasses.replace(record, **{k: v for k, v in fields.items() if k in names},
                                 extra={k: v for k, v in fields.items() if k not in names})
    point("status.write", Path(run_dir) / STATUS)  # a full disk at a heartbeat (crash tests)
    write_json(Path(run_dir) / STATUS, record.to_json(), durable=False)


class StatusWriter:
    """Rank 0's writer of ``status.json`` for one ``train()`` call: :meth:`post` hands a logged step's
    ``running`` record to a writer thread, :meth:`write` writes any state at once.

    Ordering, by construction: every write of the file happens under one lock, and the thread takes
    the record it writes under that lock; :meth:`write` takes it too and, before it writes, drops the
    record not yet taken. So a ``running`` handed over before a state change is written before it or
    never, and never after it. After a state other than ``running`` is written (``stopping``,
    ``finished``, ``failed``...), :meth:`post` is ignored until a ``running`` is written again with
    :meth:`write`: a stale ``running`` cannot replace an end state. Nor a state another process wrote
    (the launcher's :func:`mark_restarting` or :func:`mark_failed`, while this rank is being stopped):
    the thread writes only over a ``running`` record (or a missing or torn one).

    Only the newest record handed over is written (a reader only ever needs the newest): the
    thread writes when woken, a record handed over while it writes replaces the one waiting, and
    after a write it waits ``min_interval_s`` before it takes the next (a small model logs every
    few milliseconds: a file replacement each time, ~0.1-0.2 ms of CPU beside the training
    threads, cost the quickstart ~1.5 % of its step time). The first record handed over is written
    at once; a reader is at most ``min_interval_s`` behind the newest logged step, and
    :meth:`close` and :meth:`write` do not wait.

    Args:
        run_dir: the run directory.
        min_interval_s: instead of the class's :attr:`min_interval_s`.
        report: called after each write, on the thread that wrote (under the write lock, so in
            the order of the writes), with the OSError of a write that failed or None.

    Any other exception of the thread's write (a field JSON cannot encode: a bug) ends the thread
    and is raised by the next :meth:`post`, on the training thread, as a synchronous write's would be.
    """

    #: The least time (seconds, monotonic clock) between two of the thread's writes: 4 a second,
    #: more than a person watching or a stale-heartbeat check (tens of seconds) can tell apart.
    min_interval_s = 0.25

    def __init__(self, run_dir: Path, report: Callable[[OSError | None], None], *,
                 min_interval_s: float | None = None):
        self.run_dir, self._report = Path(run_dir), report
        if min_interval_s is not None:
            self.min_interval_s = min_interval_s
        self._next_at = 0.0  # (monotonic) the thread's next write waits until then, unless closing
        self._io = threading.Lock()  # one replacement of the file at a time, in order
        self._cond = threading.Condition()  # guards the fields below
        self._pending: dict[str, Any] | None = None  # the newest record handed over, not yet taken
        self._posting = True  # False once a state other than running is written: post() is ignored
        self._closing = False
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None  # what ended the thread, raised by the next post()

    def post(self, fields: dict[str, Any]) -> None:
        """Have the thread write ``running`` with ``fields`` (:func:`write_status`'s), soon: no
        I/O and no encoding here. ``fields`` must not be changed afterwards (a new dict each call)."""
        with self._cond:
            if self._error is not None:
                raise self._error
            if not self._posting:
                return
            self._pending = fields
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pimm-status", daemon=True)
                self._thread.start()
            self._cond.notify()

    def write(self, state: str, fields: dict[str, Any]) -> None:
        """Write ``state`` with ``fields`` now, after any write in progress; a record handed over
        and not yet written is dropped (this one is newer). The result goes to ``report``."""
        with self._io:
            with self._cond:
                self._pending, self._posting = None, state == "running"
            self._write(state, fields)

    def close(self) -> None:
        """Write the record still waiting, if any, and stop the thread (joined; a later :meth:`post`
        starts another)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cond:
            self._closing, self._thread = False, None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing:
                    wait = None if self._pending is None else self._next_at - time.monotonic()
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._pending is None:
                    return  # closing, nothing left
            with self._io:
                with self._cond:  # (taken under the write lock: write() drops it or comes after)
                    fields, self._pending = self._pending, None
                if fields is None:
                    continue
                if read_run_status(self.run_dir).state not in (None, "running"):
                    # another process took the record over since this one wrote `running` (the launcher's
                    # mark_restarting or mark_failed while this rank is being stopped): a late heartbeat
                    # must not hide it (cheap at this pace: a read of a small file, 4 times a second at most)
                    continue
                try:
                    self._write("running", fields)
                except Exception as e:  # (not an OSError: those are reported)
                    with self._cond:
                        self._error = e
                    return
                self._next_at = time.monotonic() + self.min_interval_s

    def _write(self, state: str, fields: dict[str, Any]) -> None:
        try:
            write_status(self.run_dir, state, **fields)
        except OSError as e:
            self._report(e)
        else:
            self._report(None)


def read_run_status(run_dir: Path) -> RunStatus:
    """The run's ``status.json`` (never raises).

    Returns:
        The record; for a missing, unreadable, torn or non-object file a record with
        ``state`` None and ``problem`` one line on what is wrong.
    """
    path = Path(run_dir) / STATUS
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return RunStatus.unreadable("no status.json (the trainer has not started, or this is not a run it wrote)")
    except OSError as e:
        return RunStatus.unreadable(f"cannot read status.json ({e.__class__.__name__})")
    try:
        data = json.loads(text)
    except ValueError:  # torn, not UTF-8, or not JSON
        return RunStatus.unreadable("status.json is not valid JSON (damaged)")
    if not isinstance(data, dict):
        return RunStatus.unreadable("status.json is not a JSON object (damaged)")
    return RunStatus.from_json(data)


def mark_restarting(run_dir: Path, agent_pid: int, why: str) -> None:
    """Say in ``status.json`` that torchrun's agent (process ``agent_pid``) restarts the ranks, keeping the
    rest of the record: what the launcher writes when a rank died before it could say so itself (rank 0
    killed). A record already ``restarting`` or in an end state is left as it is.

    Raises:
        OSError: the write failed.
    """
    _rewrite(run_dir, ("starting", "running", "stopping"), "restarting", why, agent_pid=agent_pid)


def mark_failed(run_dir: Path, why: str, *, keep_error: bool = False) -> None:
    """The launch ended with a failed rank and no restart left: ``status.json`` says ``failed`` with the
    cause ``why`` (the launcher's line, naming the rank: ``rank 0 was killed by SIGKILL; ...``).

    Rank 0 writes ``failed`` itself when it fails with no restart left; it cannot when it was killed (the
    record stays ``running``, or ``restarting`` from the previous attempt), and when another rank died
    first, its own error is only the consequence (a lost connection). So a record in any state but an end
    state is marked, and a ``failed`` one gets ``why`` as its error unless ``keep_error`` (rank 0's own
    failure is the cause, or ``why`` names a consequence too: another node's rank died, and that node's
    launcher names it). ``stopped`` and ``finished`` are left as they are.

    Raises:
        OSError: the write failed.
    """
    states = ("starting", "running", "restarting", "stopping", *(() if keep_error else ("failed",)))
    _rewrite(run_dir, states, "failed", why, error=why)


def _rewrite(run_dir: Path, states: tuple[str, ...], state: str, why: str, **extra: Any) -> None:
    rec = read_run_status(run_dir)
    if rec.state not in states:
        return
    drop = ("state", "host", "pid", "updated", "heartbeat", "agent_pid")
    fields = {k: v for k, v in rec.to_json().items() if k not in drop}
    write_status(run_dir, state, **{**fields, "error": rec.error or why, **extra})
