"""``pimm launch``: resolve the run directory, then train here or hand over to torchrun.

- No ``--nproc-per-node``/``--nnodes`` (or already inside torchrun/srun): this process
  is a rank and trains.
- Otherwise ``torch.distributed.run`` (torchrun/elastic) starts the ranks, each running
  ``python -m pimm_core.cli launch`` with the same arguments and the resolved run name
  (so every rank agrees on the directory even with a timestamp suffix).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .checkpoint.selection import explain, list_candidates, resolve_resume_path, select_resume
from .config import Config
from .errors import RANK_ERRORS_ENV, CheckpointError, UsageError, rank_errors
from .run import MODEL, STATUS, read_json, run_dir_for, run_name
from .lock import RunLock
from .stop import StopRequest


@dataclass
class LaunchOptions:
    """Launcher flags passed through to torchrun (names as torchrun spells them)."""

    nproc_per_node: int | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    master_addr: str | None = None
    master_port: int | None = None

    def wants_spawn(self) -> bool:
        return (self.nproc_per_node or 1) > 1 or (self.nnodes not in (None, "1", "1:1"))

    def torchrun_args(self) -> list[str]:
        args = ["--nproc-per-node", str(self.nproc_per_node or 1), "--max-restarts", "0"]
        # After forwarding a stop signal torchrun waits this long before SIGKILLing the ranks:
        # leave time to finish the accumulation window and save `last` (torchrun's default is 30 s).
        args += ["--shutdown-timeout", os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")]
        for flag, value in (("--nnodes", self.nnodes), ("--node-rank", self.node_rank),
                            ("--rdzv-endpoint", self.rdzv_endpoint), ("--rdzv-backend", self.rdzv_backend),
                            ("--master-addr", self.master_addr), ("--master-port", self.master_port)):
            if value is not None:
                args += [flag, str(value)]
        if not any(v is not None for v in (self.rdzv_endpoint, self.master_addr, self.nnodes)):
            args.append("--standalone")  # single node: torchrun picks a free port
        return args


def resolve_run_dir(cfg: Config, config_path: Path | None, *, when: float | None = None) -> Path:
    """``<run.root>/<run.group>/<name>[-timestamp]`` where name defaults to the config file's stem."""
    base = cfg.run.name or (config_path.stem if config_path else "run")
    return run_dir_for(cfg.run.root, cfg.run.group, run_name(base, timestamp=not cfg.run.no_timestamp, when=when))


def check_run_dir(cfg: Config, run_dir: Path) -> None:
    """Refuse what would lose work or silently start over (torch-free, runs before any rank starts).

    Raises:
        UsageError: the run root is a file; a fresh run would start in a directory that
            already has checkpoints; a resume was asked for but the run has none.
    """
    for parent in [run_dir, *run_dir.parents]:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"{parent} is a file, not a directory; choose another --run.root or --run.name")
    if cfg.train.resume:
        return
    # Even a leftover of an interrupted save belongs to an earlier run of this name: never
    # start over on top of it (the new run would delete it) without the user's say-so.
    found = list_candidates(run_dir / MODEL)
    if not found:
        return
    names = ", ".join(c.name for c in found[:4])
    if any(c.complete and c.resumable for c in found):
        raise UsageError(f"{run_dir} already has checkpoints ({names}); add --train.resume to continue it, "
                         "or choose another --run.name")
    # Nothing resumable (e.g. killed during its first save): neither a fresh start nor a resume
    # can proceed, so say how to get out instead of pointing at --train.resume.
    raise UsageError(f"{run_dir} has checkpoint files ({names}) but none can be resumed; move or remove "
                     f"{run_dir / MODEL} to start this run over, or choose another --run.name")


def setup_logging(is_main: bool) -> None:
    logger = logging.getLogger("pimm")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout if is_main else sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if is_main else logging.WARNING)
    logger.propagate = False


def resume_source(cfg: Config, run_dir: Path, resume_from: str | None) -> str | None:
    """The checkpoint a resume loads: ``resume_from`` as given, else the run's newest complete one.

    Raises:
        CheckpointError: ``--train.resume`` on a run with no complete candidate (lists what was found).
    """
    if resume_from:
        return resume_from
    if not cfg.train.resume:
        return None
    chosen, cands = select_resume(run_dir / MODEL)
    if chosen is None:
        found = "; ".join(explain(cands, None)) if cands else "nothing"
        if not cfg.run.no_timestamp:
            hint = " (to resume a run, pass its --run.name and --run.no-timestamp)"
        elif cands:
            hint = f"; to start this run over, move or remove {run_dir / MODEL} and launch without --train.resume"
        else:
            hint = "; launch without --train.resume to start it"
        raise CheckpointError(f"cannot resume {run_dir}: no complete checkpoint; found: {found}{hint}", exit_code=2)
    return str(run_dir / MODEL)  # the trainer verifies checksums and falls back past corrupt candidates


