"""Stop requests: signals, ``request(reason)`` from any thread, and the ``control/stop`` file.

A stop is a transparent pause: the trainer finishes the current accumulation
window, every rank agrees on the flag (an all-reduce in the training loop), ``last``
is saved, the final evaluation is skipped, and ``train()`` returns with
``state.stop_reason`` set. Signal handlers only set a flag; all saving and
communication happen in the training loop.

A training process catches the stop signals (:data:`STOP_SIGNALS`: SIGINT, SIGTERM and
SIGHUP, the terminal closing; inside a Slurm job SIGUSR1 too, :func:`default_signals`;
``train.stop_signals`` names others, e.g. the SIGUSR2 a scheduler sends before its time limit)
from its very start (:func:`stop_signals`, entered by
``pimm launch``/``pimm resume`` before anything is imported or written), so a stop asked
during start-up is kept and honoured: before the first step the run ends cleanly with
the stop recorded and nothing saved; later, at the next step boundary.

This module is torch-free: ``pimm stop`` and the console use :func:`write_stop_file`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ..fsio import atomic_write_bytes
from ..run.entries import STOP_FILE, check_entry, ensure_dir, writable_error
from ..run.jsonfile import read_json
from ..run.layout import CONTROL

#: The signals a training process turns into a clean stop by default (``train.stop_signals``).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: The environment variable naming the stop signals of a rank started by ``pimm launch
#: --nproc-per-node`` (comma-separated): its ranks catch them from their very start.
SIGNALS_ENV = "PIMM_STOP_SIGNALS"

_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def parse_signals(names: list[str] | tuple[str, ...]) -> tuple[signal.Signals, ...]:
    """The signals named by ``names`` ("SIGUSR1" or "USR1", any case), in order, without repeats.

    Raises:
        ValueError: a name that is not a signal, or SIGKILL/SIGSTOP (no process can catch
            them); the message names it and the fix.
    """
    out: list[signal.Signals] = []
    for name in names:
        text = str(name).strip().upper()
        text = text if text.startswith("SIG") else "SIG" + text
        sig = getattr(signal.Signals, text, None) if text.isidentifier() else None
        if sig is None:
            raise ValueError(f"{name!r} is not a signal name; write e.g. \"SIGUSR1\"")
        if sig in _UNCATCHABLE:
            raise ValueError(f"{sig.name} cannot be caught by any process; use e.g. \"SIGUSR1\" or \"SIGTERM\"")
        if sig not in out:
            out.append(sig)
    return tuple(out)


#: The environment variable that says the process runs inside a Slurm job.
SLURM_JOB_ENV = "SLURM_JOB_ID"


def default_signals() -> tuple[signal.Signals, ...]:
    """:data:`STOP_SIGNALS`, and inside a Slurm job (``$SLURM_JOB_ID`` set) SIGUSR1 too: the signal
    ``sbatch --signal=B:USR1@N`` sends before the time limit. Its default action ends the
    process at once, nothing saved; as a stop signal, the run saves ``last`` and stops cleanly (and
    ``train.requeue`` left unset requeues the job: :mod:`pimm_core.launch.requeue`)."""
    return (*STOP_SIGNALS, signal.SIGUSR1) if os.environ.get(SLURM_JOB_ENV) else STOP_SIGNALS


def configured_signals(names: list[str] | tuple[str, ...]) -> tuple[signal.Signals, ...]:
    """The stop signals of ``train.stop_signals`` = ``names``: as named, except that the default list
    (SIGINT, SIGTERM, SIGHUP, not set otherwise) means :func:`default_signals` (SIGUSR1 added
    inside a Slurm job).

    Raises:
        ValueError: as :func:`parse_signals`.
    """
    signals = parse_signals(names)
    return default_signals() if signals == STOP_SIGNALS else signals


def signals_from_env() -> tuple[signal.Signals, ...]:
    """:data:`SIGNALS_ENV`'s signals (set by the launcher for its ranks), else :func:`default_signals`."""
    text = os.environ.get(SIGNALS_ENV, "")
    try:
        return parse_signals([n for n in text.split(",") if n.strip()]) or default_signals()
    except ValueError:
        return default_signals()


def stop_file(run_dir: Path) -> Path:
    return Path(run_dir) / CONTROL / STOP_FILE


def write_stop_file(run_dir: Path, reason: str = "operator") -> Path:
    """Ask the trainer of ``run_dir`` to stop by writing ``control/stop`` atomically.

    The file holds ``{"reason": ..., "time": UNIX seconds, "pid": writer pid}``. Rank 0
    polls it at accumulation-window boundaries (at most every ``poll_interval`` seconds).

    Returns:
        The path written.

    Raises:
        RunEntryError: ``control`` is a link or a file, ``control/stop`` a link or a directory, or the
            run directory cannot be written (one line naming the path).
    """
    path = stop_file(run_dir)
    hint = "ask from an account that can write it"
    ensure_dir(path.parent, hint=hint)
    check_entry(path, "file")
    try:
        atomic_write_bytes(path, json.dumps({"reason": reason, "time": time.time(), "pid": os.getpid()}).encode())
    except OSError as e:
        check_entry(path, "file")
        raise writable_error(path.parent, e, hint=hint) from None
    return path


