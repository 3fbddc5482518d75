"""Where DataLoader workers come from: a clean process, never a fork of a busy rank.

A rank is multi-threaded: pimm's own threads (the purge of ``last.prev``, async saves,
hashing while writing), torch's (gloo, autograd, intra-op pools) and whatever the user's
code starts. ``fork()`` copies only the calling thread; a lock another thread held at that
instant stays held forever in the child. CPython itself takes such a lock whenever a native
thread enters Python (``PyGILState_Ensure`` creates a thread state under the runtime's
``HEAD_LOCK``), and a child forked then deadlocks in ``PyOS_AfterFork_Child`` before it runs
a line: a DataLoader that forks its workers at every epoch start hangs the run, with no
error and no timeout (seen: a 2-rank digits run stuck at epoch 11; issue #28). CPython 3.12
warns about forking a multi-threaded process and 3.14 makes ``forkserver`` the default
start method on Linux for this reason.

pimm therefore starts DataLoader workers with ``data.multiprocessing_context`` (PyTorch's
DataLoader argument of that name), ``"forkserver"`` by default:

- The fork server is single-threaded and forks the workers on request. It has
  ``pimm_core.data.loaders`` (torch, numpy, torchdata) imported once, so a worker starts in
  milliseconds instead of importing torch at every epoch (``benchmarks/worker_start.py``
  measures the choices). A rank that will start workers forks it from itself at its start,
  before it runs any thread of its own (:func:`start_server_early`; torch imported there once, not
  again in the server), with every inherited file pointed at ``/dev/null``, so no run lock is held
  by it (:func:`pimm_core.process.forkserver.start`); else (and where the rank has imported user
  code, a config's target) it is a fresh interpreter started by ``exec`` (only the file descriptors
  multiprocessing passes).
- It is started with the stop signals (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2) blocked,
  a mask it and the workers it forks inherit: torchrun stops a rank with ``killpg`` and a
  scheduler signals every process of a job step, and a fork server killed by that signal
  would take the epoch's workers with it (their watchdog follows their parent) while the
  rank is still stopping cleanly. It exits by itself when the rank does (multiprocessing's
  "alive" pipe), and each worker dies with its rank (:func:`pimm_core.data.init_worker`).
- ``"spawn"`` starts each worker as a fresh interpreter (slower: torch is imported per
  worker per epoch); ``"fork"`` is PyTorch's Linux default and the old behaviour: fastest,
  and exposed to the hang above.

Datasets, collate functions and everything they hold are pickled to the workers under
``forkserver`` and ``spawn`` (as on macOS and Windows): a class defined in a script needs
the script's ``if __name__ == "__main__":`` guard, and a lambda or an open file handle in a
dataset cannot be sent (a one-line :class:`~pimm_core.errors.ConfigError` says so).
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading

from ..errors import ConfigError
from ..process import forkserver

#: What the fork server imports once so that each worker it forks has it already.
PRELOAD = ["pimm_core.data.loaders"]  # the module itself: the package imports nothing at import

_start_lock = threading.Lock()

#: Why a worker can fail while it starts: it imports the user's script (to find the classes
#: defined there) and the script's top level trains again.
MAIN_GUARD = ("a DataLoader worker imported the training script and it started training again: DataLoader workers "
              "import the script that trains (data.multiprocessing_context = 'forkserver' or 'spawn'), so put its "
              "training code under if __name__ == \"__main__\":")


def start_server_early(method: str, num_workers: int) -> None:
    """At a rank's start, before it starts threads: start its workers' fork server (``"forkserver"``
    with ``num_workers`` > 0; else nothing) as a fork of this process, which imports
    ``pimm_core.data.loaders`` (torch) first, what the rank would import anyway. The server then does not
    import torch again: about 2 CPU-s a rank. A server that cannot start here is left to
    :func:`worker_context`, which says why."""
    if method != "forkserver" or num_workers <= 0:
        return
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    with _start_lock:
        try:
            forkserver.start(PRELOAD, fork_this=True)
        except OSError:
            pass


def worker_context(method: str) -> multiprocessing.context.BaseContext:
    """The multiprocessing context DataLoader workers start from.

    Args:
        method: ``"forkserver"``, ``"spawn"`` or ``"fork"`` (``data.multiprocessing_context``).

    Returns:
        ``multiprocessing.get_context(method)``; for ``"forkserver"`` the server is running
        (started here the first time, preloaded and with the stop signals blocked), or, when
        it cannot start (its socket path under a long ``$TMPDIR``), the ``"spawn"`` context, with
        one warning.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # this is a worker importing the user's script as its __main__, and the script trains
        raise ConfigError(MAIN_GUARD)
    check_socket_dir()
    if method == "forkserver":
        with _start_lock:
            try:
                forkserver.start(PRELOAD)  # (no effect once it runs)
            except OSError as e:  # (its socket under a long $TMPDIR, say): the workers start as fresh interpreters
                _warn_spawn(e)
                method = "spawn"
    return multiprocessing.get_context(method)