def dry_run(cfg: Config, config_path: Path | None, resume_from: str | None, world_size: int) -> int:
    """Print what a resume would do (run path, candidate, restored/discarded, topology, replay) and exit."""
    import tomllib

    from .topology import config_diff, plan_resume

    run_dir = resolve_run_dir(cfg, config_path)
    check_run_dir(cfg, run_dir)
    source = resume_source(cfg, run_dir, resume_from)
    print(f"run: {run_dir}")
    if source is None:
        print("fresh start (no resume requested); nothing will be restored")
        return 0
    cand = resolve_resume_path(source)
    plan = plan_resume(cand.manifest or {}, world_size=world_size, workers_per_rank=cfg.data.num_workers,
                       strict=cfg.resume_strict_state, grad_accum=cfg.train.grad_accum, legacy=cand.format == "legacy")
    t = plan.topology
    print(f"checkpoint: {cand.path} (step {cand.step}, epoch {cand.epoch}, iter {cand.iter})")
    print(f"policy: {plan.description}")
    print(f"topology: world size {t['saved_world_size']} -> {t['world_size']}, "
          f"per-rank workers {t['saved_workers_per_rank']} -> {t['workers_per_rank']}")
    print(f"restore: {', '.join(plan.restored)}")
    print(f"discard: {', '.join(plan.discarded) or 'nothing'}")
    rb = plan.replay_boundary
    print(f"continue at: step {plan.step}, epoch {plan.epoch}, iter {plan.iter}"
          + (f" (replay boundary: epoch {rb['epoch']} start, step {rb['step']}; {rb['from_iter']} batches replay)" if rb else
             " (exact continuation)" if plan.exact else ""))
    saved_cfg = run_dir / "config.toml"
    if saved_cfg.is_file():
        diff = config_diff(tomllib.loads(saved_cfg.read_text()), cfg.to_dict())
        print("config diff: " + ("none" if not diff else "; ".join(diff)))
    for w in plan.warnings:
        print(f"warning: {w}")
    print("dry run: nothing was trained or written")
    return 0


def train_here(cfg: Config, config_path: Path | None, resume_from: str | None = None) -> int:
    """Run this process as one rank of the run; returns the exit code."""
    from . import dist

    info = dist.env_world()
    setup_logging(info.is_main)
    run_dir = resolve_run_dir(cfg, config_path)
    check_run_dir(cfg, run_dir)
    lock = RunLock(run_dir).acquire() if info.is_main else contextlib.nullcontext()
    try:
        source = resume_source(cfg, run_dir, resume_from)
    except BaseException:
        lock.__exit__(None, None, None)
        raise
    start = time.perf_counter()
    stop = StopRequest()
    # SIGINT/SIGTERM (Ctrl-C, a scheduler's pre-emption notice, torchrun forwarding either)
    # become a clean stop: finish the accumulation window, save last, exit 0. Once training
    # has returned, later ones are ignored until this function returns (catch_signals restores
    # what it found: SIG_IGN), so a repeated Ctrl-C cannot turn the clean exit into a traceback;
    # the console script keeps ignoring them while the interpreter exits (cli.run).
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _train_and_report(cfg, config_path, run_dir, source, lock, stop, info, start)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _train_and_report(cfg: Config, config_path: Path | None, run_dir: Path, source: str | None, lock,
                      stop: StopRequest, info, start: float) -> int:
    """Train under the run lock with signals turned into stop requests; print the summary line."""
    from . import dist
    from .trainer import Trainer

    with lock, stop.catch_signals():
        try:
            trainer = Trainer(cfg, run_dir=run_dir, stop=stop)
            state = trainer.train(checkpoint_dir=run_dir / MODEL, resume_from=source)
        finally:
            dist.shutdown()
    if info.is_main:
        best = f"{state.best_metric:.4f}" if state.best_metric is not None else "n/a"
        took = f"{time.perf_counter() - start:.1f} s"
        if state.stop_reason is not None and state.stop_reason.startswith("checkpoint save failed"):
            raise CheckpointError(f"{state.stop_reason}; training stopped at step {state.global_step} | run {run_dir}")
        if state.stop_reason is not None:
            print(f"stopped ({state.stop_reason}): last saved at step {state.global_step} "
                  f"(epoch {state.epoch}, iter {state.iter}) | {took} | run {run_dir}\n"
                  f"resume with: pimm launch --train.config {config_path} --run.name {run_dir.name} "
                  f"--run.no-timestamp --run.root {cfg.run.root} --train.resume", flush=True)
        else:
            print(f"done: best {cfg.eval.metric} {best} (epoch {state.best_epoch}) | epochs {state.epoch} | "
                  f"steps {state.global_step} | {took} | run {run_dir}", flush=True)
    return 0


