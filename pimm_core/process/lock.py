"""One writer per run directory, and ranks that never outlive their launcher.

Two OS-level ``flock`` files in the run directory. The kernel releases a ``flock`` when the
last process holding it dies, even by ``kill -9``, so a stale lock never blocks a resume.

- ``<run>/.lock``, exclusive (:class:`RunLock`): held for the whole run by whoever started
  it: a one-node ``pimm launch --nproc-per-node`` process (the launcher, :class:`LauncherLock`),
  else rank 0 (one process; an external torchrun/srun; a multi-node ``pimm launch``, whose
  launchers, one per node, only check it before the rendezvous, allowing for each other's
  checks: :meth:`LauncherLock.acquire`). Who holds it (host, pid, start time) is
  written to ``<run>/lock.json`` for the refusal message.
- ``<run>/.ranks.lock``, shared: every rank of a one-node ``pimm launch --nproc-per-node``
  holds it while it trains (:func:`hold_run`). Its DataLoader workers start from a fork
  server (:mod:`pimm_core.data.workers`) and inherit no file of it; with
  ``data.multiprocessing_context = "fork"`` they share the open file until they exit.

:meth:`RunLock.acquire` takes ``.lock`` and then checks that nobody holds ``.ranks.lock``, so
a new launch (or ``--train.resume``) is refused with one ``... is in use by ...`` line while
the old launcher or any of its ranks is alive, and is
accepted as soon as all of them are gone.

A rank of ``pimm launch --nproc-per-node`` dies with its launcher (:func:`follow_launcher`):
the launcher passes its pid in ``$PIMM_LAUNCHER_PID`` and each rank asks the kernel for
SIGKILL when its parent dies (:func:`die_with_parent`: Linux ``prctl(PR_SET_PDEATHSIG)``;
torchrun starts the ranks from the launcher's main thread, so the signal comes when the
launcher process ends). A killed launcher takes its ranks at once, mid-step or mid-save,
so none writes another checkpoint (an interrupted save leaves only a ``*.tmp`` leftover,
which the next start handles). Every DataLoader worker dies with its rank too
(``data.init_worker``): PyTorch's own watchdog starts too late to catch a rank killed
while the worker starts, and such a worker would wait forever. Ranks of
an external torchrun/srun and a single-process launch have no ``$PIMM_LAUNCHER_PID`` and
do not follow their parent.

Torch-free.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from filelock import FileLock, Timeout

from ..errors import UsageError
from ..fsio import atomic_write_bytes
from ..run import now_iso, read_json, read_run_status
from ..run.pids import pid_alive as _alive
from ..run.entries import HOLDER, LOCK, RANKS, check_entry, check_run_entries, writable_error
from .shell import command

LAUNCHER_ENV = "PIMM_LAUNCHER_PID"  # set by LauncherLock for the ranks a launcher starts
LAUNCHER_HOLDS_ENV = "PIMM_LAUNCHER_HOLDS_LOCK"  # set when that launcher holds .lock (one node)

_PR_SET_PDEATHSIG = 1


class RunLock:
    """Exclusive, non-blocking lock of a run directory (``.lock``, checked against ``.ranks.lock``).

    Raises (from :meth:`acquire`):
        UsageError: another live process holds it, or ranks of an earlier launch are still
            alive; the message names host and pid.
    """

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._lock = FileLock(str(self.run_dir / LOCK))

    def acquire(self) -> "RunLock":
        if self._lock.is_locked:
            return self  # already held by this object (``with`` on an acquired lock)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise writable_error(self.run_dir, e) from None
        # Every writer of the run passes here first: nothing it writes may lead outside the run
        # (a link), be the wrong kind of entry, or sit in a directory it cannot write.
        check_run_entries(self.run_dir)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise UsageError(_in_use(self.run_dir, _holder(self.run_dir) or "pid ? on host ? (since ?)")) from None
        except OSError as e:  # read-only, no permission; (a link appearing since the check: refused too)
            check_entry(self.run_dir / LOCK, "file")
            raise writable_error(self.run_dir, e) from None
        if _ranks_alive(self.run_dir):
            self._lock.release()
            raise UsageError(_ranks_in_use(self.run_dir))
        try:
            atomic_write_bytes(self.run_dir / HOLDER, json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "since": now_iso(), "time": time.time()}).encode(), durable=False)
        except OSError as e:
            self._lock.release()
            raise writable_error(self.run_dir, e) from None
        return self

    def release(self) -> None:
        if self._lock.is_locked:
            (self.run_dir / HOLDER).unlink(missing_ok=True)
            self._lock.release()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class LauncherLock:
    """What ``pimm launch --nproc-per-node`` holds while its ranks run.

    :meth:`acquire` (call it first: it refuses a run in use) takes the :class:`RunLock`; on one
    node it is kept until :meth:`__exit__`, across several nodes (each with its own launcher) it
    is only checked and rank 0 takes it. Inside ``with``, ``$PIMM_LAUNCHER_PID`` (and, on one
    node, ``$PIMM_LAUNCHER_HOLDS_LOCK``) are set for the ranks to inherit.
    """

    #: seconds a multi-node launcher waits out another holder of ``.lock`` before refusing
    CHECK_PATIENCE = 5.0

    def __init__(self, run_dir: Path, *, single_node: bool):
        self.run_dir = Path(run_dir)
        self.single_node = single_node
        self._lock = RunLock(self.run_dir)

    def acquire(self) -> "LauncherLock":
        if self.single_node:
            self._lock.acquire()
        elif self.run_dir.is_dir():
            self._check_shared()
        return self

    def _check_shared(self) -> None:
        """Refuse a run in use, tolerating the other nodes' agents checking it at the same moment.

        Each node's agent of a multi-node launch checks the shared run directory by taking
        ``.lock`` (and probing ``.ranks.lock``) for an instant; two agents started together
        may find each other's check in progress, which lasts milliseconds. A holder still
        there after :attr:`CHECK_PATIENCE` seconds is a live run (its rank 0, or a one-node launch).
        """
        deadline = time.monotonic() + self.CHECK_PATIENCE
        while True:
            try:
                self._lock.acquire().release()
                return
            except UsageError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def __enter__(self) -> "LauncherLock":
        os.environ[LAUNCHER_ENV] = str(os.getpid())
        if self.single_node:
            os.environ[LAUNCHER_HOLDS_ENV] = "1"
        return self

    def __exit__(self, *exc: object) -> None:
        os.environ.pop(LAUNCHER_ENV, None)
        os.environ.pop(LAUNCHER_HOLDS_ENV, None)
        self._lock.release()


class _RanksLock:
    """A rank's shared lock on ``.ranks.lock``: held until closed or the process (and its forks) exit."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._fd: int | None = None

    def acquire(self) -> "_RanksLock":
        if self._fd is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            check_entry(self.run_dir / RANKS, "file")
            try:
                fd = os.open(self.run_dir / RANKS, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                check_entry(self.run_dir / RANKS, "file")
                raise writable_error(self.run_dir, e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # only RunLock.acquire's probe takes it exclusively, for an instant
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
        return self

    def release(self) -> None:
        # Close without LOCK_UN: a forked child that still has the file open keeps it locked.
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "_RanksLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def check_not_in_use(run_dir: Path) -> None:
    """Refuse a run directory another live process holds (its launch, or ranks of one), as
    :meth:`RunLock.acquire` would, without writing anything (a probe of the locks' files, read-only):
    what a launch would say later, said first where another refusal would point at a command the live
    run makes fail (``pimm resume`` of a run still training).

    Raises:
        UsageError: the run is in use; the message names the holder and how to stop it.
    """
    if _held(run_dir / LOCK):  # (filelock's lock: an flock of this file)
        raise UsageError(_in_use(run_dir, _holder(run_dir) or "pid ? on host ? (since ?)"))
    if _ranks_alive(run_dir):
        raise UsageError(_ranks_in_use(run_dir))


def _holder(run_dir: Path) -> str | None:
    holder = read_json(run_dir / HOLDER)
    if holder is None:
        return None
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {holder.get('since', '?')})"


def _in_use(run_dir: Path, who: str) -> str:
    # (read by `pimm launch`, `pimm resume` and the other writers: the second way out is a launch's alone)
    return (f"{run_dir} is in use by {who}; stop that run first "
            f"({command('stop', run_dir)}), or launch the new run under another --run.name")


def _ranks_in_use(run_dir: Path) -> str:
    status = read_run_status(run_dir)
    pids = [p for p in status.pids if status.host != socket.gethostname() or _alive(p)]
    ranks = f"ranks {', '.join(map(str, pids))}" if pids else "ranks"
    return _in_use(run_dir, f"processes of {_holder(run_dir) or 'an earlier launch'} that are still "
                            f"running ({ranks} or their DataLoader workers)")


def _ranks_alive(run_dir: Path) -> bool:
    """True while some process holds ``.ranks.lock`` (a rank of a launch, or one of its workers)."""
    return _held(run_dir / RANKS)


def _held(path: Path) -> bool:
    """True while another process holds an flock on ``path``: a probe that creates and writes nothing
    (no file, or a link, or a file system without flock: not held; RunLock alone guards the run then)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # also drops the probe's exclusive lock
    return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # a file system without flock: RunLock alone guards the run
    finally:
        os.close(fd)  # also drops the probe's exclusive lock
    return False


def hold_run(run_dir: Path, is_main: bool):
    """Take what this rank holds while it trains; returns it, acquired, as a context manager.

    Under a one-node ``pimm launch --nproc-per-node`` every rank holds ``.ranks.lock``
    shared (the launcher holds ``.lock``); otherwise rank 0 holds ``.lock`` and the other
    ranks hold nothing.

    Raises:
        UsageError: (rank 0 without a pimm launcher) the run is in use.
    """
    if os.environ.get(LAUNCHER_HOLDS_ENV):
        return _RanksLock(run_dir).acquire()
    if is_main:
        return RunLock(run_dir).acquire()
    return contextlib.nullcontext()


def launcher_pid() -> int | None:
    """The process of the ``pimm launch`` that started this rank (torchrun's agent), if one did."""
    value = os.environ.get(LAUNCHER_ENV)
    return int(value) if value and value.isdigit() else None


def follow_launcher() -> None:
    """Make this rank die with its ``pimm launch`` process (a no-op without ``$PIMM_LAUNCHER_PID``)."""
    value = os.environ.get(LAUNCHER_ENV)
    if value:
        die_with_parent(int(value))


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent``, the process that started it, dies; at once if it already has.

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (the kernel sends it when the thread that
    started this process ends: the ranks and DataLoader workers here are started by their
    parent's main thread). Elsewhere, if prctl fails, or if something stands between
    ``parent`` and this process, a daemon thread that checks once a second.
    """
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() == parent and armed:
        return
    if os.getppid() != parent and not _alive(parent):
        os.kill(os.getpid(), signal.SIGKILL)  # the parent died before the kernel was asked
    threading.Thread(target=_watch, args=(parent,), name="pimm-die-with-parent", daemon=True).start()


def claimed_since(run_dir: Path) -> float | None:
    """When the launch now holding ``run_dir`` claimed it (``lock.json``'s ``time``, UNIX seconds), if
    that launch is alive (on another host: taken as alive); else None."""
    from datetime import datetime

    holder = read_json(Path(run_dir) / HOLDER)
    if not isinstance(holder, dict):
        return None
    if holder.get("host") == socket.gethostname() and not (isinstance(holder.get("pid"), int) and _alive(holder["pid"])):
        return None
    if isinstance(holder.get("time"), (int, float)):
        return float(holder["time"])
    try:  # (an older launcher's lock.json: whole seconds; the next one, so a request of that second is stale)
        return datetime.fromisoformat(str(holder.get("since"))).timestamp() + 1.0
    except ValueError:
        return None


def _watch(parent: int) -> None:
    while os.getppid() == parent or _alive(parent):
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
