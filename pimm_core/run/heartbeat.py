"""The writer of a rank's heartbeat file (``ranks/<rank>.json``, :mod:`.ranks`), cheap enough for
every micro-step (torch-free).

:func:`beat` (phase) and :func:`beat_step` only set fields in memory (a few attribute writes,
no I/O, no lock); a daemon thread of the :class:`Heartbeat` writes the file when something
changed, at most once per ``every_s`` (1 s), and at once when the rank enters a collective or
a save after a quiet second, the moments a hang is most likely to start; and every ``refresh_s``
(5 s) when nothing changed, so a fresh ``updated`` with an old ``progress`` says "alive, not
moving" (a hang), an old ``updated`` "the process is gone or frozen". The thread keeps
writing while the training thread is blocked in a collective or a user callback, so the file
shows where a rank stopped even when it never returns. A failed write (a full disk) is
skipped: the heartbeat is a diagnostic, never the reason a run fails. The same thread answers a
failing rank's request for every rank's stack at a hang (:mod:`.stacks`), and in rank 0 logs each
straggler once (:func:`~.ranks.stragglers`, from the ``work_s`` every rank writes).

One heartbeat per process (a rank is a process): :func:`heartbeat` installs it for the length
of a ``train()`` call and writes phase ``end`` when it closes; outside one, :func:`beat` does
nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Iterator

from .jsonfile import write_json
from ..errors import UsageError
from .entries import ensure_dir
from .ranks import STRAGGLER_WINDOW, RankBeat, describe_straggler, rank_file, read_rank_beats, stragglers
from .stacks import pending_request, write_main_stack

log = logging.getLogger("pimm")

#: Phases written at once after a quiet second, instead of at the next tick.
_PROMPT = ("collective", "save")


class Heartbeat:
    """Rank ``rank``'s heartbeat in ``run_dir/ranks/<rank>.json``.

    Args:
        every_s: the least time between two writes of the file (seconds).
        refresh_s: the most time between two writes (seconds).
    """

    def __init__(self, run_dir: Path, rank: int, world_size: int, *, every_s: float = 1.0,
                 refresh_s: float = 5.0):
        self.path = rank_file(run_dir, rank)
        self.rank, self.world_size, self.every_s, self.refresh_s = rank, world_size, every_s, refresh_s
        self.pid, self.host = os.getpid(), socket.gethostname()
        self.clock = time.time  # UNIX seconds of the phases and steps (a test gives its own)
        now = time.time()
        self.step: int | None = None
        self.phase, self.detail = "start", None
        self.since = self.progress = now
        self._version, self._written = 1, 0  # a change counter, and the version last written
        self._last_write = float("-inf")
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()  # one writer at a time (the thread, or close())
        self._thread: threading.Thread | None = None
        # Nothing is written before the run starts (arm()): a launch or resume refused before that
        # (no intact checkpoint, a bad config) leaves the run directory as it found it.
        self.armed = False
        # work_s (ranks.stragglers): the time before the rank can communicate, per optimizer step
        self._work, self._work_from = 0.0, None
        self._works: deque[float] = deque(maxlen=STRAGGLER_WINDOW)
        self._stragglers_logged: set[int] = set()
        self._stragglers_at = float("-inf")
        self._stacks_handled = now  # a stack request (stacks.py) older than this session is not for it

    # -------------------------------------------------------- training thread
    def enter(self, phase: str, detail: str | None = None) -> None:
        """The rank now does ``phase`` (one of :data:`~.ranks.PHASES`)."""
        if phase == self.phase and detail == self.detail:
            return
        now = self.clock()
        if self._work_from is not None:  # the batch wait and the forward end where the backward starts
            self._work += now - self._work_from
            self._work_from = None
        if phase in ("data", "forward/backward"):  # (until forward_done(): the backward communicates)
            self._work_from = now
        self.phase, self.detail, self.since, self.progress = phase, detail, now, now
        self._version += 1
        if phase in _PROMPT and time.monotonic() - self._last_write >= self.every_s:
            self._wake.set()

    def forward_done(self) -> None:
        """The rank's forward pass is done and its backward (where DDP communicates) begins."""
        if self._work_from is not None:
            self._work += self.clock() - self._work_from
            self._work_from = None

    def at_step(self, step: int) -> None:
        """The rank finished optimizer step ``step`` (the global step)."""
        self.step, self.progress = step, self.clock()
        self._works.append(self._work)
        self._work = 0.0
        self._version += 1

    @property
    def work_s(self) -> float | None:
        """The mean of ``work`` over the last :data:`~.ranks.STRAGGLER_WINDOW` steps (None before)."""
        works = list(self._works)
        return sum(works) / len(works) if len(works) == STRAGGLER_WINDOW else None

    # ----------------------------------------------------------------- writer
    def start(self) -> Heartbeat:
        self._thread = threading.Thread(target=self._run, name=f"pimm-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def arm(self) -> None:
        """The run has started: write the file from now on (rank 0 first removes the files of ranks
        at or above ``world_size``, left by an earlier session with more ranks)."""
        if self.armed:
            return
        if self.rank == 0:
            _remove_extra(self.path.parent, self.world_size)
        try:
            ensure_dir(self.path.parent)
        except (OSError, UsageError):
            return  # a diagnostic only: the run's own files say what is wrong with the directory
        self.armed = True
        self._write()

    def close(self, phase: str = "end") -> None:
        """Write ``phase`` (``end``) and stop the thread (joined: nothing of it outlives the run)."""
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.phase, self.detail, self.since = phase, None, time.time()
        self._version += 1
        self._write()

    def record(self) -> RankBeat:
        return RankBeat(rank=self.rank, world_size=self.world_size, pid=self.pid, host=self.host, step=self.step,
                        phase=self.phase, detail=self.detail, since=self.since, progress=self.progress,
                        updated=time.time(), work_s=self.work_s)

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.every_s)
            self._wake.clear()
            if self._closed.is_set():
                return
            self._answer_stack_request()
            wait = self.every_s - (time.monotonic() - self._last_write)
            if wait > 0 and self._closed.wait(wait):  # (a prompt phase right after a tick: next second)
                return
            if self._version != self._written or time.monotonic() - self._last_write >= self.refresh_s:
                self._write()
            if self.rank == 0 and self.world_size > 1:
                self._log_stragglers()

    def _log_stragglers(self) -> None:
        """Rank 0, every ``refresh_s``: log each rank that became a straggler, once a session."""
        if not self.armed or time.monotonic() - self._stragglers_at < self.refresh_s:
            return
        self._stragglers_at = time.monotonic()
        for beat, median in stragglers(read_rank_beats(self.path.parent.parent, self.world_size)):
            if beat.rank not in self._stragglers_logged:
                self._stragglers_logged.add(beat.rank)
                log.warning("warning: %s", describe_straggler(beat, median))

    def _answer_stack_request(self) -> None:
        """A failing rank asked for every rank's stack (a hang): write this one's main thread's."""
        if not self.armed:
            return
        run_dir = self.path.parent.parent
        when = pending_request(run_dir, self._stacks_handled)
        if when is not None:
            self._stacks_handled = when
            write_main_stack(run_dir, self.rank)

    def _write(self) -> None:
        if not self.armed:
            return
        with self._lock:
            version = self._version
            try:
                write_json(self.path, self.record().to_json(), durable=False)
            except OSError:
                return  # a diagnostic: the next change tries again
            self._written, self._last_write = version, time.monotonic()


