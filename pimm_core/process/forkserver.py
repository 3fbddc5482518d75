"""Multiprocessing's fork server, started so that a stop signal meant for the processes it forks
never kills it.

A fork server is a fresh interpreter (``exec``, only the file descriptors multiprocessing
passes) that imports its preload modules once and then forks a child per request, so each
child starts with those modules imported. pimm uses one in the launcher for the ranks
(:mod:`pimm_core.launch.rank_start`) and one in each rank for its DataLoader workers
(:mod:`pimm_core.data.workers`).

The launcher, which has imported torch already, starts the ranks' server as a fork of itself
instead (:func:`start` with ``fork_this``): a fresh interpreter would import torch a second time,
about 2 CPU-s and as many seconds of wall time before the first rank can start. The fork is made
to look like that fresh interpreter to the ranks (:func:`_become_fresh`).

Both are started with the stop signals blocked, a mask the server and its children inherit
(the children unblock what they handle): torchrun stops a rank with ``killpg``, a terminal's
Ctrl-C reaches the whole foreground process group, and a scheduler signals every process of a
job step. A fork server killed by that signal would take its children with it (they die with
their parent) while they are still stopping cleanly.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import weakref
from multiprocessing import connection

#: The signals a run stops on; a fork server never acts on them.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                     if hasattr(signal, name))


def start(preload: list[str], *, fork_this: bool = False) -> None:
    """Start this process's fork server (multiprocessing's, for the ``"forkserver"`` context) if it is
    not running, importing ``preload`` (module names) once, with :data:`STOP_SIGNALS` blocked in it.

    ``preload`` has no effect on a server already running (:func:`stop` it first for a fresh one).
    A module of ``preload`` that fails to import is skipped by the server (multiprocessing's rule):
    the children then import it themselves.

    With ``fork_this``, the server is a fork of this process, which keeps what it has imported
    (see :func:`_become_fresh` for what it does not keep), where that is safe: on Linux, with no
    Python thread but this one (:func:`_one_thread`), and no user code imported (:func:`user_modules`).
    Elsewhere it is a fresh interpreter, as without.

    Raises:
        OSError: the server's socket could not be made (a path under ``$TMPDIR`` too long for one).
    """
    _with_signals_blocked(preload, lambda: (fork_this and _fork_server(preload))
                          or multiprocessing.forkserver.ensure_running())


def fork(preload: list[str]) -> bool:
    """Start this process's fork server as a fork of it, as :func:`start` with ``fork_this`` does,
    if that is safe now; else start nothing. True if it was started so (False also if one runs).

    For a process that will import what must not be in the server later (the launcher, before it
    imports the config's user code to check it). The server imports ``preload`` at once, then waits
    for :func:`preload_more` (or this process's :func:`stop`, or its exit) before it serves a child.

    Raises:
        OSError: the server's socket could not be made.
    """
    return bool(_with_signals_blocked(preload, lambda: _fork_server(preload, wait_for_more=True)))


#: The write end of the pipe a server started by :func:`fork` reads more preload names from.
_more_fd: int | None = None


def preload_more(names: list[str]) -> None:
    """Have the server :func:`fork` started import ``names`` (modules; one that fails to import is
    skipped) besides its ``preload``, and then serve. No effect without such a server waiting."""
    global _more_fd
    if _more_fd is None:
        return
    fd, _more_fd = _more_fd, None
    with os.fdopen(fd, "wb") as pipe:  # (the server reads to the end: more than a pipe's buffer is fine)
        pipe.write(json.dumps(names).encode())


def _with_signals_blocked(preload: list[str], start_server):
    """``start_server()`` with :data:`STOP_SIGNALS` blocked and ``preload`` set; its value."""
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
        return start_server()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def can_stop() -> bool:
    """This Python can stop its fork server (CPython's ``ForkServer._stop``, 3.8 on)."""
    return callable(getattr(multiprocessing.forkserver._forkserver, "_stop", None))


def stop() -> None:
    """Stop this process's fork server if it runs (its children live on; a later :func:`start`
    starts a fresh one, with the environment of that moment)."""
    preload_more([])  # (a server still waiting for more names serves nothing: it reads them first)
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


def _one_thread() -> bool:
    """No Python thread runs but this one, on Linux (where pimm forks ranks from a server).

    Threads of native libraries may run: numpy's OpenBLAS starts its pool at import, as torch's
    intra-op pool does at the first parallel operation. Those libraries make themselves safe to fork
    (``pthread_atfork``), as PyTorch's own DataLoader relies on when it forks workers (its default
    on Linux). A Python thread could hold a lock of the interpreter's or of pimm's at the fork.
    """
    import threading

    return sys.platform == "linux" and threading.active_count() == 1


_OURS = ("pimm", "pimm_core", "pimm_tui")
_SITE_HOOKS = ("sitecustomize", "usercustomize")


def _kind(name: str, module: object) -> str:
    """``"installed"`` (the interpreter's own, or a package installed in it: its ``__file__`` under
    ``sys.prefix``/``base_prefix``), ``"ours"`` (pimm's packages), ``"site"`` (a site hook) or
    ``"user"`` (any other module loaded from a file: code outside the installation)."""
    path = getattr(module, "__file__", None)
    main = name in ("__main__", "__mp_main__") or module is sys.modules.get("__main__")
    if not isinstance(path, str) or not os.path.isabs(path) or main:
        # (built-in, frozen or namespace modules, torch.ops' names; the launcher's script, also under the name
        # `import multiprocessing` gives it, __mp_main__: `python -m pimm_core.cli` from a source checkout. In a
        # rank forked from the launcher's server, __main__ is the rank's script and __mp_main__ still the
        # launcher's, which every rank has: not the user code this rule keeps out of a server)
        return "installed"
    if name.split(".", 1)[0] in _OURS:
        return "ours"
    if name in _SITE_HOOKS:
        return "site"
    path = os.path.abspath(path)
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return "installed" if any(path.startswith(os.path.join(p, "")) for p in prefixes) else "user"


def user_modules() -> list[str]:
    """The modules this process imported from outside the interpreter's installation, pimm's and the
    site hooks aside: user code (a config's ``model.target``, say, which the launcher imports to check
    it). Sorted names; empty when there is none."""
    return sorted(name for name, module in list(sys.modules.items()) if _kind(name, module) == "user")


def installed_since(before: set[str]) -> list[str]:
    """The modules imported since ``before`` (names in ``sys.modules`` then) from installed packages
    (``site-packages``: transformers, timm, ...; not the standard library, pimm or user code), in the
    order they were imported; none while a Python thread runs besides this one (one of them may have
    started it: a server that imports them could then fork a child with a lock held)."""
    import sysconfig

    if not _one_thread():
        return []
    sites = {os.path.join(sysconfig.get_paths()[key], "") for key in ("purelib", "platlib")}
    return [name for name, module in list(sys.modules.items())
            if name not in before and _kind(name, module) == "installed"
            and os.path.abspath(getattr(module, "__file__", None) or "/").startswith(tuple(sites))]


def _fork_server(preload: list[str], wait_for_more: bool = False) -> bool:
    """Start multiprocessing's fork server as a fork of this process, as ``ensure_running`` starts it
    by ``exec`` (the same socket, "alive" pipe and bookkeeping). False, starting nothing, where a
    fork is not safe (another thread could hold a lock the fork would copy held), where this process
    has imported user code (:func:`user_modules`), or where a server runs.

    User code is never inherited: a module that read the environment at import (``LOCAL_RANK``)
    would hold the launcher's values in every child. Nor can it be forgotten and imported again in
    the child, as pimm's modules are: installed libraries keep what it registered with them at import
    (``torch.serialization.add_safe_globals``, pytree nodes, ``AutoConfig.register``), so the child
    would hold two classes of one name, one of them stale, or fail on a second registration.

    ``wait_for_more``: the server first reads a JSON list of more modules to preload from a pipe
    (:func:`preload_more`; end of file: none)."""
    global _more_fd
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is not None or not _one_thread() or user_modules():
        return False
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        more_r, more_w = os.pipe() if wait_for_more else (-1, -1)
        pid = os.fork()
        if pid == 0:  # the server: it never returns from here
            code = 1
            try:
                os.close(alive_w)
                if more_w >= 0:
                    os.close(more_w)
                _become_fresh(keep=(listener.fileno(), alive_r, more_r))
                if more_r >= 0:  # preload while the parent goes on, then what it names
                    _import_quietly(preload)
                    with os.fdopen(more_r, "rb") as pipe:
                        _import_quietly(json.loads(pipe.read() or b"[]"))
                multiprocessing.forkserver.main(listener.fileno(), alive_r, preload)
            except SystemExit:  # (its way out: the last holder of the "alive" pipe is gone)
                code = 0
            finally:
                os._exit(code)
        os.close(alive_r)
        if more_r >= 0:
            os.close(more_r)
            _more_fd = more_w
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return True


def _import_quietly(names: list[str]) -> None:
    """Import ``names`` in order, skipping any that fails however it fails (multiprocessing's preload
    skips only an ``ImportError``, and any other error would end the server), with no warning shown:
    the process that asked imported them already, and said what they say."""
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001  (a child imports it again itself, and sees the error there)
                pass


def _become_fresh(keep: tuple[int, ...]) -> None:
    """In a forked server: drop what the process it was forked from holds that a fresh interpreter
    would not, so that the children it forks (the ranks) start as they would from one.

    - open files: every descriptor but stdio and ``keep`` now refers to ``/dev/null`` (not closed:
      a Python object of the parent's that closes its descriptor later must not close another file
      that reused the number), so a child holds no lock, socket or pipe of the parent's;
    - signal handlers set from Python go back to the defaults (``SIGINT``: ``KeyboardInterrupt``);
    - ``weakref.finalize`` callbacks are dropped (a ``TemporaryDirectory`` of the parent's would be
      removed at a child's exit);
    - pimm's modules, which may have read the parent's environment at import (``faults`` reads
      ``RANK``) or hold its state, are forgotten, with the exit functions they registered, so a child
      imports them again with its own (pimm registers nothing with other libraries at import, which
      would outlive this, but ``pools``' fork hook: the forgotten module's hook only forgets the
      forgotten module's pools); ``sitecustomize`` and ``usercustomize`` are forgotten and run again, as at a
      start. Installed packages stay, with their exit functions (torch's). User code is not here at all
      (:func:`_fork_server` does not fork a process that imported it).
    """
    with open(os.devnull, "rb") as null:
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            if fd > 2 and fd not in keep and fd != null.fileno():
                try:
                    os.dup2(null.fileno(), fd)
                except OSError:
                    pass  # (the listing's own descriptor, closed since)
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        finalizer.detach()
    forgotten = []
    for name, module in list(sys.modules.items()):
        if _kind(name, module) in ("ours", "site"):
            del sys.modules[name]
            forgotten.append(name)
            for value in list(vars(module).values()):
                if callable(value) and getattr(value, "__module__", None) == name:
                    atexit.unregister(value)
    for name in _SITE_HOOKS:
        if name in forgotten:
            __import__(name)