#: The longest path a Unix socket may have (``sun_path``: 108 bytes on Linux, with its NUL).
SOCKET_PATH_MAX = 107


def check_socket_dir() -> None:
    """Refuse, before any worker starts, a temporary directory too deep for the Unix sockets the
    workers need: whatever starts them, each worker hands its batches' tensors to the rank over one
    (torch's file-descriptor sharing, through ``multiprocessing.resource_sharer``), made by
    multiprocessing as ``<tempdir>/pymp-XXXXXXXX/listener-XXXXXXXX``. Past the limit every worker
    dies on its first batch and the rank waits for batches until ``data.timeout``.

    Raises:
        ConfigError: names ``$TMPDIR``, the path's length and the fixes.
    """
    import os
    import tempfile

    import torch.multiprocessing

    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return  # ("file_system": shared memory by name, no socket)
    base = tempfile.gettempdir()
    longest = len(os.fsencode(os.path.join(base, "pymp-" + "x" * 8, "listener-" + "x" * 8)))
    if longest > SOCKET_PATH_MAX:
        raise ConfigError(
            f"data.num_workers > 0: DataLoader workers pass batches over Unix sockets under the temporary "
            f"directory {base!r}, whose paths would be {longest} bytes, more than the {SOCKET_PATH_MAX} a socket "
            "path may have; set TMPDIR to a shorter directory (e.g. TMPDIR=/tmp), or data.num_workers = 0")


_warned = False


def _warn_spawn(e: OSError) -> None:
    global _warned
    if not _warned:  # (once a process: each loader of the run asks)
        import logging

        _warned = True
        hint = "; a shorter $TMPDIR avoids this" if "too long" in str(e) else ""
        logging.getLogger("pimm").warning("warning: DataLoader workers start with 'spawn' (each imports torch): "
                                          "their fork server could not start (%s)%s", e, hint)


def check_importable(what: str, obj: object, method: str) -> None:
    """Refuse, before any worker starts, an object whose class the workers cannot import: one
    defined in the ``__main__`` of an interactive session (a notebook, the prompt), which
    has no file for a worker to import.

    Raises:
        ConfigError: ``obj``'s class (or ``obj`` itself, for a function) lives in such a ``__main__``.
    """
    import os
    import sys

    if method == "fork" or obj is None:
        return
    owner = obj if callable(obj) and hasattr(obj, "__qualname__") and not hasattr(obj, "__len__") else type(obj)
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if getattr(owner, "__module__", None) == "__main__" and not (main_file and os.path.isfile(main_file)):
        raise ConfigError(
            f"data: the {what} ({owner.__qualname__}) is defined in an interactive session (a notebook or the "
            f"prompt), which DataLoader workers started by data.multiprocessing_context = {method!r} cannot "
            "import; define it in a module (a .py file), set data.num_workers = 0, or data.multiprocessing_context "
            "= 'fork' (which can hang; see docs/data-workers.md)")


def is_pickling_error(error: BaseException) -> bool:
    """``error`` is multiprocessing failing to send something to a worker it starts
    (``PicklingError``, or the ``TypeError``/``AttributeError`` pickle raises for a lambda,
    a local class or an open file)."""
    return isinstance(error, pickle.PicklingError) or (
        isinstance(error, (TypeError, AttributeError)) and "pickle" in str(error).lower())


def unpicklable(what: str, method: str, error: BaseException) -> ConfigError:
    """The one-line error for a ``what`` (e.g. "train dataset") workers cannot receive."""
    return ConfigError(
        f"data: the {what} cannot be sent to DataLoader workers started by data.multiprocessing_context = "
        f"{method!r} ({type(error).__name__}: {error}); make it picklable (module-level classes and functions, "
        "no lambdas or open files), set data.num_workers = 0, or data.multiprocessing_context = 'fork' "
        "(which can hang; see docs/data-workers.md)")