_current: Heartbeat | None = None


def beat(phase: str, detail: str | None = None) -> None:
    """This rank now does ``phase`` (no-op outside :func:`heartbeat`)."""
    if _current is not None:
        _current.enter(phase, detail)


def arm() -> None:
    """The run has started: this process's heartbeat file is written from now on (no-op outside
    :func:`heartbeat`)."""
    if _current is not None:
        _current.arm()


def forward_done() -> None:
    """This rank's forward pass is done, its backward begins (no-op outside :func:`heartbeat`)."""
    if _current is not None:
        _current.forward_done()


def beat_step(step: int) -> None:
    """This rank finished optimizer step ``step`` (no-op outside :func:`heartbeat`)."""
    if _current is not None:
        _current.at_step(step)


@contextlib.contextmanager
def heartbeat(run_dir: Path | None, rank: int, world_size: int) -> Iterator[Heartbeat | None]:
    """This process's heartbeat in ``run_dir/ranks/`` while inside (None and nothing written without a
    run directory, or inside another one). Rank 0 removes the files of ranks at or above
    ``world_size`` (an earlier session with more ranks)."""
    global _current
    if run_dir is None or _current is not None:
        yield None
        return
    try:
        hb = Heartbeat(Path(run_dir), rank, world_size).start()
    except (OSError, UsageError):
        yield None  # a run directory that cannot be written: the Recorder says so
        return
    _current = hb
    try:
        yield hb
    finally:
        _current = None
        hb.close()


def _remove_extra(folder: Path, world_size: int) -> None:
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        stem = name.removesuffix(".json")
        if stem.isdigit() and name.endswith(".json") and int(stem) >= world_size:
            with contextlib.suppress(OSError):
                (folder / name).unlink()