def read_stop_file(run_dir: Path) -> dict | None:
    """The pending stop request of ``run_dir``, or None; a request file that cannot be read
    (torn, not JSON) still asks for a stop, by the operator."""
    data = read_json(stop_file(run_dir))
    if data is not None:
        return data
    return {"reason": "operator", "time": 0.0} if stop_file(run_dir).exists() else None


class StopRequest:
    """A thread-safe stop flag with a reason.

    ``request(reason)`` may be called from any thread, a callback or a signal
    handler; the first reason wins. The trainer reads :attr:`reason` at each
    accumulation-window boundary and spreads it to every rank.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._cause: Exception | None = None
        self._caught: tuple[dict, object] | None = None  # inside catch_signals: (previous handlers, handler)

    def request(self, reason: str = "requested", *, cause: Exception | None = None) -> None:
        """Ask the run to stop at the next accumulation-window boundary.

        Args:
            reason: the text recorded as the run's ``stop_reason``.
            cause: the error that makes this stop a failure (a failed checkpoint save),
                None for a pause.
        """
        with self._lock:
            if self._reason is None:
                self._reason, self._cause = reason, cause

    @property
    def requested(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> str | None:
        return self._reason

    @property
    def cause(self) -> Exception | None:
        """The error the winning request named (``request(..., cause=)``), or None."""
        return self._cause

    def clear(self) -> None:
        with self._lock:
            self._reason = self._cause = None

    @contextlib.contextmanager
    def catch_signals(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator["StopRequest"]:
        """Handle ``signals`` by requesting a stop (reason ``signal:<NAME>``) while inside.

        Must be entered in the main thread (a Python rule for signal handlers). The
        previous handlers are restored on exit.
        """
        previous = {}

        def handler(signum: int, _frame: object) -> None:
            self.request(f"signal:{signal.Signals(signum).name}")

        for sig in signals:
            previous[sig] = signal.signal(sig, handler)
        _ever_caught.update(signals)
        self._caught = (previous, handler)
        try:
            yield self
        finally:
            self._caught = None
            for sig, old in previous.items():
                signal.signal(sig, old)

    def catch_only(self, signals: tuple[signal.Signals, ...]) -> None:
        """Inside :meth:`catch_signals` (main thread): catch exactly ``signals`` from now on (the
        configured ``train.stop_signals``, known once the config is read); a signal no longer
        named gets its previous handler back. Outside :meth:`catch_signals`: nothing."""
        caught = self._caught
        if caught is None:
            return
        previous, handler = caught
        for sig in [s for s in previous if s not in signals]:
            signal.signal(sig, previous.pop(sig))
        for sig in signals:
            if sig not in previous:
                previous[sig] = signal.signal(sig, handler)
        _ever_caught.update(signals)

    def handle_with(self, handler: Callable[[int, Any], None] | None) -> None:
        """Inside :meth:`catch_signals` (main thread): handle the signals caught from now on with
        ``handler`` (which should :meth:`request` the stop too), or again with the request alone
        (None); their previous handlers still come back on exit. Outside: nothing."""
        if self._caught is not None:
            previous, own = self._caught
            for sig in previous:
                signal.signal(sig, own if handler is None else handler)


_ever_caught: set[signal.Signals] = set()


def caught_signals() -> set[signal.Signals]:
    """Every signal this process has turned into a stop request (:data:`STOP_SIGNALS` at least):
    the console script ignores them while the interpreter exits."""
    return {*STOP_SIGNALS, *_ever_caught}


_active: StopRequest | None = None


@contextlib.contextmanager
def stop_signals() -> Iterator[StopRequest]:
    """The process's stop request, with the stop signals turned into it while inside
    (:data:`SIGNALS_ENV`'s when set, else :data:`STOP_SIGNALS`; :meth:`StopRequest.catch_only`
    changes them once the config names its own).

    Re-entrant: inside an outer ``with stop_signals()`` it yields the same request (a
    signal caught by the outer one, during start-up, is kept for the trainer). Must be
    entered in the main thread; the previous handlers are restored when the outermost exits.
    """
    global _active
    if _active is not None:
        yield _active
        return
    stop = StopRequest()
    with stop.catch_signals(signals_from_env()):
        _active = stop
        try:
            yield stop
        finally:
            _active = None
