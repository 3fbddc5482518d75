"""``ranks/<rank>.stack``: every rank's Python stack at a hang, and the frame each waits in (torch-free).

When a rank fails at a hang (a collective waited past ``dist.timeout``, or ``data.timeout``
passed without a batch), it writes its own stack (the frames of the error: where it waited) and
asks every other rank for theirs by writing ``ranks/stacks.request``. Each rank's heartbeat
thread (:mod:`.heartbeat`, alive while the training thread is blocked in a collective or in user
code) sees the request within a second and writes the training (main) thread's stack, then the
other threads', with :func:`traceback.format_stack` over :func:`sys._current_frames` (the same
frames ``faulthandler.dump_traceback`` prints, taken from Python so that the innermost one can be
named). The failing rank waits a few seconds for them (:func:`wait_for_stacks`) before it fails,
and its error line names each rank's waiting frame.

The file's first line is its header::

    # rank 1 pid 4242 host node3 at 1764650042.3 waits in /home/u/cb.py:12 in on_step_end

then the stacks, most recent call last. :func:`waiting_frame` picks the frame a rank waits in: the
innermost frame of its main thread outside torch and the standard library (the user's callback
that blocks, or pimm's line that called the collective). A rank whose main thread holds the GIL
in C code (a stuck extension) cannot answer: its file is missing, and the error line says so.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path

from ..fsio import atomic_write_bytes
from .jsonfile import read_json
from .ranks import RANKS_DIR

#: The request file the failing rank writes; its ``time`` tells the ranks it is a new one.
REQUEST = "stacks.request"
STACK_SUFFIX = ".stack"
#: The longest a failing rank waits for the others' stacks (seconds): a few heartbeat ticks.
WAIT_S = 6.0

_HEADER = "# rank {rank} pid {pid} host {host} at {time:.1f} waits in {frame}\n"
_LIBRARY_DIRS = tuple({os.path.realpath(p) + os.sep for p in (sysconfig.get_paths()["stdlib"],
                                                              sysconfig.get_paths()["platstdlib"])})


def stack_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / f"{rank}{STACK_SUFFIX}"


def _library_dirs() -> tuple[str, ...]:
    torch = sys.modules.get("torch")
    extra = (os.path.realpath(os.path.dirname(torch.__file__)) + os.sep,) if getattr(torch, "__file__", None) else ()
    return _LIBRARY_DIRS + extra


def waiting_frame(frames: traceback.StackSummary | list[traceback.FrameSummary]) -> str:
    """``file:line in function`` of the innermost frame outside torch and the standard library
    (the innermost frame when all are); ``"unknown"`` for no frames."""
    if not frames:
        return "unknown"
    libs = _library_dirs()
    chosen = next((f for f in reversed(frames) if not os.path.realpath(f.filename).startswith(libs)), frames[-1])
    return f"{chosen.filename}:{chosen.lineno} in {chosen.name}"


def write_stack(run_dir: Path, rank: int, main: list[traceback.FrameSummary] | traceback.StackSummary,
                *, title: str = "the main thread") -> str:
    """Write ``ranks/<rank>.stack``: the header naming the waiting frame of ``main`` (the main
    thread's frames, outermost first), ``main``, then every other thread's stack. Returns the
    waiting frame. Never raises (a diagnostic: a failed write is skipped)."""
    frame = waiting_frame(main)
    parts = [_HEADER.format(rank=rank, pid=os.getpid(), host=socket.gethostname(), time=time.time(), frame=frame),
             f"\n{title} (most recent call last):\n", *traceback.format_list(main)]
    names = {t.ident: t.name for t in threading.enumerate()}
    me, main_id = threading.get_ident(), threading.main_thread().ident
    for ident, top in sys._current_frames().items():
        if ident in (me, main_id):
            continue
        parts += [f"\nthread {names.get(ident, ident)} (most recent call last):\n", *traceback.format_stack(top)]
    path = stack_file(run_dir, rank)
    try:
        path.parent.mkdir(exist_ok=True)  # (a run whose heartbeat never started: ranks/ is not there yet)
        atomic_write_bytes(path, "".join(parts).encode(errors="replace"), durable=False)
    except OSError:
        pass
    return frame


def write_main_stack(run_dir: Path, rank: int) -> str:
    """From another thread: write this process's main thread's stack (:func:`write_stack`)."""
    top = sys._current_frames().get(threading.main_thread().ident)
    return write_stack(run_dir, rank, traceback.extract_stack(top) if top is not None else [])


def write_error_stack(run_dir: Path, rank: int, error: BaseException) -> str | None:
    """Write the stack of ``error`` as this rank's (where it waited when the hang was found);
    returns its waiting frame (None: ``error`` has no traceback)."""
    if error.__traceback__ is None:
        return None
    return write_stack(run_dir, rank, traceback.extract_tb(error.__traceback__),
                       title=f"{type(error).__name__} raised where it waited")


def request_stacks(run_dir: Path) -> float:
    """Ask every rank of the run for its stack (``ranks/stacks.request``); returns the request's time."""
    now = time.time()
    try:
        atomic_write_bytes(Path(run_dir) / RANKS_DIR / REQUEST, json.dumps({"time": now}).encode(), durable=False)
    except OSError:
        pass
    return now


def pending_request(run_dir: Path, handled: float | None) -> float | None:
    """The time of a stack request newer than ``handled``, else None (one ``stat`` when there is none)."""
    path = Path(run_dir) / RANKS_DIR / REQUEST
    try:
        os.stat(path)
    except OSError:
        return None
    data = read_json(path)
    when = data.get("time") if isinstance(data, dict) else None
    if not isinstance(when, (int, float)) or (handled is not None and when <= handled):
        return None
    return float(when)


def read_stack_frame(run_dir: Path, rank: int, *, since: float | None = None) -> str | None:
    """The waiting frame in ``ranks/<rank>.stack``'s header (None: no such file, or one older than ``since``)."""
    path = stack_file(run_dir, rank)
    try:
        if since is not None and os.stat(path).st_mtime < since - 1.0:
            return None
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.readline(4096)
    except OSError:
        return None
    _, sep, frame = head.rstrip("\n").partition(" waits in ")
    return frame if sep and head.startswith("# rank ") else None


def wait_for_stacks(run_dir: Path, ranks: list[int], since: float, timeout: float | None = None) -> dict[int, str]:
    """``{rank: waiting frame}`` of the ``ranks`` whose stack files were written since ``since``,
    once all are there or after ``timeout`` seconds (default :data:`WAIT_S`)."""
    deadline = time.monotonic() + (WAIT_S if timeout is None else timeout)
    while True:
        got = {r: f for r in ranks if (f := read_stack_frame(run_dir, r, since=since)) is not None}
        if len(got) == len(ranks) or time.monotonic() >= deadline:
            return got
        time.sleep(0.1)
