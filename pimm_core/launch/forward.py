"""A multi-node agent's stop signals: passed on to its ranks, which stop with the others'.

On one node torchrun's own handling is kept: its agent turns SIGINT/SIGTERM into an
exception, stops its ranks (they save ``last`` and exit 0) and returns at once. With
several agents that return skips torchrun's exit barrier, the point where every node's
agent waits for the others to finish: the agents of the other nodes, whose ranks stopped
just as cleanly, then wait there for 300 s or fail with a lost store connection (a
traceback and C++ warnings on their terminal). So a multi-node agent handles the two
signals (and the other ``train.stop_signals`` but SIGHUP, e.g. a scheduler's SIGUSR1) itself: it sends them on to its ranks (which agree on the stop step with every
other rank and save ``last``) and keeps running as torchrun's agent, so every agent ends
as after a finished run. A rank that has not stopped after the shutdown timeout is killed,
as torchrun would.

Linux only (the ranks are found through ``/proc``); elsewhere torchrun's handling stays.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_TORCHRUN_HANDLES = (signal.SIGHUP, signal.SIGQUIT)  # TORCHRUN_ARGS: torchrun's own handling


class SignalForwarder:
    """Inside ``with``: SIGINT/SIGTERM and the ``extra`` stop signals reach this agent's ranks
    instead of torchrun's handler (give torchrun :attr:`TORCHRUN_ARGS`, so that it leaves them alone).

    Args:
        shutdown_timeout: seconds the ranks have to stop after the first signal; then SIGKILL.
        extra: further signals the ranks stop on (``train.stop_signals``; SIGHUP and SIGQUIT
            stay torchrun's).

    Attributes:
        received: the first stop signal forwarded, or None.

    A signal that comes before any rank exists (during the rendezvous) raises torchrun's
    ``SignalException``, as torchrun's own handler does.
    """

    #: torchrun installs its handler only for the signals named here (its default adds SIGTERM, SIGINT)
    TORCHRUN_ARGS = ["--signals-to-handle", "SIGHUP,SIGQUIT"]

    def __init__(self, shutdown_timeout: float, extra: tuple[signal.Signals, ...] = ()):
        self.shutdown_timeout = shutdown_timeout
        self.signals = _STOP_SIGNALS + tuple(s for s in extra if s not in _STOP_SIGNALS + _TORCHRUN_HANDLES)
        self.received: signal.Signals | None = None
        self._previous: dict[int, object] = {}
        self._done = threading.Event()

    @staticmethod
    def available() -> bool:
        return Path("/proc/self/stat").exists()

    def __enter__(self) -> "SignalForwarder":
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.signals}
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        sig = signal.Signals(signum)
        ranks = rank_processes()
        if not ranks and self.received is None:
            from torch.distributed.elastic.multiprocessing.api import SignalException

            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
        if self.received is None:
            self.received = sig
            threading.Thread(target=self._kill_late, name="pimm-stop-timeout", daemon=True).start()
        for pid in ranks:  # a repeated signal changes nothing in a stopping rank
            _send(pid, sig)

    def _kill_late(self) -> None:
        if self._done.wait(self.shutdown_timeout):
            return  # torchrun's agent has returned: the ranks are gone
        for pid in rank_processes():
            _send(pid, signal.SIGKILL)


def live_processes() -> list[tuple[int, int, int]]:
    """``(pid, ppid, session id)`` of every live (non-zombie) process, from ``/proc/<pid>/stat``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state ppid pgrp session ...
        if fields[0] != "Z":
            out.append((int(entry), int(fields[1]), int(fields[3])))
    return out


def rank_processes(parent: int | None = None) -> list[int]:
    """The live ranks started by this agent: the processes that lead their own session (torchrun
    starts each rank with ``start_new_session``; a forked rank calls ``setsid``) among its children
    and the children of its children that do not (forked ranks are children of its fork server,
    see rank_start.py)."""
    parent = os.getpid() if parent is None else parent
    procs = live_processes()
    servers = {pid for pid, ppid, sid in procs if ppid == parent and sid != pid}  # (not a rank: the fork server)
    return [pid for pid, ppid, sid in procs if sid == pid and (ppid == parent or ppid in servers)]


def _send(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # it has just exited
