"""Training in this process: one rank of the run (alone, or started by torchrun/srun),
under the run lock, with SIGINT/SIGTERM/SIGHUP (``train.stop_signals``) turned into a clean
stop from the first moment (:func:`pimm_core.process.stop.stop_signals`); the summary line."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..config import Config
from ..data.workers import start_server_early
from ..errors import CheckpointError, TrainingError, restarts_left
from ..faults import point
from ..process.console_log import setup_logging
from ..process.lock import follow_launcher, hold_run
from ..process.shell import resume_command
from ..process.stop import StopRequest, configured_signals, stop_signals
from ..run import LAUNCH_ENV, MODEL
from .requeue import requeue_if_asked
from .rundir import check_before_launch, claim, finished, resolve_run_dir, resume_source


def restarted() -> bool:
    """torchrun's agent restarted this rank (``--max-restarts``: ``TORCHELASTIC_RESTART_COUNT`` > 0)."""
    return (os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0") not in ("", "0")


def restart_config(cfg: Config, run_dir: Path) -> Config:
    """A restart resumes the run's disk ``last`` when it has one (the trainer tries the memory tier first,
    :mod:`pimm_core.train.memory_recovery`); the run directory is this run's own (the launch claimed it)."""
    from dataclasses import replace

    from ..checkpoint.select.selection import select_resume

    chosen, _ = select_resume(run_dir / MODEL)
    return replace(cfg, train=replace(cfg.train, resume=chosen is not None))


def train_here(cfg: Config, config_path: Path | None, resume_from: str | None = None, *,
               leftovers_ok: bool = False) -> int:
    """Run this process as one rank of the run; returns the exit code.

    ``leftovers_ok`` (``--train.auto-resume``): a model/ directory with nothing resumable
    in it does not stop a fresh start (rank 0 has moved it aside)."""
    with stop_signals() as stop:  # a stop asked from here on is kept for the trainer
        stop.catch_only(configured_signals(cfg.train.stop_signals))  # the configured ones (validated with the config)
        return _train_here(cfg, config_path, resume_from, leftovers_ok, stop)


def _train_here(cfg: Config, config_path: Path | None, resume_from: str | None, leftovers_ok: bool,
                stop: StopRequest) -> int:
    point("launch.starting")
    # before this rank starts any thread: its DataLoader workers' fork server, forked from it (workers.py)
    start_server_early(cfg.data.multiprocessing_context, cfg.data.num_workers)
    follow_launcher()  # a rank of `pimm launch --nproc-per-node` dies with it (lock.py)
    from ..process import dist

    info = dist.env_world()
    setup_logging(info.is_main)
    run_dir = resolve_run_dir(cfg, config_path)
    if restarted():  # torchrun restarted the ranks after a failure: this run continues where it can
        cfg, leftovers_ok = restart_config(cfg, run_dir), True
        if cfg.train.resume:  # the run's own checkpoints hold this launch's progress; --train.resume-from
            resume_from = None  # named where the launch began, and going back there would lose every step since
    check_before_launch(cfg, run_dir, leftovers_ok=leftovers_ok, config_path=config_path)
    claimed = claim(cfg, run_dir) if info.is_main else None
    run_dir = claimed.path if claimed is not None else run_dir
    try:
        return _train_claimed(cfg, config_path, run_dir, resume_from, info, stop)
    except BaseException:
        if claimed is not None:
            claimed.discard_if_unstarted()  # a launch that failed before the run started leaves nothing behind
        raise


def _train_claimed(cfg: Config, config_path: Path | None, run_dir: Path, resume_from: str | None, info,
                   stop: StopRequest) -> int:
    lock = hold_run(run_dir, info.is_main)  # see lock.py: who holds what
    point("launch.claimed", run_dir)  # (tests: `pimm stop` while the run is starting lands here)
    try:
        source = resume_source(cfg, run_dir, resume_from)
        message = finished(cfg, source, run_dir)
    except BaseException:
        lock.__exit__(None, None, None)
        raise
    if message is not None:  # nothing to train: no metrics, no checkpoint, no status change
        lock.__exit__(None, None, None)
        if info.is_main:
            print(message, flush=True)
        return 0
    # SIGINT/SIGTERM/SIGHUP (Ctrl-C, a scheduler's pre-emption notice, the terminal closing,
    # torchrun forwarding one) are a clean stop: finish the accumulation window, save last, exit
    # 0; before the first step: end with the stop recorded, nothing saved. They only set the
    # request (train_here's stop_signals), so once training has returned a repeated Ctrl-C
    # cannot turn the clean exit into a traceback; the console script ignores them while the
    # interpreter exits (cli.run).
    return _train_and_report(cfg, config_path, run_dir, source, lock, stop, info, time.perf_counter())


def _train_and_report(cfg: Config, config_path: Path | None, run_dir: Path, source: str | None, lock,
                      stop: StopRequest, info, start: float) -> int:
    """Train under the run lock with signals turned into stop requests; print the summary line."""
    from ..process import dist

    point("launch.importing_trainer")  # the slow part of start-up: torch and the trainer
    from ..trainer import Trainer

    with lock:
        trainer, ended = None, False
        try:
            trainer = Trainer(cfg, run_dir=run_dir, stop=stop, config_path=config_path, pick_threads=True)
            state = trainer.train(checkpoint_dir=run_dir / MODEL, resume_from=source)
            stopped_before_start = trainer.stopped_before_start
            ended = True
        finally:
            del trainer
            # a failed rank that torchrun restarts exits at once (cli.run): tearing the groups down (a full
            # garbage collection and a scan of every object, seconds on a busy node) only delays the restart
            if ended or not restarts_left():
                dist.shutdown()
    if info.is_main:
        best = f"{state.best_metric:.4f}" if state.best_metric is not None else "n/a"
        took = f"{time.perf_counter() - start:.1f} s"
        if state.error is not None:
            raise TrainingError(f"{state.error}; the run's last checkpoint (step {state.global_step}) holds the "
                                "weights from before it. "
                                f"Resume with a lower LR: {resume_command(run_dir)} -- train.lr={cfg.train.lr / 10:g}")
        if state.save_error is not None:  # stop_reason is its message
            raise CheckpointError(f"{state.stop_reason}; training stopped at step {state.global_step} | run {run_dir}")
        if state.stop_reason is not None and stopped_before_start:
            print(f"stopped ({state.stop_reason}) before the first step: nothing was trained or saved | {took} | "
                  f"run {run_dir}", flush=True)
        elif state.stop_reason is not None:
            print(f"stopped ({state.stop_reason}): last saved at step {state.global_step} "
                  f"(epoch {state.epoch}, iter {state.iter}) | {took} | run {run_dir}\n"
                  f"resume with: {resume_command(run_dir)}", flush=True)
        else:
            print(f"done: best {cfg.eval.metric} {best} (epoch {state.best_epoch}) | epochs {state.epoch} | "
                  f"steps {state.global_step} | {took} | run {run_dir}", flush=True)
        if LAUNCH_ENV not in os.environ:  # train.requeue (ranks of `pimm launch --nproc-per-node`: the launcher's)
            return requeue_if_asked(cfg, run_dir)
    return 0
