"""Multiprocessing's fork server, started so that a stop signal meant for the processes it forks
never kills it.

A fork server is a fresh interpreter (``exec``, only the file descriptors multiprocessing
passes) that imports its preload modules once and then forks a child per request, so each
child starts with those modules imported. pimm uses one in the launcher for the ranks
(:mod:`pimm_core.launch.rank_start`) and one in each rank for its DataLoader workers
(:mod:`pimm_core.data.workers`).

Both are started with the stop signals blocked, a mask the server and its children inherit
(the children unblock what they handle): torchrun stops a rank with ``killpg``, a terminal's
Ctrl-C reaches the whole foreground process group, and a scheduler signals every process of a
job step. A fork server killed by that signal would take its children with it (they die with
their parent) while they are still stopping cleanly.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal

#: The signals a run stops on; a fork server never acts on them.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                     if hasattr(signal, name))


def start(preload: list[str]) -> None:
    """Start this process's fork server (multiprocessing's, for the ``"forkserver"`` context) if it is
    not running, importing ``preload`` (module names) once, with :data:`STOP_SIGNALS` blocked in it.

    ``preload`` has no effect on a server already running (:func:`stop` it first for a fresh one).
    A module of ``preload`` that fails to import is skipped by the server (multiprocessing's rule):
    the children then import it themselves.
    """
    # The mask of the calling thread is inherited through fork and exec; blocking here (not
    # ignoring) loses nothing: a stop signal that arrives meanwhile is delivered to this
    # process when the mask is restored.
    multiprocessing.set_forkserver_preload(preload)
    # The fork server's start first starts multiprocessing's resource tracker, which blocks SIGINT
    # and SIGTERM around its own spawn and then UNBLOCKS them (not restores): inside the block
    # below, that left the fork server (and every child it forks) killable by the SIGTERM torchrun
    # or a scheduler sends to the whole process group. Started first, here, the tracker is already
    # running below.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def can_stop() -> bool:
    """This Python can stop its fork server (CPython's ``ForkServer._stop``, 3.8 on)."""
    return callable(getattr(multiprocessing.forkserver._forkserver, "_stop", None))


def stop() -> None:
    """Stop this process's fork server if it runs (its children live on; a later :func:`start`
    starts a fresh one, with the environment of that moment)."""
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None and can_stop():
        server._stop()


def leave_parent_server() -> None:
    """In a child of a fork server: give up the child's hold on that server, so that it exits with
    the process that started it and not with its last child.

    multiprocessing hands every child the write end of its server's "alive" pipe (so a child
    could ask the same server for children of its own); the server exits when every holder has
    closed it. A child that keeps it (a frozen rank, say) keeps the server alive after the
    launcher died, and the server's children die with the server (``PR_SET_PDEATHSIG``), not with
    the launcher. After this call, this process starts a fresh server of its own when it needs one.
    """
    server = multiprocessing.forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None and getattr(server, "_forkserver_pid", None) is None:  # (inherited, not its own server's)
        os.close(fd)
        server._forkserver_alive_fd = None
        server._forkserver_address = None