def spawn(cfg: Config, config_path: Path | None, argv: list[str], opts: LaunchOptions) -> int:
    """Start the ranks with ``torch.distributed.run`` and wait for them.

    Args:
        argv: the ``launch`` arguments to give each rank (launcher flags removed).

    Returns:
        0 on success, else the first failed rank's exit code.
    """
    run_dir = resolve_run_dir(cfg, config_path)
    check_run_dir(cfg, run_dir)
    if run_dir.is_dir():
        RunLock(run_dir).acquire().release()  # refuse at once if another launch holds the run
    head, sep, tail = _split_at_dashdash(argv)
    worker_args = ["launch", *head, "--run.name", run_dir.name, "--run.no-timestamp", *sep, *tail]
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args([*opts.torchrun_args(), "--module", "pimm_core.cli", *worker_args])
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    # torchrun logs each failed rank at ERROR; pimm prints one line naming the cause instead
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="pimm-rank-errors-") as errors_dir:
        os.environ[RANK_ERRORS_ENV] = errors_dir  # the ranks inherit it (see errors.report)
        # torchrun sets OMP_NUM_THREADS=1 for the ranks when it is unset, with a four-line
        # warning on every launch; set the same value here (a user's own value is kept).
        omp_was_set = "OMP_NUM_THREADS" in os.environ
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        try:
            return _run_ranks(run, args, run_dir, errors_dir)
        finally:
            os.environ.pop(RANK_ERRORS_ENV, None)
            if not omp_was_set:
                os.environ.pop("OMP_NUM_THREADS", None)


def _run_ranks(run, args, run_dir: Path, errors_dir: str) -> int:
    """``torch.distributed.run.run(args)``, turning its outcome into one report and an exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        run(args)
    except SignalException as e:
        # torchrun forwarded the signal to the ranks; they stop cleanly and save `last`. A
        # further signal raises again inside torchrun's wait for the ranks and lands here
        # early: ignore any more and wait for the ranks before reporting.
        _wait_for_children()
        status = read_json(run_dir / STATUS) or {}
        if status.get("state") == "stopped":
            print(f"stopped ({status.get('stop_reason')}) at step {status.get('step')} | run {run_dir}", flush=True)
            return 0
        print(f"error: interrupted by signal {e.sigval.name} before the ranks could stop cleanly; "
              f"see {run_dir / 'train.log'}", file=sys.stderr)
        return 1
    except ChildFailedError as e:
        code, line = _failure_report(e.failures, rank_errors(errors_dir), run_dir)
        print(line, file=sys.stderr)
        return code
    return 0


def _failure_report(failures: dict, reports: dict[int, dict], run_dir: Path) -> tuple[int, str]:
    """One ``error:`` line and the exit code for failed ranks, naming the root cause.

    When one rank fails, torchrun stops the others with SIGTERM and the ranks blocked in a
    collective with it fail too ("secondary" reports): the cause is, in order, the lowest
    rank that reported a primary error, else the lowest rank that died some other way
    (killed by a signal, a crash with its traceback above), else the lowest failed rank.
    """
    primary = {r: v for r, v in reports.items() if not v.get("secondary")}
    if primary:
        rank = min(primary)
        msg = primary[rank]["message"]
        return int(primary[rank]["code"]), (f"error: {msg}" if rank == 0 else f"error: rank {rank}: {msg}")
    died = [r for r, f in failures.items() if r not in reports and f.exitcode != -signal.SIGTERM]
    rank = min(died or failures)
    exitcode = failures[rank].exitcode
    if exitcode is not None and exitcode < 0:
        how = f"was killed by {signal.Signals(-exitcode).name}"
    else:
        how = f"failed with exit code {exitcode} (its output is above)"
    return 1, f"error: rank {rank} {how}; the run stopped; see {run_dir / 'train.log'} and resume with --train.resume"


def _wait_for_children(timeout: float = 300.0) -> None:
    """Ignore SIGINT/SIGTERM and reap this process's children (the local ranks) until none is left."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no child left
        if pid == 0:
            time.sleep(0.05)


def strip_launcher_flags(argv: list[str]) -> list[str]:
    """Remove torchrun-level flags (and their values) from ``launch`` arguments."""
    flags = {"--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend",
             "--master-addr", "--master-port"}
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def _split_at_dashdash(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], ["--"], argv[i + 1:]
    return argv, [], []
