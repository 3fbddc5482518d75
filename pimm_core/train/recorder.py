"""The Recorder: what a run writes about itself, on rank 0, while it trains.

- ``train.log``: the ``pimm`` log of this run (attached for the length of ``train()``; a
  logger the host program left unconfigured also gets the CLI's console output);
- ``metrics.jsonl``: one record per logged optimizer step and per evaluation;
- ``status.json``: the heartbeat (``running``, ``stopping``, then ``finished``,
  ``stopped`` or ``failed``) with the position and the pids of every rank;
- ``provenance.json``: one entry per start or resume, and one per stop;
- the progress display: a Rich bar on a terminal, plain log lines otherwise.

Other ranks, and a run without a run directory, write no file. The writers are those of
:mod:`pimm_core.run`.

Once training runs, a failed write of these records (a full disk, an I/O error) does not
end the run: it is one warning line, the first time (and one line when writing works
again); the state is recorded at the next write that succeeds, and the checkpoints are
the Checkpointer's (their own failures stop the run, see ``checkpoint.on_error``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..config import Config, write_config
from ..errors import ConfigError
from ..process.console_log import attach_console
from ..process.dist import DistInfo
from ..process.lock import launcher_pid
from ..run import (CONFIG, METRICS, PROVENANCE, MetricsWriter, StatusWriter, append_provenance, launch_record,
                   log_handler, now_iso, scheduler_record, supersede_after)
from ..errors import PimmError, is_peer_loss, restarts_left
from ..run.entries import MLFLOW_ID, TENSORBOARD_DIR, WANDB_FILES, WANDB_ID, check_run_entries
from .rate import StepClock
from .sinks import Sink, open_sinks
from .state import TrainState

log = logging.getLogger("pimm")


class Recorder:
    """Rank 0's record of one ``train()`` call in ``run_dir``.

    Args:
        run_dir: the run directory (None: nothing is written, only the console attached).
        info: this process's rank layout (only rank 0 writes).
        state: the trainer's progress, read at each write.
        epochs: ``train.epochs`` of this call (``status.json`` shows it).
        steps_per_epoch: optimizer steps in a full epoch.
        log_every_steps: a train record every this many optimizer steps (and at step 1).
    """

    def __init__(self, run_dir: Path | None, info: DistInfo, state: TrainState, *, epochs: int,
                 steps_per_epoch: int, log_every_steps: int):
        self.run_dir, self.info, self.state = run_dir, info, state
        self.epochs, self.steps_per_epoch, self.log_every_steps = epochs, steps_per_epoch, log_every_steps
        self.writes = run_dir is not None and info.is_main
        self.total = 0  # the step the run ends at (total_steps), set by the trainer
        self.pids = [os.getpid()]  # every rank's pid, set by the trainer once gathered
        self.progress: ProgressDisplay | None = None
        self._metrics: MetricsWriter | None = None
        self._sinks: list[Sink] = []  # TensorBoard, MLflow, W&B (train/sinks.py)
        self._last_state: str | None = None  # the last status.json state, for the sinks' close
        self._log_handler: logging.Handler | None = None
        self._detach_console: Callable[[], None] = lambda: None
        self._failing: set[str] = set()  # the records whose last write failed
        self._failing_lock = threading.Lock()  # (status.json's results come from its writer thread)
        # status.json: state changes at once, a logged step's heartbeat on a writer thread
        self._status = StatusWriter(run_dir, lambda e: self._result("status.json", e)) if self.writes else None
        self.clock = StepClock()  # samples/s and steps/s of training time (:mod:`.rate`)
        self.status_extra: dict[str, Any] = {}  # memory_step, recovery: written with every status.json

    # ------------------------------------------------------------- log file
    def open_log(self) -> None:
        """Send the ``pimm`` log to ``run_dir/train.log`` (before anything of this run is logged)
        and attach the console to an unconfigured logger."""
        if self._log_handler is not None:
            return
        self._detach_console = attach_console(self.info.is_main)
        if not self.writes:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        check_run_entries(self.run_dir)  # (pimm launch checked them too; a Trainer from Python starts here)
        handler = log_handler(self.run_dir)
        log.addHandler(handler)
        self._log_handler = handler

    def close(self) -> None:
        """Detach this run's ``train.log`` and console (the logger is process-wide; later runs must
        not write here) and close ``metrics.jsonl``, after the last ``status.json`` handed to its writer thread."""
        if self._status is not None:
            self._status.close()  # (before the log detaches: its failure or recovery line goes to train.log)
        if self._log_handler is not None:
            log.removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None
        self._detach_console()
        self._detach_console = lambda: None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            try:
                sink.close(self._last_state)
            except Exception as e:  # a tracking server gone at the end must not hide how the run ended
                log.warning("warning: closing the %s sink failed: %s: %s", type(sink).__name__, type(e).__name__, e)

    # --------------------------------------------------- run directory files
    def start(self, config: Config, entry: dict[str, Any], *, fresh: bool, code_version: str | None,
              data_fingerprint: str | None) -> None:
        """Write ``config.toml``, open ``metrics.jsonl`` (emptied first when ``fresh``: a fresh start
        never mixes in an earlier attempt's log) and append ``entry`` (the start or resume record)
        to ``provenance.json``, with the versions of code, torch, python and data."""
        if not self.writes:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_config(config, self.run_dir / CONFIG)
        s = self.state
        if fresh:
            (self.run_dir / METRICS).unlink(missing_ok=True)
        else:  # what the interrupted run logged after the resumed position is written again
            supersede_after(self.run_dir / METRICS, s.global_step, eval_done=s.eval_step == s.global_step)
        self._metrics = MetricsWriter(self.run_dir / METRICS)
        world, workers = self.info.world_size, config.data.num_workers
        base = {"code_version": code_version, "torch_version": torch.__version__, "host": socket.gethostname(),
                "world_size": world, "workers_per_rank": workers, "data_fingerprint": data_fingerprint,
                "python": sys.version.split()[0]}
        sink_entries = [e for e in (TENSORBOARD_DIR, MLFLOW_ID, WANDB_ID, WANDB_FILES) if not (self.run_dir / e).exists()]
        try:
            self._sinks = open_sinks(config, self.run_dir, resumed_at=None if fresh else s.global_step,
                                     eval_done=s.eval_step == s.global_step, provenance=base)
        except ConfigError:
            if fresh:  # a sink refused to start before the first step: the launch leaves no run behind
                for name in sink_entries:  # (what the sinks made here; an earlier session's files stay)
                    path = self.run_dir / name
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
                self.unstart()
            raise
        job = scheduler_record()  # the Slurm job (and its restart count) of this start, if any
        append_provenance(self.run_dir, base, {"time": now_iso(), "world_size": world, "workers_per_rank": workers,
                                               "launch": launch_record(world), **({"scheduler": job} if job else {}),
                                               **entry})

    def unstart(self) -> None:
        """Take back what :meth:`start` wrote on a fresh start (``config.toml``, ``provenance.json``,
        ``metrics.jsonl``), for a run that failed on its configuration before its first step:
        the launch then removes the run directory as it does for any run that never started
        (:meth:`~pimm_core.run.claim.RunDirClaim.discard_if_unstarted`)."""
        if not self.writes:
            return
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        for name in (CONFIG, PROVENANCE, METRICS):
            (self.run_dir / name).unlink(missing_ok=True)

    def status(self, state: str, **extra: Any) -> None:
        """Replace ``status.json`` now: ``state`` (``running``, ``stopping``, ...) and the position
        (after any logged step's heartbeat still being written, which never lands after it)."""
        if self._status is not None:
            self._last_state = state
            self._status.write(state, self._status_fields(extra))

    def heartbeat(self) -> None:
        """A logged step's ``status.json`` (``running`` and the position), written soon by the
        writer thread: the training thread only builds the record."""
        if self._status is not None:
            self._last_state = "running"
            self._status.post(self._status_fields({}))

    def _status_fields(self, extra: dict[str, Any]) -> dict[str, Any]:
        s = self.state
        return {"pids": self.pids, "step": s.global_step, "epoch": s.epoch, "iter": s.iter, "total_steps": self.total,
                "steps_per_epoch": self.steps_per_epoch, "epochs": self.epochs, "world_size": self.info.world_size,
                "stop_reason": s.stop_reason, **self.status_extra, **extra}

    def failed(self, e: BaseException) -> None:
        """The session failed with ``e``: ``status.json`` says so, and ``train.log`` ends with the line the
        terminal shows (``error: ...``, printed there by the CLI; so written to the file alone).

        Under ``pimm launch --max-restarts K`` with restarts left the state is ``restarting``, not
        ``failed``: torchrun's agent starts the ranks again and they recover (the sinks keep their run open);
        ``failed`` only once no restart is left."""
        left = restarts_left()
        extra = {"agent_pid": launcher_pid() or os.getppid()} if left else {}  # (the agent lives on while the ranks restart)
        self.status("restarting" if left else "failed", error=f"{e.__class__.__name__}: {e}", **extra)
        if left and self.info.is_main:
            log.warning("warning: this session of the ranks failed (%s); torchrun restarts them (%d restart%s "
                        "left) and they recover from the newest checkpoint", _first_line(e), left,
                        "" if left == 1 else "s")
        if self._log_handler is not None and isinstance(e, PimmError):
            self._log_handler.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, "error: %s", (e,), None))

    def record(self, record: dict[str, Any]) -> None:
        """Append one record to ``metrics.jsonl`` (``time`` is added), and to the sinks asked for."""
        if self._metrics is not None:
            self._best_effort(METRICS, self._metrics.write, record)
        for sink in self._sinks:
            self._best_effort(getattr(sink, "what", type(sink).__name__), sink.write, record)

    def _best_effort(self, what: str, write: Callable[..., None], *args: Any, **kw: Any) -> None:
        """``write(*args, **kw)``; an OSError is one warning (the first of a series), not the run's end."""
        try:
            write(*args, **kw)
        except OSError as e:
            self._result(what, e)
            return
        if self._failing:
            self._result(what, None)

    def _result(self, what: str, error: OSError | None) -> None:
        """The outcome of a write of ``what``: the warning of the first failure of a series, the line
        of a record written again (from the training thread or ``status.json``'s writer thread)."""
        with self._failing_lock:
            first = error is not None and not self._failing
            again = error is None and what in self._failing
            if error is not None:
                self._failing.add(what)
            else:
                self._failing.discard(what)
        if first:
            log.warning("warning: cannot write %s (%s); training goes on, the run's state is recorded when "
                        "a write succeeds again; checkpoints are not affected", what, error.strerror or error)
        elif again:
            log.info("%s written again", what)

    # --------------------------------------------------------------- moments
    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """The progress display for the length of the loop (the samples/s clock starts here)."""
        self.progress = ProgressDisplay(self.info.is_main, total=self.total)
        self.progress.start(self.state.global_step)
        self.clock.start()
        try:
            yield
        finally:
            self.progress.stop()

    def on_step(self, epoch: int, loss: torch.Tensor, lr: float, samples: int,
                grad_norm: torch.Tensor | None = None) -> None:
        """After an optimizer step of ``epoch``: every ``log_every_steps``, at step 1, and at the last
        step of each epoch and of the run, a train record, a progress line and a status heartbeat
        (so a plot and the "last" loss never lag the run's end); the bar advances at every step.

        Args:
            loss: the window's mean loss (0-d tensor or :class:`~.window_average.WindowLoss`; read
                with ``.item()`` only when recorded).
            lr: the LR the step used.
            samples: samples in the window on this rank.
            grad_norm: the window's total L2 gradient norm before clipping (0-d tensor), recorded as
                ``grad_norm``; None: not recorded.
        """
        s = self.state
        self.clock.add(samples * self.info.data_ranks)  # (the ranks of a tensor-parallel group share batches)
        if self._records(s.global_step):
            rate, steps_rate = self.clock.take()
            loss_value = loss.item()
            record = {"step": s.global_step, "epoch": epoch, "iter": s.iter, "split": "train",
                      "loss": loss_value, "lr": lr, "samples_per_s": rate, "steps_per_s": steps_rate}
            if grad_norm is not None:
                record["grad_norm"] = grad_norm.item()
            self.record(record)
            self.progress.log(s, loss_value, lr, rate)
            self.heartbeat()
        self.progress.advance(s.global_step)

    def _records(self, step: int) -> bool:
        """Whether optimizer step ``step`` (a ``global_step``) writes a train record."""
        s = self.state
        ends_epoch = step - s.epoch_start_step == self.steps_per_epoch
        return step % self.log_every_steps == 0 or step == 1 or ends_epoch or step == self.total

    def records_next(self) -> bool:
        """Whether the optimizer step being taken (``global_step + 1``) writes a train record, and so
        reads its ``grad_norm``. The same answer on every rank (the position, ``log_every_steps`` and
        the run's end are the same on all; a rank that writes nothing still answers it)."""
        return self._records(self.state.global_step + 1)

    def on_eval(self, epoch: int, metrics: dict[str, float], metric: str) -> None:
        """An evaluation of ``epoch``: its record and log line (with the best ``metric`` so far)."""
        s = self.state
        values = {k.removeprefix("val/"): v for k, v in metrics.items()}
        ordered = {k: values[k] for k in ("loss", *sorted(values)) if k in values}  # "loss" first, as always
        self.record({"step": s.global_step, "epoch": epoch, "iter": s.iter, "split": "val", **ordered})
        if self.info.is_main:
            best = s.best_metric
            shown = " ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
            log.info("epoch %d eval: %s (best %s %.4f)", epoch, shown, metric, best if best is not None else float("nan"))

    def on_stop(self) -> None:
        """The run stopped early: the log line and the ``stop`` provenance entry."""
        s = self.state
        if not self.info.is_main:
            return
        skipped = "" if s.eval_step == s.global_step else "; final evaluation skipped"
        log.info("stopped (%s) at step %d, epoch %d, iter %d%s", s.stop_reason,
                 s.global_step, s.epoch, s.iter, skipped)
        if self.run_dir is not None:
            self._best_effort("provenance.json", append_provenance, self.run_dir, {}, {
                "time": now_iso(), "kind": "stop", "reason": s.stop_reason, "step": s.global_step, "epoch": s.epoch,
                "iter": s.iter})


