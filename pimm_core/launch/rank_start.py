"""How the launcher starts its ranks: forked from a server that has imported torch once.

Started as ``python -m pimm_core.cli`` (torchrun's default), every rank imports torch and what
``torch.optim`` pulls in at an optimizer's construction (``torch._dynamo``), ``torch.distributed``
and ``torch.distributed.checkpoint``: about 4 CPU-s a rank before its first line of pimm, paid
again by every rank a torchrun restart starts. ``pimm launch --nproc-per-node N`` instead gives
torchrun a function to run (``--run-path``, :data:`RANK_SCRIPT`) with ``--start-method
forkserver``: torchrun's agent asks multiprocessing's fork server for each rank, and the
server, started once per launch with :data:`PRELOAD` imported, forks it in milliseconds
(``benchmarks/startup.py`` measures both). The server is itself a fork of the launcher, which
has imported torch already, forked before the launcher imports the config's user code to check it
(:func:`fork_server_early`), where that is safe; else, or with ``PIMM_RANK_START=server``, a fresh
interpreter that imports torch again.
A restarted rank (``--max-restarts``) is forked from the same server.

What a rank started this way keeps from ``python -m pimm_core.cli`` (:func:`run_rank`):
its own session (torchrun starts each rank with ``start_new_session``); the launch's
environment (the server's, plus what the launcher changed in its own since the server was forked,
:func:`torchrun_args`) plus the variables torchrun's agent sets for the rank; ``sys.path`` with the working
directory and ``$PYTHONPATH`` first (how the ranks import user code); the stop signals
unblocked; and the interpreter's exit (threads joined, then ``atexit``).

Only torch is preloaded, never pimm's modules: some read the rank's environment at import
(``faults``), and they import in a fraction of a second. The server imports torch without
touching CUDA (tested), so forked ranks initialize CUDA themselves as usual.

``PIMM_RANK_START=exec`` starts each rank as a fresh ``python -m pimm_core.cli`` instead, as
does a Python whose fork server cannot be stopped and restarted (:func:`forked_ranks`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Iterator

from ..process import forkserver

#: What the ranks' fork server imports once (what every rank imports before its first step).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint", "torch.nn.parallel"]
#: The file torchrun runs in each forked rank (``--run-path``): it calls :func:`run_rank`.
RANK_SCRIPT = Path(__file__).with_name("rank_main.py")
#: ``exec``: start each rank as a fresh interpreter (``python -m pimm_core.cli``), not forked; ``server``:
#: fork the ranks from a fresh interpreter's fork server, not from one forked from the launcher.
RANK_START_ENV = "PIMM_RANK_START"


def forked_ranks() -> bool:
    """Start the ranks from the fork server (the default), unless ``$PIMM_RANK_START`` is ``exec``
    or this Python cannot restart its fork server (the ranks' environment comes from the server's)."""
    return os.environ.get(RANK_START_ENV, "") != "exec" and forkserver.can_stop()


#: ``os.environ`` when the ranks' server was forked early (:func:`fork_server_early`); None: no such server.
_forked_at: dict[str, str] | None = None
#: The names in ``sys.modules`` then.
_modules_at_fork: set[str] = set()


def torchrun_args() -> list[str]:
    """torchrun's flags that make it run :data:`RANK_SCRIPT` in forked ranks (give the ranks'
    arguments after them). The script's first argument is what this process's environment changed
    since the server was forked (JSON), which each rank applies to its own (:func:`run_rank`)."""
    return ["--start-method", "forkserver", "--run-path", str(RANK_SCRIPT), _environ_change()]


def fork_server_early() -> None:
    """Fork the ranks' server from this launcher now, before the launcher imports the config's user
    code (to check the config), if the ranks will be forked and that is safe (:func:`forkserver.fork`).

    The server then holds torch, imported once, and none of the user's modules, which each rank imports
    itself: a fork made later, once the launcher has imported them, is not made (a rank would keep
    what they read from the launcher's environment, or import them twice). What the launcher sets in
    its environment for the ranks after this reaches each rank through its arguments
    (:func:`torchrun_args`); the installed packages it imports meanwhile (a Hugging Face model's
    ``transformers``), the server imports before it forks a rank (:func:`rank_server`). Nothing happens
    where a fork is not safe or not wanted
    (``PIMM_RANK_START``): :func:`rank_server` starts the server then. :func:`stop_early` stops it if
    the launch ends before its ranks start.
    """
    global _forked_at, _modules_at_fork
    if _forked_at is not None or not forked_ranks() or os.environ.get(RANK_START_ENV, "") == "server":
        return
    import torch  # noqa: F401  (the launcher imports it to check the config anyway: the server inherits it)

    forkserver.stop()  # (one left by an earlier launch in this process)
    try:
        if forkserver.fork(PRELOAD):
            _forked_at, _modules_at_fork = dict(os.environ), set(sys.modules)
    except OSError:
        pass  # (rank_server starts a server later, and says why it cannot)


def stop_early() -> None:
    """Stop the server :func:`fork_server_early` forked, if it runs (no effect otherwise)."""
    global _forked_at
    if _forked_at is not None:
        forkserver.stop()
        _forked_at = None


def _environ_change() -> str:
    """What ``os.environ`` changed since :func:`fork_server_early`, as JSON: ``{"set": {NAME: VALUE},
    "unset": [NAME]}``; ``{}`` without a server forked early."""
    if _forked_at is None:
        return "{}"
    now = dict(os.environ)
    return json.dumps({"set": {k: v for k, v in now.items() if _forked_at.get(k) != v},
                       "unset": [k for k in _forked_at if k not in now]})


@contextlib.contextmanager
def rank_server(wanted: bool = True) -> Iterator[bool]:
    """Inside: this process's fork server is a fresh one, started now (with the environment the
    ranks must get) and preloading :data:`PRELOAD`; stopped on the way out, once the ranks are gone.

    Yields whether the ranks are forked from it: False when not ``wanted``, or when the server cannot
    start (its socket under ``$TMPDIR``, say, longer than a socket path may be); that says why in one
    ``warning:`` line, and the ranks then start as ``python -m pimm_core.cli``. The server imports
    while torchrun's agent meets the other agents (the rendezvous).
    """
    if not wanted:
        stop_early()
        yield False
        return
    if _forked_at is not None:  # the server forked early (fork_server_early) serves the ranks: it imports
        # what this launcher imported since from installed packages (the config's transformers, timm)
        forkserver.preload_more(forkserver.installed_since(_modules_at_fork))
    else:
        forkserver.stop()  # (one left by an earlier launch in this process holds that launch's environment)
        try:
            # a fork of this launcher, which has imported torch, unless user code is imported too (or
            # PIMM_RANK_START=server): a fresh interpreter
            forkserver.start(PRELOAD, fork_this=os.environ.get(RANK_START_ENV, "") != "server")
        except OSError as e:
            hint = "; a shorter $TMPDIR avoids this" if "too long" in str(e) else ""
            print(f"warning: the ranks' fork server could not start ({e}){hint}: each rank starts as "
                  "python -m pimm_core.cli and imports torch itself", file=sys.stderr, flush=True)
            yield False
            return
    # multiprocessing's start of each rank imports the launcher's __main__ again, by path, before torchrun's
    # agent sets the rank's environment: the `pimm` console script would import pimm_core there, and a module
    # that reads the environment at import (faults: RANK) would see the server's. The ranks run pimm_core.cli:
    # name that their main module, which multiprocessing does not import again (a package's __main__).
    main = sys.modules["__main__"]
    spec = main.__dict__.get("__spec__")
    if spec is None:
        main.__spec__ = importlib.util.find_spec("pimm_core.cli.__main__")
    try:
        yield True
    finally:
        if spec is None:
            main.__spec__ = None
        forkserver.stop()
        stop_early()


def run_rank(argv: list[str], script: str | None = None, environ: str = "{}") -> None:
    """Run ``pimm argv`` as this rank, forked from the fork server (torchrun runs this through
    :data:`RANK_SCRIPT`), as ``python -m pimm_core.cli argv`` would; with ``script``, that file
    instead, as ``python SCRIPT argv`` would (its directory first on ``sys.path``).

    ``environ``: what the launcher's environment changed since the server was forked (JSON, from
    :func:`torchrun_args`), applied to this rank's first.

    Returns (exit code 0, what torchrun's agent waits for: it counts a rank as done by the value
    it returns), or raises ``SystemExit`` with the rank's non-zero exit code.
    """
    change = json.loads(environ)
    # torchrun's agent set this rank's own variables (RANK, LOCAL_RANK, MASTER_PORT, ...) before this call: the
    # launcher's change never replaces them (user code the launcher imported may have set one, MASTER_PORT by
    # setdefault say), as a rank started as `python -m` gets the agent's values over the launcher's environment
    own = _agent_env()
    for name in change.get("unset", ()):
        if name not in own:
            os.environ.pop(name, None)
    os.environ.update({name: value for name, value in change.get("set", {}).items() if name not in own})
    os.setsid()  # its own session, as torchrun gives a rank it starts: only the launcher gets a terminal's ^C
    forkserver.leave_parent_server()  # it dies with the launcher, and this rank with it (lock.follow_launcher)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, forkserver.STOP_SIGNALS)  # (blocked in the server; pending ones arrive now)
    # `python -m`: the working directory, then $PYTHONPATH; `python SCRIPT`: the script's directory
    here = os.getcwd() if script is None else os.path.dirname(os.path.abspath(script))
    first = [here, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    sys.path[:] = list(dict.fromkeys(first + sys.path))
    sys.argv = [sys.argv[0] if script is None else script, *argv]
    code = 0
    try:
        import runpy

        if script is None:
            runpy.run_module("pimm_core.cli", run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # what the interpreter prints for an uncaught exception, then exit code 1
        traceback.print_exc()
        code = 1
    _finalize()
    if code < 0:  # (an uncaught KeyboardInterrupt: the interpreter exits by that signal)
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    if code:
        raise SystemExit(code)
    _hand_back()


#: What torchrun's agent sets for each rank (``LocalElasticAgent._start_workers``): names kept where
#: :func:`_agent_env` cannot read the agent's own mapping (another torch).
_AGENT_NAMES = ("RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE", "CUDA_VISIBLE_DEVICES")


def _agent_env() -> set[str]:
    """The names of the variables torchrun's agent set for this rank: the keys of ``env_`` in torch's
    ``_wrap``, which runs this rank's function; else those of :data:`_AGENT_NAMES` set here."""
    env = _wrap_local("env_")
    if isinstance(env, dict):
        return set(env)
    return {name for name in _AGENT_NAMES if name in os.environ}


