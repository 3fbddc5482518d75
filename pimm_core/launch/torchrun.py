"""Starting the ranks through ``torch.distributed.run`` (torchrun/elastic) and turning
their outcome into one report: the exit code and one ``error:`` line naming the cause."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from ..config import Config
from ..faults import point
from ..errors import RANK_ERRORS_ENV, rank_errors
from ..process.lock import LauncherLock
from ..process.shell import PROGRAM_ENV, program, resume_command
from ..process.stop import SIGNALS_ENV, StopRequest, signals_from_env, stop_signals
from ..run import LAUNCH_ENV, STATUS, read_run_status
from ..run.status import mark_failed
from ..run.ranks import describe_lag, lagging_ranks, read_rank_beats
from ..process.stop import configured_signals
from ..targets import child_env
from ..process.threads import USER_OMP_ENV
from .forward import SignalForwarder
from .forward import rank_processes
from .options import LaunchOptions
from .rank_start import fork_server_early, forked_ranks, rank_server, stop_early, torchrun_args as rank_start_args
from .rendezvous import use_ordered_shutdown
from .requeue import requeue_if_asked
from .restarts import watch_restarts
from .rundir import check_before_launch, claim, resolve_run_dir


def spawn(cfg: Config, config_path: Path | None, argv: list[str], opts: LaunchOptions, *,
          worker_args: list[str] | None = None, leftovers_ok: bool = False) -> int:
    """Start the ranks with ``torch.distributed.run`` and wait for them.

    Args:
        argv: the ``launch`` arguments to give each rank (launcher flags removed).
        worker_args: the whole command line of each rank instead (``pimm resume`` passes
            ``resume RUN_DIR -- overrides``).
        leftovers_ok: (``--train.auto-resume``) leftovers of unfinished saves in ``model/``
            do not refuse the launch: an agent moves them aside (another node's, if not this one).

    Returns:
        0 on success, else the first failed rank's exit code.
    """
    with stop_signals() as stop:  # the launcher's start-up, until torchrun handles the signals
        return _spawn(cfg, config_path, argv, opts, worker_args, leftovers_ok, stop)


def _spawn(cfg: Config, config_path: Path | None, argv: list[str], opts: LaunchOptions,
           worker_args: list[str] | None, leftovers_ok: bool, stop: StopRequest) -> int:
    stop.catch_only(configured_signals(cfg.train.stop_signals))  # (validated with the config)
    # the ranks' server, forked before the check below imports the config's user code (rank_start.py)
    fork_server_early()
    try:
        return _check_and_spawn(cfg, config_path, argv, opts, worker_args, leftovers_ok, stop)
    finally:
        stop_early()  # (already stopped if the ranks ran)


def _check_and_spawn(cfg: Config, config_path: Path | None, argv: list[str], opts: LaunchOptions,
                     worker_args: list[str] | None, leftovers_ok: bool, stop: StopRequest) -> int:
    run_dir = resolve_run_dir(cfg, config_path)
    check_before_launch(cfg, run_dir, leftovers_ok=leftovers_ok, config_path=config_path)
    single_node = opts.single_node()
    # Several nodes share the run directory: every node's agent checks and, if it is missing,
    # creates it (the first mkdir wins, the others use it); nothing is written in it until
    # the ranks start, and then only rank 0 writes the run files (see docs/clusters-guide.md, "Several nodes").
    claimed = claim(cfg, run_dir, single_node=single_node)
    try:
        code = _spawn_claimed(cfg, claimed.path, opts, argv, worker_args, single_node, config_path, stop)
    except BaseException:
        claimed.discard_if_unstarted()
        raise
    finally:  # the ranks are gone: their memory tier on this node (checkpoint.memory_every_steps) goes too
        from ..checkpoint.memory.store import remove_run

        remove_run(claimed.path)
    if code != 0 or stop.requested:
        claimed.discard_if_unstarted()  # no rank started (stopped, or failed before the run): leave nothing behind
        return code
    return requeue_if_asked(cfg, claimed.path)  # train.requeue: a Slurm job stopped by its signal starts again


def _spawn_claimed(cfg: Config, run_dir: Path, opts: LaunchOptions, argv: list[str], worker_args: list[str] | None,
                   single_node: bool, config_path: Path | None, stop: StopRequest) -> int:
    # refuse at once if the run is in use; on one node, held until the ranks are gone (lock.py)
    lock = LauncherLock(run_dir, single_node=single_node).acquire()
    if worker_args is None:
        head, sep, tail = _split_at_dashdash(argv)
        worker_args = ["launch", *head, "--run.name", run_dir.name, "--run.no-timestamp", *sep, *tail]
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

    signals = configured_signals(cfg.train.stop_signals)
    # several nodes: this agent passes stop signals on to its ranks (forward.py); one node:
    # torchrun's agent does, for its own four and train.stop_signals (e.g. a scheduler's SIGUSR1)
    forwarder = None if single_node or not SignalForwarder.available() else \
        SignalForwarder(opts.shutdown_timeout(), extra=signals)
    handled = forwarder.TORCHRUN_ARGS if forwarder else \
        ["--signals-to-handle", ",".join(dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT",
                                                        *(s.name for s in signals)]))]

    def torchrun_args(forked: bool):
        # the ranks forked from a server that imported torch once (rank_start.py), or each a `python -m`
        entry = rank_start_args() if forked else ["--module", "pimm_core.cli"]
        args = get_args_parser().parse_args([*opts.torchrun_args(), *handled, *entry, *worker_args])
        if not single_node:
            use_ordered_shutdown(args)  # the agent hosting the c10d store leaves last (rendezvous.py)
        return args

    with lock, tempfile.TemporaryDirectory(prefix="pimm-rank-errors-") as errors_dir:
        os.environ[RANK_ERRORS_ENV] = errors_dir  # the ranks inherit it (see errors.report)
        os.environ[LAUNCH_ENV] = json.dumps(opts.record())  # recorded in provenance for `pimm resume`
        os.environ[PROGRAM_ENV] = json.dumps(program())  # the ranks print commands as the user started pimm
        os.environ[SIGNALS_ENV] = ",".join(s.name for s in signals)  # the ranks catch them from their start
        # torchrun sets OMP_NUM_THREADS=1 for the ranks when it is unset, with a four-line
        # warning on every launch; set the same value here (a user's own value is kept), and
        # tell the ranks whether it was the user's: if not, each rank chooses (threads.py).
        omp_was_set = "OMP_NUM_THREADS" in os.environ
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ[USER_OMP_ENV] = "1" if omp_was_set else "0"
        # the ranks import user code (model.target...) from where this process does (targets.py)
        old_pythonpath = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = child_env(config_path)["PYTHONPATH"]
        try:
            # a stop signal from now until torchrun's agent handles them (it starts the ranks) ends the launch at once
            stop.handle_with(_stop_at_once(stop))
            if stop.requested:  # asked while this launcher started: no rank is started
                return _stopped_before_ranks(stop, run_dir)
            try:
                # the ranks' server first (if not forked early): before this process sets anything up for torchrun
                with rank_server(forked_ranks()) as forked, forwarder or contextlib.nullcontext(), \
                        watch_restarts(run_dir):
                    _quiet_torchrun()
                    return _run_ranks(run, torchrun_args(forked), run_dir, errors_dir, forwarder)
            except SignalException as e:
                if not getattr(e, "before_ranks", False):
                    raise
                return _stopped_before_ranks(stop, run_dir)
            finally:
                stop.handle_with(None)  # (the ranks are gone: a late signal is a request again)
        finally:
            os.environ.pop(RANK_ERRORS_ENV, None)
            os.environ.pop(LAUNCH_ENV, None)
            os.environ.pop(PROGRAM_ENV, None)
            os.environ.pop(SIGNALS_ENV, None)
            os.environ.pop(USER_OMP_ENV, None)
            if not omp_was_set:
                os.environ.pop("OMP_NUM_THREADS", None)
            if old_pythonpath is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old_pythonpath


def _stop_at_once(stop: StopRequest):
    """The launcher's handler of the stop signals between its last look at ``stop`` and torchrun's own
    handlers (installed as the agent starts the ranks): it requests the stop and raises torchrun's
    ``SignalException`` (marked ``before_ranks``) wherever the launcher is (the rank server's start, the
    agent's rendezvous), as torchrun's own handler does, so the agent gives up as it does on a signal. A
    signal only recorded there was lost: the agent then started the ranks, and they trained to the end."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def handler(signum: int, _frame: object) -> None:
        sig = signal.Signals(signum)
        stop.request(f"signal:{sig.name}")
        e = SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
        e.before_ranks = True  # type: ignore[attr-defined]
        raise e
    return handler


def _stopped_before_ranks(stop: StopRequest, run_dir: Path) -> int:
    print(f"stopped ({stop.reason}) before the ranks started: nothing was trained or saved | run {run_dir}",
          flush=True)
    return 0


def _quiet_torchrun() -> None:
    """The launcher's torchrun logs what pimm says itself (set after the ranks' server is forked from
    this process: the ranks keep torch's own levels)."""
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    # torchrun's agent announces the forwarded stop signal ("Received 15 death signal, shutting
    # down workers"): the ranks' stop summary says it for the user. Its loggers set their own level.
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    # torchrun logs each failed rank at ERROR; pimm prints one line naming the cause instead
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)


def _run_ranks(run, args, run_dir: Path, errors_dir: str, forwarder: SignalForwarder | None) -> int:
    """``torch.distributed.run.run(args)``, turning its outcome into one report and an exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    try:
        point("launch.agent_starting")  # (tests: a stop signal here, before torchrun's agent handles them)
        run(args)
    except RendezvousError as e:  # the nodes never met (or no longer can, after a restart): one line, no traceback
        line = _rendezvous_failure(e, args, run_dir)
        if (run_dir / STATUS).exists():  # (ranks ran before: a restart's rendezvous failed)
            with contextlib.suppress(OSError):
                mark_failed(run_dir, line.removeprefix("error: "))
        print(line, file=sys.stderr)
        return 1
    except SignalException as e:
        if getattr(e, "before_ranks", False):
            raise  # (no rank started: _spawn_claimed says so)
        # torchrun forwarded the signal to the ranks; they stop cleanly and save `last`. A
        # further signal raises again inside torchrun's wait for the ranks and lands here
        # early: ignore any more and wait for the ranks before reporting.
        _wait_for_children()
        return _interrupted(e.sigval, run_dir)
    except ChildFailedError as e:
        if forwarder is not None and forwarder.received is not None:
            return _interrupted(forwarder.received, run_dir)  # a rank died while stopping
        reports = rank_errors(errors_dir)
        rank, code, line = _failure_report(e.failures, reports, run_dir)
        # no restart is left: status.json says `failed` with the cause, also when rank 0 (its writer)
        # was killed or only failed because another rank died. Rank 0's own error stays when it is the
        # cause, and when this node saw only consequences (another node's rank died: its launcher knows)
        consequence = bool(reports.get(rank, {}).get("secondary"))
        with contextlib.suppress(OSError):
            mark_failed(run_dir, line.removeprefix("error: "), keep_error=rank == 0 or consequence)
        print(line, file=sys.stderr)
        return code
    return 0


def _rendezvous_failure(e: BaseException, args, run_dir: Path) -> str:
    """The ``error:`` line of a rendezvous that failed: where, why, and what to do."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    detail = f": {e}" if str(e) else ""
    what = "timed out" if isinstance(e, RendezvousTimeoutError) else f"failed ({type(e).__name__}{detail})"
    line = (f"error: the rendezvous of the nodes at {args.rdzv_endpoint} {what}: start this command on every node "
            f"(the same --rdzv-endpoint, --nnodes {args.nnodes}), or give them longer with --rdzv-conf "
            "join_timeout=SECONDS")
    if (run_dir / STATUS).exists():
        line += f"; resume with: {resume_command(run_dir)}"
    return line


def _interrupted(sig: signal.Signals, run_dir: Path) -> int:
    """The exit code (and ``error:`` line) of a launch whose ranks were given a stop signal."""
    if read_run_status(run_dir).state in ("stopped", "finished"):
        return 0  # rank 0 printed the stop (or done) summary and the resume command
    if not (run_dir / STATUS).exists():
        print(f"error: interrupted by signal {sig.name} before training started; nothing was trained or "
              "saved", file=sys.stderr)
        return 1
    print(f"error: interrupted by signal {sig.name} before the ranks could stop cleanly; "
          f"see {run_dir / 'train.log'}", file=sys.stderr)
    return 1


def _failure_report(failures: dict, reports: dict[int, dict], run_dir: Path) -> tuple[int, int, str]:
    """The root cause's rank, the exit code and one ``error:`` line for failed ranks, naming the cause.

    When one rank fails, torchrun stops the others with SIGTERM and the ranks blocked in a
    collective with it fail too ("secondary" reports): the cause is, in order, the lowest
    rank that reported a primary error, else the lowest rank that died some other way
    (killed by a signal, a crash with its traceback above), else the lowest failed rank.
    """
    primary = {r: v for r, v in reports.items() if not v.get("secondary")}
    if primary:
        rank = min(primary)
        msg = primary[rank]["message"]
        return rank, int(primary[rank]["code"]), (f"error: {msg}" if rank == 0 else f"error: rank {rank}: {msg}")
    died = [r for r, f in failures.items() if r not in reports and f.exitcode != -signal.SIGTERM]
    rank = min(died or failures)
    exitcode = failures[rank].exitcode
    if exitcode is not None and exitcode < 0:
        how = f"was killed by {signal.Signals(-exitcode).name}"
    else:
        how = f"failed with exit code {exitcode} (its output is above)"
    # a collective timeout that aborted the ranks (NCCL's watchdog): the heartbeats name who they waited for
    now = time.time()
    stuck = "".join(f"; {describe_lag(b, now)}" for b in lagging_ranks(read_rank_beats(run_dir), now))
    return rank, 1, (f"error: rank {rank} {how}{stuck}; the run stopped; see {run_dir / 'train.log'} and resume with: "
               f"{resume_command(run_dir)}")


def _wait_for_children(timeout: float = 300.0) -> None:
    """Ignore the stop signals and wait until this launcher's ranks are gone (reaping those that are
    its children: the ranks started as ``python -m``; forked ranks are the fork server's)."""
    for sig in {signal.SIGINT, signal.SIGTERM, *signals_from_env()}:
        signal.signal(sig, signal.SIG_IGN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        if not rank_processes():
            return
        time.sleep(0.05)


def _split_at_dashdash(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], ["--"], argv[i + 1:]
    return argv, [], []