class ProgressDisplay:
    """Rank-0 progress: a Rich bar on a terminal, plain log lines otherwise (cluster logs)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total
        self.rich = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.rich = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[info]}", markup=False), transient=True)

    def start(self, step: int) -> None:
        if self.rich is not None:
            self.rich.start()
            self.task = self.rich.add_task("train", total=self.total, completed=step, info="")

    def advance(self, step: int) -> None:
        if self.rich is not None:
            self.rich.update(self.task, completed=step)

    def log(self, s: TrainState, loss: float, lr: float, rate: float) -> None:
        if not self.enabled:
            return
        if self.rich is not None:
            self.rich.update(self.task, info=f"epoch {s.epoch} loss {loss:.4f} lr {lr:.2e} {rate:.0f} samples/s")
        else:
            log.info("step %d/%d epoch %d iter %d loss %.4f lr %.3e %.0f samples/s",
                     s.global_step, self.total, s.epoch, s.iter, loss, lr, rate)

    def stop(self) -> None:
        if self.rich is not None:
            self.rich.stop()


def _first_line(e: BaseException) -> str:
    if is_peer_loss(e):  # (gloo's message names a source file and a socket: say what it means)
        return "lost contact with another rank: its process is gone"
    text = str(e).strip().splitlines()
    return f"{e.__class__.__name__}: {text[0][:200]}" if text else e.__class__.__name__