def _wrap_local(name: str) -> object:
    """The local ``name`` of torch's ``_wrap`` (``torch.distributed.elastic.multiprocessing.api``), which
    calls this rank's function, found up the stack; None where it is not there (another torch)."""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "_wrap" and name in frame.f_locals):
        frame = frame.f_back
    return None if frame is None else frame.f_locals[name]


def _hand_back() -> None:
    """Give torchrun's agent this rank's result (done: None) and exit at once.

    torch's wrapper around a rank it runs as a function (``_wrap`` in
    ``torch.distributed.elastic.multiprocessing.api``) puts the function's return value on the rank's
    queue and then waits until the agent has read every rank's. An agent that is stopping its ranks
    instead (torchrun's handling of a stop signal, another rank's failure) never reads them: the rank
    that finished, having saved ``last``, would wait for the SIGKILL that ends the agent's shutdown
    timeout (``--shutdown-timeout``, 600 s here), and the launch with it. The queue is a
    ``SimpleQueue``, written at once and read by the agent whenever it reads it (after this process is
    gone too), so the value is put here and the process ends. Without that queue in reach (another
    torch), this returns, and torch's wrapper puts the value and waits.
    """
    ret_val = _wrap_local("ret_val_")
    if ret_val is None:
        return
    ret_val.put(None)  # type: ignore[attr-defined]
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"): the interpreter prints it and exits with 1
    return 1


def _finalize() -> None:
    """The interpreter's exit (``Py_FinalizeEx``), which a forked child skips: ``threading``'s exit
    (its exit functions, e.g. the thread pools' shutdown, then a join of the threads that are not
    daemons), then the ``atexit`` functions (pimm's DataLoader worker shutdown, the sinks' flushes)."""
    sys.stdout.flush()
    sys.stderr.flush()
    threading._shutdown()  # type: ignore[attr-defined]  # (CPython's, what the interpreter calls)
    atexit._run_exitfuncs()
