"""The training loop.

One optimizer step per accumulation window of ``train.grad_accum`` micro-batches
(the last window of an epoch may be shorter; its loss is averaged over the
micro-batches it has). A window starts where the previous one ended (or where a
resumed epoch continues), so every optimizer step averages over exactly the
micro-batches it used. The LR schedule (:mod:`pimm_core.schedule`) advances once per
optimizer step. At the
end of an epoch the evaluator runs first and the checkpoint saver second, so the
saver sees the evaluator's result of the same epoch (``model_best.pth``).

Counters follow PyTorch/torchtitan usage: ``global_step`` counts optimizer steps
over the whole run; ``epoch`` and ``iter`` (micro-batch index in the epoch) name
the *next* batch to train, so a checkpoint at an epoch end says ``(epoch+1, 0)``.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import socket
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import dist
from .checkpoint.files import move_pointers, save_legacy, save_single
from .checkpoint.selection import BEST, ITER_RE, LEGACY_LAST
from .checkpoint.standard import AsyncStandardSaver, on_main, save_standard, wait_for_purges, write_weights_file
from .fsio import remove_stale_temporaries
from .checkpoint.state import rng_state, unwrap
from .config import Config, TrainConfig, write_config
from .console_log import attach_console
from .data import build_datasets, eval_loader, train_loader
from .ema import EMA
from .errors import CheckpointSaveError, ConfigError, TrainingError
from .models import build_model
from .run import (CONFIG, METRICS, MetricsWriter, append_provenance, code_version, launch_record, log_handler, now_iso,
                  read_run_status, write_status)
from .schedule import WarmupCosine
from .stop import StopRequest
from .train.best import BestTracker
from .train.evaluator import Evaluator
from .train.resume import resume
from .train.state import TrainState
from .train.step import SKIPPED, STOP, WindowStep, autocast_context
from .train.stop_agreement import StopAgreement
from .topology import finished_message, is_finished

log = logging.getLogger("pimm")



def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy's global RNG and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


class Trainer:
    """Builds model, data and optimizer from a :class:`Config` and trains it.

    Example::

        cfg = load_config("configs/digits.toml")
        state = Trainer(cfg, run_dir=Path("exp/digits/try1")).train()

    Args:
        config: the validated run configuration.
        run_dir: where ``metrics.jsonl``, ``status.json``, ``provenance.json`` and
            ``train.log`` go (rank 0 only). None keeps the run in memory, unless
            :meth:`train` gets a ``checkpoint_dir``.
        stop: the :class:`~pimm_core.stop.StopRequest` this trainer obeys (a new one
            by default, reachable as ``trainer.stop``).

    ``trainer.callbacks`` holds functions called with the trainer after every optimizer
    step on every rank (before the stop agreement), e.g. to request a stop.

    Under torchrun the process group is created here (gloo on CPU, NCCL on CUDA) and
    the model is wrapped in DDP.
    """

    def __init__(self, config: Config, run_dir: Path | None = None, *, stop: StopRequest | None = None):
        self.config = config
        self.stop = stop or StopRequest()
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.info = dist.env_world()
        self.device = dist.pick_device(config.train.device, self.info)
        dist.init(self.device, self.info)
        if config.train.amp == "fp16" and self.device.type != "cuda":
            raise ConfigError("train.amp = 'fp16' needs CUDA; use 'bf16' or 'none' on CPU")

        self.data = build_datasets(config.data)
        torch.manual_seed(config.train.seed)  # identical initial weights on every rank
        model = build_model(config.model, self.data.in_features, self.data.in_shape, self.data.num_classes).to(self.device)
        self.warm_start_report = None  # set by train() when it warm-starts from train.weight
        self.ema = EMA(model, config.ema.decay, config.ema.warmup) if config.ema.enabled else None
        self.model: nn.Module = DDP(model) if self.info.distributed else model
        seed_everything(config.train.seed + self.info.rank)  # rank-distinct dropout streams

        self.loader, self.sampler = train_loader(self.data.train, config.data, self.info, config.train.seed)
        self.val_loader = eval_loader(self.data.val, config.data, self.info)
        self.optimizer = self._build_optimizer()
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.train.amp == "fp16")
        self.state = TrainState()
        self._metrics: MetricsWriter | None = None
        self._pending_loader_state: dict[str, Any] | None = None
        self._single_saved_step: int | None = None
        self._save_failed = False
        self._async = AsyncStandardSaver(self.info) if config.checkpoint.async_ else None
        self.callbacks: list[Callable[["Trainer"], None]] = []
        self.stop_agreement = StopAgreement(self.stop, self.info, self.run_dir, self.device)
        self.best = BestTracker(config.eval.metric, config.eval.mode)
        # (a plain function, not a bound method: a part holding the trainer would make a reference
        # cycle that keeps the loaders, and their worker processes, alive until interpreter exit)
        self.evaluator = Evaluator(self.val_loader, self.device,
                                   functools.partial(autocast_context, config.train.amp, self.device.type),
                                   config.eval.weights)
        self._pids = [os.getpid()]
        self._log_handler: logging.Handler | None = None
        self._detach_console: Callable[[], None] = lambda: None
        self._code_version = code_version() if self.info.is_main else None

    # ----------------------------------------------------------------- set-up
    def _warm_start(self, model: nn.Module):
        """Load ``train.weight`` into the new model (weights only; logged report, zero match raises)."""
        from .checkpoint.warm_start import warm_start

        t = self.config.train
        rules = [tuple(r) for r in t.key_rules] if t.key_rules is not None else None
        quiet = logging.getLogger("pimm.quiet")
        quiet.propagate = False
        return warm_start(model, t.weight, weight_set=t.weight_set, rules=rules,
                          logger=log if self.info.is_main else quiet)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        t = self.config.train
        params = unwrap(self.model).parameters()
        if t.optimizer == "sgd":
            return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
        return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)

    @property
    def micro_batches_per_epoch(self) -> int:
        return len(self.loader)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.micro_batches_per_epoch / self.config.train.grad_accum)

    def end_step(self, t: TrainConfig) -> int:
        """The global step at which training will end from the current position.

        The optimizer steps left in the current epoch (windows of ``grad_accum`` from
        ``iter``) plus whole epochs up to ``t.epochs``, capped by ``t.max_steps``: the
        horizon of the LR schedule and ``total_steps`` in ``status.json``.
        """
        s = self.state
        left = 0
        if s.epoch < t.epochs:
            left = math.ceil(max(0, self.micro_batches_per_epoch - s.iter) / t.grad_accum)
            left += (t.epochs - s.epoch - 1) * self.steps_per_epoch
        end = s.global_step + left
        return min(end, t.max_steps) if t.max_steps else end

    def is_done(self, t: TrainConfig) -> bool:
        """Nothing is left to do: the position reached ``t``'s end (all epochs, or ``t.max_steps``)
        and the run recorded that it finished (:func:`pimm_core.topology.is_finished`)."""
        state = read_run_status(self.run_dir).state if self.run_dir is not None else None
        s = self.state
        return is_finished({"step": s.global_step, "epoch": s.epoch}, epochs=t.epochs, max_steps=t.max_steps,
                           run_state=state)

    def _build_scheduler(self, t: TrainConfig) -> WarmupCosine:
        return WarmupCosine(self.optimizer, warmup=t.warmup_steps, total=self.end_step(t),
                            min_ratio=t.min_lr / t.lr if t.lr else 0.0, kind=t.scheduler)

    def _autocast(self):
        return autocast_context(self.config.train.amp, self.device.type)

    # ---------------------------------------------------------------- logging
    def _setup_files(self, entry: dict[str, Any], fresh: bool) -> None:
        if self.run_dir is None or not self.info.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_config(self.config, self.run_dir / CONFIG)
        if fresh:
            (self.run_dir / METRICS).unlink(missing_ok=True)  # a fresh start never mixes in an earlier attempt's log
        self._metrics = MetricsWriter(self.run_dir / METRICS)
        base = {
            "code_version": self._code_version, "torch_version": torch.__version__, "host": socket.gethostname(),
            "world_size": self.info.world_size, "workers_per_rank": self.config.data.num_workers,
            "data_fingerprint": self.data.fingerprint, "python": sys.version.split()[0],
        }
        append_provenance(self.run_dir, base, {"time": now_iso(), "world_size": self.info.world_size,
                                               "workers_per_rank": self.config.data.num_workers,
                                               "launch": launch_record(self.info.world_size), **entry})

    def _open_log(self) -> None:
        """Rank 0: send the ``pimm`` log to ``run_dir/train.log`` (before anything of this run is logged);
        a logger the host program left unconfigured also gets the CLI's console output for this run."""
        if self._log_handler is not None:
            return
        self._detach_console = attach_console(self.info.is_main)
        if self.run_dir is None or not self.info.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        handler = log_handler(self.run_dir)
        log.addHandler(handler)
        self._log_handler = handler

    def _close_log(self) -> None:
        """Detach this run's ``train.log`` (the logger is process-wide; later runs must not write here)."""
        if self._log_handler is not None:
            log.removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None
        self._detach_console()
        self._detach_console = lambda: None

    def _status(self, state: str, **extra: Any) -> None:
        if self.run_dir is not None and self.info.is_main:
            s = self.state
            write_status(self.run_dir, state, pids=self._pids, step=s.global_step, epoch=s.epoch, iter=s.iter,
                         total_steps=self._total, steps_per_epoch=self.steps_per_epoch,
                         epochs=self._t.epochs, world_size=self.info.world_size, stop_reason=s.stop_reason, **extra)

    def _record(self, record: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(record)

    # ------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float]:
        """Metrics of the validation split (:class:`~pimm_core.train.evaluator.Evaluator`): the raw
        weights, or the EMA weights when ``eval.weights = "ema"``.

        Returns:
            ``{"val/acc": fraction in [0, 1], "val/loss": nats per sample}``.
        """
        return self.evaluator.evaluate(self.model, self.ema)

    # ------------------------------------------------------------ checkpoints
    def _meta(self) -> dict[str, Any]:
        return {"trainer": asdict(replace(self.state, stop_reason=None, error=None)), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(), "world_size": self.info.world_size,
                "ema": self.ema.meta() if self.ema is not None else None,
                "workers_per_rank": self.config.data.num_workers, **self._batching()}

    def _batching(self) -> dict[str, int]:
        """Per-rank micro-batch size and accumulation window (recorded with every checkpoint)."""
        return {"batch_size": self.config.data.batch_size, "grad_accum": self._t.grad_accum}

    def _manifest(self, kind: str, has_loader_state: bool = False) -> dict[str, Any]:
        s = self.state
        return {"kind": kind, "step": s.global_step, "epoch": s.epoch, "iter": s.iter,
                "has_loader_state": has_loader_state, "code_version": self._code_version,
                "world_size": self.info.world_size, "workers_per_rank": self.config.data.num_workers,
                **self._batching(), "epoch_start_step": s.epoch_start_step, "metrics": s.last_eval, "created": now_iso(), "torch_version": torch.__version__,
                "data_fingerprint": self.data.fingerprint}

    def save_checkpoint(self, checkpoint_dir: Path, *, mid_epoch: bool, pointers: tuple[str, ...] = ("last",),
                        selection_metric: dict[str, Any] | None = None, background: bool = False) -> Path:
        """Publish a checkpoint in ``checkpoint_format``; every rank must call it.

        standard: ``last/``; legacy: ``model_last.pth``; single: ``step_<step>.pth`` with
        ``pointers`` (``last``, ``best``, ``final``) moved to it. ``background`` (standard
        format with ``checkpoint.async``) returns once the state is staged to CPU.
        """
        fmt = self.config.checkpoint_format
        rank_state = {"rng": rng_state(), "loader": self.loader.state_dict() if mid_epoch else None}
        manifest = self._manifest("last", mid_epoch)
        if selection_metric is not None:
            manifest["selection_metric"] = selection_metric
        if fmt == "standard" and background and self._async is not None:
            path = self._async.save(checkpoint_dir, model=self.model, optimizer=self.optimizer, meta=self._meta(),
                                    rank_state=rank_state, manifest=manifest, ema_state_dict=self._ema_sd())
        elif fmt == "standard":
            if self._async is not None:
                self._async.wait()  # publish the save in flight before this one rotates `last`
            path = save_standard(checkpoint_dir, model=self.model, optimizer=self.optimizer, meta=self._meta(),
                                 rank_state=rank_state, manifest=manifest, info=self.info,
                                 ema_state_dict=self._ema_sd())
        else:
            states = dist.all_gather_object(rank_state) if fmt == "single" else [rank_state]
            path = checkpoint_dir / (LEGACY_LAST if fmt == "legacy" else f"step_{self.state.global_step}.pth")

            def write() -> None:
                if fmt == "legacy":
                    save_legacy(checkpoint_dir, model=self.model, optimizer=self.optimizer, meta=self._meta(),
                                rank0_state=rank_state, manifest=manifest, ema_state_dict=self._ema_sd())
                elif self._single_saved_step == self.state.global_step:
                    # this position is already on disk: only move pointers (then retention)
                    move_pointers(checkpoint_dir, pointers, path.name, keep_last=self.config.checkpoint.keep_last)
                else:
                    save_single(checkpoint_dir, model=self.model, optimizer=self.optimizer, meta=self._meta(),
                                rank_states=states, manifest=manifest, ema_state_dict=self._ema_sd(),
                                pointers=pointers, keep_last=self.config.checkpoint.keep_last)

            on_main(self.info, write, path.with_name(f".{path.name}.{os.getpid()}.tmp"), checkpoint_dir)
            self._single_saved_step = self.state.global_step
        if self.info.is_main and not (fmt == "standard" and background and self._async is not None):
            # (a background save logs "saved" from its writer thread once it is published)
            log.info("saved %s (step %d, epoch %d, iter %d)", path, self.state.global_step, self.state.epoch,
                     self.state.iter)
        return path

    def _guarded_save(self, checkpoint_dir: Path, *, mid_epoch: bool) -> bool:
        """A periodic save; on failure log loudly and, with ``checkpoint.on_error = "stop"``
        (default), stop the run rather than train on without checkpoints."""
        try:
            self.save_checkpoint(checkpoint_dir, mid_epoch=mid_epoch, background=True)
            return True
        except CheckpointSaveError as e:
            if self.info.is_main:
                log.error("ERROR: %s", e)
            if self.config.checkpoint.on_error == "stop":
                self._save_failed = True
                self.stop.request(str(e))
            return False

    def _write_secondary(self, path: Path, manifest: dict[str, Any]) -> bool:
        """Rank 0 writes a weights-only file (best, iter); a failure is loud and, by default, stops the run."""
        try:
            write_weights_file(path, self.model, manifest, self._ema_sd())
            return True
        except OSError as e:
            log.error("ERROR: writing %s failed: %s", path, e.strerror or e)
            if self.config.checkpoint.on_error == "stop":
                self.stop.request(f"checkpoint save failed: {path}: {e.strerror or e}")
            return False

    def _ema_sd(self) -> dict[str, torch.Tensor] | None:
        return self.ema.state_dict_for(unwrap(self.model)) if self.ema is not None else None

    def _save_iter_snapshot(self, checkpoint_dir: Path) -> None:
        if not self.info.is_main:
            return
        if not self._write_secondary(checkpoint_dir / f"iter_{self.state.global_step}.pth", self._manifest("iter")):
            return
        keep = self.config.checkpoint.keep_iter
        snaps = sorted((int(m.group(1)), p) for p in checkpoint_dir.iterdir() if (m := ITER_RE.match(p.name)))
        for _, old in snaps[: max(0, len(snaps) - keep)]:
            old.with_name(old.name + ".json").unlink(missing_ok=True)
            old.unlink(missing_ok=True)

    def _update_best(self, metrics: dict[str, float], epoch: int, checkpoint_dir: Path | None) -> None:
        e = self.config.eval
        value = metrics[e.metric]
        if not self.best.update(value, epoch):
            return
        self.state.best_metric, self.state.best_epoch = self.best.best, self.best.epoch
        if checkpoint_dir is None:
            return
        selection = {"name": e.metric, "value": value, "mode": e.mode, "split": "val", "epoch": epoch,
                     "weights": e.weights}
        if self.config.checkpoint_format == "single":
            # `best` must name a complete checkpoint at this position (every rank takes part).
            n_micro = self.micro_batches_per_epoch
            self.save_checkpoint(checkpoint_dir, mid_epoch=0 < self.state.iter < n_micro, pointers=("best",),
                                 selection_metric=selection)
        elif self.info.is_main:
            # a weights-only file says which epoch produced it (the one just evaluated), not where a
            # resume would continue: epoch 24 with its 45 micro-batches, as its metrics.jsonl records say
            s = self.state
            trained = s.iter if s.epoch == epoch else self.micro_batches_per_epoch
            self._write_secondary(checkpoint_dir / BEST, {**self._manifest("best"), "epoch": epoch, "iter": trained,
                                                          "selection_metric": selection})

    def save_model(self, path: Path, *, weights: str = "raw") -> Path:
        """Export the live model's ``raw`` or ``ema`` weights (rank 0 writes).

        ``path`` ending in ``.safetensors`` writes that file (tied tensors stored once,
        aliases in its metadata); any other suffix writes ``torch.save`` of the plain
        state dict. No DDP or compile prefixes.

        Raises:
            UsageError: ``weights="ema"`` without ``ema.enabled``.
        """
        from .checkpoint.weight_files import write_bin, write_safetensors
        from .errors import UsageError

        if weights == "ema" and self.ema is None:
            raise UsageError("this run keeps no EMA weights (ema.enabled = false); use weights='raw'")
        sd = self._ema_sd() if weights == "ema" else unwrap(self.model).state_dict()
        path = Path(path)
        if self.info.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            (write_safetensors if path.suffix == ".safetensors" else write_bin)(sd, path)
        return path

    # ------------------------------------------------------------------ train
    def train(self, train_config: TrainConfig | None = None, *, checkpoint_dir: Path | None = None,
              resume_from: Path | None = None) -> TrainState:
        """Train until the configured end.

        Args:
            train_config: replaces ``config.train`` for this call (e.g. more epochs).
            checkpoint_dir: where checkpoints go (``<run_dir>/model`` from the CLI);
                None saves nothing.
            resume_from: a checkpoint (``.../model/last``) to continue from, per the
                resume policy in :mod:`pimm_core.topology`.

        Returns:
            The final :class:`TrainState`.

        Raises:
            CheckpointError: ``resume_from`` does not resolve ("No weight found"), is
                incomplete ("Incomplete checkpoint directory"), is a Hub artifact, or its
                state does not fit the model (names the tensors).
        """
        t = train_config or self.config.train
        self._t = t
        self.scheduler = self._build_scheduler(t)
        self._total = self.scheduler.total
        checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self._open_log()  # first: the warm-start report and resume lines belong in train.log
        try:
            entry: dict[str, Any] = {"kind": "start", "checkpoint_dir": str(checkpoint_dir) if checkpoint_dir else None}
            c = self.config
            if resume_from is None and c.train.weight and not c.train.resume:  # a resume never warm-starts
                self.warm_start_report = self._warm_start(unwrap(self.model))
                if self.ema is not None:  # the average starts from the loaded weights
                    self.ema = EMA(unwrap(self.model), c.ema.decay, c.ema.warmup)
                entry["warm_start"] = self.warm_start_report.to_json()
            if checkpoint_dir is not None and self.info.is_main:
                checkpoint_dir.mkdir(parents=True, exist_ok=True)
                for name in remove_stale_temporaries(checkpoint_dir):
                    log.warning("removed %s, left by a save that was interrupted", checkpoint_dir / name)
            if resume_from is not None:
                entry = resume(self, resume_from, checkpoint_dir)
                if self.is_done(t):
                    # nothing to train: no metrics, no checkpoint, no status change; provenance says so
                    self.state.finished = True
                    if self.info.is_main:
                        log.info("%s", finished_message(self.state.global_step, self.state.epoch, t))
                    self._setup_files({**entry, "finished": True}, fresh=False)
                    return self.state
                self._total = self.scheduler.total
            self._setup_files(entry, fresh=resume_from is None)
            self.stop_agreement.discard_stale()
            self._pids = dist.all_gather_object(os.getpid())  # every rank's pid, for operators and tests
            self.stop_agreement.file_used = False
            self._status("running")
            try:
                self._loop(t, checkpoint_dir)
                self._check_finite()
            except BaseException as e:
                self._status("failed", error=f"{e.__class__.__name__}: {e}")
                raise
            if self.state.stop_reason is None and (self.stop.reason or "").startswith("checkpoint save failed"):
                self.state.stop_reason = self.stop.reason  # a best/iter write failed after the last stop check
            if self.state.stop_reason is not None:
                self._record_stop()
            # a failed save (even the last model_best.pth write) is a failure, not the end of the run
            save_failed = (self.state.stop_reason or "").startswith("checkpoint save failed")
            self._status("failed" if save_failed else "finished" if self.state.finished else "stopped")
            if self._metrics is not None:
                self._metrics.close()
            return self.state
        finally:
            self._close_log()

    def _loop(self, t: TrainConfig, checkpoint_dir: Path | None) -> None:
        s = self.state
        ckpt = self.config.checkpoint
        accum = t.grad_accum
        n_micro = self.micro_batches_per_epoch
        model, scheduler = self.model, self.scheduler
        model.train()
        # (the async saver's staging must finish copying the weights before the optimizer step)
        step = WindowStep(model, self.optimizer, self.scaler, self.ema, t, autocast=self._autocast,
                          distributed=self.info.distributed,
                          before_step=self._async.wait_staged if self._async is not None else None)
        progress = _Progress(self.info.is_main, total=self._total)
        progress.start(s.global_step)
        evaluated_at_end = False
        stop_at_epoch_end = False
        last_log_time, last_log_samples, samples = time.perf_counter(), 0, 0
        try:
            while s.epoch < t.epochs and not self._at_max_steps(t):
                epoch = s.epoch
                self.sampler.set_epoch(epoch)
                if self._pending_loader_state is not None:
                    self.loader.load_state_dict(self._pending_loader_state)
                    self._pending_loader_state = None
                if s.iter == 0:
                    s.epoch_start_step = s.global_step
                window_loss = torch.zeros((), device=self.device)
                window_start = s.iter  # windows run from where this epoch continues
                for x, y, _ in self.loader:
                    x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                    window_len = min(accum, n_micro - window_start)
                    last_in_window = s.iter + 1 == window_start + window_len
                    window_loss += step.backward(x, y, window_len=window_len, last_in_window=last_in_window)
                    s.iter += 1
                    samples += len(y)
                    if not last_in_window:
                        continue
                    outcome = step.finish()
                    if outcome == STOP:
                        # nothing of this window is applied: `last` keeps the weights from before it
                        s.error = (f"non-finite loss or gradient at step {s.global_step + 1} (epoch {epoch}, "
                                   f"iter {s.iter}); the step was not applied")
                        self.stop.request(s.error)
                        if self.info.is_main:
                            log.error("ERROR: %s (train.on_nonfinite = 'stop')", s.error)
                        window_loss = torch.zeros((), device=self.device)
                        window_start = s.iter
                        s.stop_reason = s.error
                        self._status("stopping")
                        if s.iter < n_micro:
                            break
                        stop_at_epoch_end = True
                        break
                    if outcome == SKIPPED and self.info.is_main:
                        log.warning("warning: non-finite loss or gradient at step %d: step skipped "
                                    "(train.on_nonfinite = 'skip')", s.global_step + 1)
                    lr = scheduler.get_last_lr()[0]
                    scheduler.step()
                    s.global_step += 1
                    if s.global_step % t.log_every_steps == 0 or s.global_step == 1:
                        now = time.perf_counter()
                        rate = (samples - last_log_samples) * self.info.world_size / max(now - last_log_time, 1e-9)
                        last_log_time, last_log_samples = now, samples
                        loss_value = window_loss.item()
                        self._record({"step": s.global_step, "epoch": epoch, "iter": s.iter, "split": "train",
                                      "loss": loss_value, "lr": lr, "samples_per_s": rate})
                        progress.log(s, loss_value, lr, rate)
                        self._status("running")
                    progress.advance(s.global_step)
                    window_loss = torch.zeros((), device=self.device)
                    window_start = s.iter
                    for callback in self.callbacks:
                        callback(self)  # e.g. lambda tr: tr.stop.request("budget") if ... else None
                    reason = self.stop_agreement.agree()
                    if reason is not None:
                        s.stop_reason = reason
                        self._status("stopping")  # the console shows it until `last` is saved
                        if s.iter < n_micro:
                            break  # mid-epoch: save below, no evaluation
                        stop_at_epoch_end = True  # let this epoch's evaluation and save happen first
                    at_max = self._at_max_steps(t)
                    if checkpoint_dir is not None and ckpt.every_steps and s.global_step % ckpt.every_steps == 0 \
                            and s.iter < n_micro and not at_max:
                        if self._guarded_save(checkpoint_dir, mid_epoch=True) and ckpt.keep_iter:
                            self._save_iter_snapshot(checkpoint_dir)
                    if at_max or stop_at_epoch_end:
                        break
                if s.stop_reason is not None and not stop_at_epoch_end:
                    break
                epoch_done = s.iter >= n_micro
                if epoch_done:
                    s.epoch, s.iter = epoch + 1, 0
                is_end = s.epoch >= t.epochs or self._at_max_steps(t)
                if epoch_done and self.config.eval.every_epochs and (
                        (epoch + 1) % self.config.eval.every_epochs == 0 or is_end):
                    self._evaluate_and_record(epoch, checkpoint_dir)
                    evaluated_at_end = is_end
                if stop_at_epoch_end:
                    break
                step_save = bool(ckpt.every_steps) and s.global_step % ckpt.every_steps == 0
                epoch_save = bool(ckpt.every_epochs) and (epoch + 1) % ckpt.every_epochs == 0
                if checkpoint_dir is not None and not is_end and epoch_done and (step_save or epoch_save):
                    if self._guarded_save(checkpoint_dir, mid_epoch=False) and step_save and ckpt.keep_iter:
                        self._save_iter_snapshot(checkpoint_dir)
            if s.stop_reason is None:
                if not evaluated_at_end and self.config.eval.every_epochs and s.eval_step != s.global_step:
                    self._evaluate_and_record(s.epoch - 1 if s.iter == 0 else s.epoch, checkpoint_dir)
                s.finished = True
            if self._async is not None and not self._save_failed:
                try:
                    self._async.wait()  # a stop or the end waits for the save in flight
                except CheckpointSaveError as e:
                    if self.info.is_main:
                        log.error("ERROR: %s", e)
                    self._save_failed = True
                    s.stop_reason = s.stop_reason or str(e)
            if checkpoint_dir is not None and not self._save_failed:
                self.save_checkpoint(checkpoint_dir, mid_epoch=0 < s.iter < n_micro,
                                     pointers=("last", "final") if s.finished else ("last",))
                if s.finished and ckpt.every_steps and ckpt.keep_iter and s.global_step % ckpt.every_steps == 0:
                    self._save_iter_snapshot(checkpoint_dir)
                # the last save's superseded checkpoint is removed before the run reports its end
                on_main(self.info, wait_for_purges, checkpoint_dir / "last.prev", checkpoint_dir)
        finally:
            progress.stop()

    def _check_finite(self) -> None:
        """A run whose weights are NaN/Inf never ends as ``done`` with exit 0.

        Raises:
            TrainingError: names the first non-finite parameter and the step.
        """
        for name, p in unwrap(self.model).named_parameters():
            if not bool(torch.isfinite(p).all()):
                raise TrainingError(f"the weights are not finite after step {self.state.global_step} ({name} holds "
                                    "NaN or Inf); the run failed: resume from an earlier checkpoint with a lower "
                                    "train.lr, or start over")

    def _record_stop(self) -> None:
        s = self.state
        if not self.info.is_main:
            return
        skipped = "" if s.eval_step == s.global_step else "; final evaluation skipped"
        log.info("stopped (%s) at step %d, epoch %d, iter %d%s", s.stop_reason,
                 s.global_step, s.epoch, s.iter, skipped)
        if self.run_dir is not None:
            self.stop_agreement.consume()  # consumed: must not stop the resumed run
            append_provenance(self.run_dir, {}, {"time": now_iso(), "kind": "stop", "reason": s.stop_reason,
                                                 "step": s.global_step, "epoch": s.epoch, "iter": s.iter})

    def _at_max_steps(self, t: TrainConfig) -> bool:
        return bool(t.max_steps) and self.state.global_step >= t.max_steps

    def _evaluate_and_record(self, epoch: int, checkpoint_dir: Path | None) -> None:
        metrics = self.evaluate()
        self.state.last_eval, self.state.eval_step = metrics, self.state.global_step
        self._update_best(metrics, epoch, checkpoint_dir)
        self._record({"step": self.state.global_step, "epoch": epoch, "iter": self.state.iter, "split": "val",
                      "loss": metrics["val/loss"], "acc": metrics["val/acc"]})
        if self.info.is_main:
            best = self.state.best_metric
            log.info("epoch %d eval: val/acc %.4f val/loss %.4f (best %s %.4f)", epoch, metrics["val/acc"],
                     metrics["val/loss"], self.config.eval.metric, best if best is not None else float("nan"))


class _Progress:
    """Rank-0 progress: a Rich bar on a terminal, plain log lines otherwise (cluster logs)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total
        self.rich = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.rich = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[info]}"), transient=True)

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
