"""The training loop.

One optimizer step per accumulation window of ``train.grad_accum`` micro-batches
(the last window of an epoch may be shorter; its loss is averaged over the
micro-batches it has). A window starts where the previous one ended (or where a
resumed epoch continues), so every optimizer step averages over exactly the
micro-batches it used. The LR schedule (:mod:`pimm_core.train.schedule`) advances once per
optimizer step. At the
end of an epoch the evaluator runs first and the checkpoint saver second, so the
saver sees the evaluator's result of the same epoch (``model_best.pth``).

The parts (:mod:`pimm_core.train`): what is trained (:mod:`~pimm_core.train.build`), a
:class:`WindowStep` per window, the :class:`StopAgreement`, the :class:`Evaluator` with its
:class:`BestTracker`, the :class:`Checkpointer` (save schedule and format) and, per
:meth:`Trainer.train` call, the :class:`Recorder` (log, metrics, status, provenance,
progress). None of them holds the trainer: a reference cycle would keep the loaders'
worker processes alive. What happens at a step, an evaluation, a non-finite stop and the
session's end is in :mod:`~pimm_core.train.session` (functions of the trainer).

Counters follow PyTorch/torchtitan usage: ``global_step`` counts optimizer steps
over the whole run; ``epoch`` and ``iter`` (micro-batch index in the epoch) name
the *next* batch to train, so a checkpoint at an epoch end says ``(epoch+1, 0)``.
"""


from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import os
import random
import weakref
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from .checkpoint.export.library_model import library_record
from .checkpoint.tensors.state import unwrap
from .config import Config, TrainConfig
from .data.global_order import micro_batch_seeder, ordered
from .data.loaders import eval_loader, train_loader
from .errors import ConfigError
from .objectives import Objective
from .optim import build_optimizer, build_scheduler
from .process import dist
from .process.stop import StopRequest
from .process.time_limit import TimeLimit
from .run import code_version
from .run.heartbeat import heartbeat
from .process.threads import set_threads
from .run.topology import finished_message
from .train.best import BestTracker
from .train.build import (build_data, build_model, build_objective, data_length, data_resume_policy,
                          user_code_of, warm_start_model)
from .train.callbacks import Callbacks
from .train.checkpointer import Checkpointer, export_live
from .train.ema import EMA
from .train.evaluator import Evaluator
from .train.hang import name_the_hang
from .train.memory import memory_tier
from .train.memory_recovery import start_memory_and_resume
from .train.parallel import is_fsdp, parallelize
from .train.tensor_parallel import ranks_of
from .train.recorder import Recorder
from .train.resume import nothing_left
from .train.session import (after_step, end_session, evaluate_and_record, start_epoch, start_files,
                            stop_before_start, stop_nonfinite, window_flags)
from .train.state import TrainState, end_step
from .train.step import STOP, WindowStep, autocast_context, check_finite
from .train.stop_agreement import StopAgreement

log = logging.getLogger("pimm")


def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy's global RNG and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def untimed(trainer: "Trainer", save: Any, *args: Any, **kwargs: Any) -> None:
    """Run a scheduled save with the rate clock paused: saving is not training time (samples/s)."""
    with trainer.recorder.clock.paused():
        save(*args, **kwargs)


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
        stop: the :class:`~pimm_core.process.stop.StopRequest` this trainer obeys (a new one
            by default, reachable as ``trainer.stop``).
        config_path: the config file; its directory is searched for user code
            (:mod:`pimm_core.targets`).
        model: an ``nn.Module`` to train instead of ``model.target``/``model.name``.
        datasets: the train and validation datasets instead of ``data.target``/``data.name``:
            ``(train, val)``, ``(train, val, collate_fn)``, a :class:`~pimm_core.data.Datasets`
            or anything :func:`~pimm_core.data.as_datasets` takes (map-style or iterable datasets:
            :mod:`pimm_core.data`).
        objective: instead of ``objective``: a built-in name, a target text, an
            :class:`~pimm_core.objectives.Objective` or a function
            ``(model, batch) -> (loss, {metric: value})``.
        pick_threads: choose the intra-op threads (:mod:`pimm_core.process.threads`) also when ``train.threads`` is unset.

    Example with your own code (every keyword is optional; the config names the rest)::

        trainer = Trainer(cfg, model=MyNet(), datasets=(train_ds, val_ds), objective="regression")
        trainer.train(TrainConfig(epochs=100), checkpoint_dir=Path("ckpt"), resume_from=None)

    ``trainer.callbacks``: the config's ``[[callbacks]]`` and any objects (moments and state:
    :mod:`pimm_core.train.callbacks`) or functions ``fn(trainer)`` (after each optimizer step, on
    every rank, before the stop agreement: e.g. to request a stop) appended from Python.

    Its parts: see the module docstring. Under torchrun the process group is created here (gloo
    on CPU, NCCL on CUDA); the model is wrapped in DDP or sharded with FSDP2 (``train.strategy``).
    """

    def __init__(self, config: Config, run_dir: Path | None = None, *, stop: StopRequest | None = None,
                 config_path: str | Path | None = None, model: nn.Module | None = None, datasets: Any = None,
                 objective: Objective | Callable | str | None = None, pick_threads: bool = False):
        self.config_path = config_path
        self.stop = stop or StopRequest()
        self.stopped_before_start = False  # train() ended at once: a stop was asked during start-up
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.info, self.data_info = ranks_of(config)  # data_info: data-parallel ranks (a TP group shares batches)
        # data.order = "global": the window is derived from train.global_batch and the world size
        if config.data.order == "global":
            config = dataclasses.replace(config, train=ordered(config.train, config.data, self.data_info.world_size))
        self.config = config
        self.device = dist.pick_device(config.train.device, self.info)
        dist.init(self.device, self.info, always=config.train.strategy == "fsdp", timeout_min=config.dist.timeout)
        if config.train.amp == "fp16" and self.device.type != "cuda":
            raise ConfigError("train.amp = 'fp16' needs CUDA; use 'bf16' or 'none' on CPU")
        self.data = build_data(config, config_path, datasets)
        self.objective = build_objective(config, config_path, objective)
        torch.manual_seed(config.train.seed)  # identical initial weights on every rank
        model = build_model(config, config_path, model).to(self.device)
        self.threads = set_threads(config.train.threads, model, auto=pick_threads)  # before the first training op
        self.warm_start_report = None  # set by train() when it warm-starts from train.weight
        # DDP, or FSDP2 sharding in place; activation checkpointing and compile (train/parallel.py)
        self.model: nn.Module = parallelize(model, config, self.info, self.device, config_path)
        # (after sharding: under FSDP the averaged copies are sharded like the parameters)
        self.ema = EMA(model, config.ema.decay, config.ema.warmup) if config.ema.enabled else None
        seed_everything(config.train.seed + self.data_info.rank)  # rank-distinct dropout streams (dp ranks)

        d = self.data
        self.loader, self.sampler = train_loader(d.train, config.data, self.data_info, config.train.seed, d.collate_fn,
                                                 config.train.global_batch)
        self.val_loader = eval_loader(d.val, config.data, self.data_info, d.collate_fn, config.eval.batch_size)
        self.data_resume = data_resume_policy(d.train, self.info.is_main)  # "exact" or "replay_from_boundary"
        self.optimizer = build_optimizer(config, unwrap(self.model), config_path)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.train.amp == "fp16")
        self.state = TrainState()
        self._pending_loader_state: dict[str, Any] | None = None
        callbacks = Callbacks.from_config(config, config_path)  # [[callbacks]]; Python may append more
        self._code_version = code_version() if self.info.is_main else None
        self._user_code = user_code_of(model, d, self.objective) if self.info.is_main else []
        self._model_library = library_record(model) if self.info.is_main else None  # how an export writes it
        self.checkpointer = Checkpointer(config, self.info, self.stop, model=self.model, optimizer=self.optimizer,
                                         loader=self.loader, state=self.state, scaler=self.scaler, ema=self.ema,
                                         data_fingerprint=self.data.fingerprint, code_version=self._code_version,
                                         loader_state=self.data_resume == "exact",
                                         data_length=data_length(d.train), callbacks=callbacks, objective=self.objective)
        ref = weakref.ref(self)  # (a weak reference: a part holding the trainer keeps the loaders alive)
        self.checkpointer.on_saved = lambda path: ref().callbacks.fire("on_checkpoint_saved", ref(), path)
        self.stop_agreement = StopAgreement(self.stop, self.info, self.run_dir, self.device)
        self.best = BestTracker(config.eval.metric, config.eval.mode)
        # (a plain function, not a bound method: a part holding the trainer would make a reference
        # cycle that keeps the loaders, and their worker processes, alive until interpreter exit)
        autocast = functools.partial(autocast_context, config.train.amp, self.device.type)
        self.evaluator = Evaluator(self.val_loader, self.device, autocast, config.eval.weights, self.objective)
        self.recorder: Recorder | None = None  # one per train() call

    callbacks = property(lambda self: self.checkpointer.callbacks,  # (the checkpointer saves their state)
                         lambda self, value: setattr(self.checkpointer, "callbacks", Callbacks(value)),
                         doc="The run's callbacks in call order (:class:`~pimm_core.train.callbacks.Callbacks`).")

    # ----------------------------------------------------------------- set-up
    def _build_scheduler(self, t: TrainConfig):
        """The LR schedule of this ``train()`` call (``[scheduler]``, else ``train.scheduler``)."""
        return build_scheduler(dataclasses.replace(self.config, train=t), self.optimizer, self.end_step(t),
                               self.config_path)

    @property
    def micro_batches_per_epoch(self) -> int:
        return len(self.loader)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.micro_batches_per_epoch / self.config.train.grad_accum)

    def end_step(self, t: TrainConfig) -> int:
        """The global step at which training with ``t`` will end from the current position
        (:func:`~pimm_core.train.state.end_step`)."""
        return end_step(self.state, t, micro_batches=self.micro_batches_per_epoch,
                        steps_per_epoch=self.steps_per_epoch)

    def _at_max_steps(self, t: TrainConfig) -> bool:
        return bool(t.max_steps) and self.state.global_step >= t.max_steps

    # ------------------------------------------------------- evaluation, files
    def evaluate(self) -> dict[str, float]:
        """Metrics of the validation split (:class:`~pimm_core.train.evaluator.Evaluator`): the raw
        weights, or the EMA weights when ``eval.weights = "ema"``.

        Returns:
            ``{"val/<metric>": value}`` of the objective, e.g. classification's
            ``{"val/acc": fraction in [0, 1], "val/loss": nats per sample}``.
        """
        return self.evaluator.evaluate(self.model, self.ema)

    def save_checkpoint(self, checkpoint_dir: Path, *, mid_epoch: bool, pointers: tuple[str, ...] = ("last",),
                        selection_metric: dict[str, Any] | None = None, background: bool = False) -> Path:
        """Publish a checkpoint in ``checkpoint_format``; every rank must call it (after :meth:`train`
        started: the checkpoint holds its LR schedule).

        standard: ``last/``; legacy: ``model_last.pth``; single: ``step_<step>.pth`` with
        ``pointers`` (``last``, ``best``, ``final``) moved to it. ``background`` (standard
        format with ``checkpoint.async``) returns once the state is staged to CPU.

        Raises:
            CheckpointSaveError: on every rank, when the write failed.
        """
        return self.checkpointer.save(Path(checkpoint_dir), mid_epoch=mid_epoch, pointers=pointers,
                                      selection_metric=selection_metric, background=background)

    def save_model(self, path: Path, *, weights: str = "raw") -> Path:
        """Export the live model's ``raw`` or ``ema`` weights (rank 0 writes).

        ``path`` ending in ``.safetensors`` writes that file (tied tensors stored once,
        aliases in its metadata); any other suffix writes ``torch.save`` of the plain
        state dict. No DDP or compile prefixes.

        Raises:
            UsageError: ``weights="ema"`` without ``ema.enabled``.
        """
        return export_live(self.checkpointer, Path(path), weights=weights)

    # ------------------------------------------------------------------ train
    def train(self, train_config: TrainConfig | None = None, *, checkpoint_dir: Path | None = None,
              resume_from: Path | None = None) -> TrainState:
        """Train until the configured end.

        Args:
            train_config: replaces ``config.train`` for this call (e.g. more epochs).
            checkpoint_dir: where checkpoints go (``<run_dir>/model`` from the CLI);
                None saves nothing.
            resume_from: a checkpoint (``.../model/last``) to continue from, per the
                resume policy in :mod:`pimm_core.run.topology`.

        Returns:
            The final :class:`TrainState`.

        Raises:
            CheckpointError: ``resume_from`` does not resolve ("No weight found"), is
                incomplete ("Incomplete checkpoint directory"), is a Hub artifact, or its
                state does not fit the model (names the tensors).
        """
        t = self._t = ordered(train_config or self.config.train, self.config.data, self.data_info.world_size)
        self.time_limit = TimeLimit.from_config(t.max_time)  # this session's budget starts now
        if resume_from is None and t != self.config.train:
            # A fresh run trains with `t`: the optimizer (built in __init__ from the config) takes its
            # hyperparameters, and config.toml records it, so `pimm resume` continues with the same.
            self.config = dataclasses.replace(self.config, train=t)
            self.optimizer.load_state_dict(build_optimizer(self.config, unwrap(self.model),
                                                           self.config_path).state_dict())
        self.scheduler = self._build_scheduler(t)
        checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        rec = self.recorder = Recorder(self.run_dir, self.info, self.state, epochs=t.epochs,
                                       steps_per_epoch=self.steps_per_epoch, log_every_steps=t.log_every_steps)
        rec.open_log()  # first: the warm-start report and resume lines belong in train.log
        try:
            with heartbeat(self.run_dir, self.info.rank, self.info.world_size), memory_tier(self.checkpointer):
                entry: dict[str, Any] = {"kind": "start", "checkpoint_dir": str(checkpoint_dir) if checkpoint_dir else None}
                c = self.config
                if resume_from is None and c.train.weight and not c.train.resume:  # a resume never warm-starts
                    self.warm_start_report = warm_start_model(c.train, unwrap(self.model), self.ema, self.info.is_main,
                                                              c.checkpoint, self.info.rank)
                    entry["warm_start"] = self.warm_start_report.to_json()
                self.checkpointer.begin(checkpoint_dir, scheduler=self.scheduler, grad_accum=t.grad_accum)
                entry = start_memory_and_resume(self, entry, resume_from, checkpoint_dir)
                if entry["kind"] != "start":
                    if nothing_left(self, t):
                        # nothing to train: no metrics, no checkpoint, no status change; provenance says so
                        self.state.finished = True
                        if self.info.is_main:
                            log.info("%s", finished_message(self.state.global_step, self.state.epoch, t))
                        start_files(self, {**entry, "finished": True}, fresh=False)
                        return self.state
                rec.total = self.end_step(t)  # the run's horizon, whatever the schedule knows of it
                start_files(self, entry, fresh=entry["kind"] == "start")
                self.stop_agreement.discard_stale()
                rec.pids = dist.all_gather_object(os.getpid())  # every rank's pid, for operators and tests
                self.stop_agreement.file_used = False
                rec.status("running")
                if stop_before_start(self):
                    end_session(self)
                    return self.state
                try:
                    self._loop(t)
                    check_finite(self.model, self.state.global_step)
                except BaseException as e:
                    e = name_the_hang(e, self.run_dir, self.info, self.config.dist.timeout, self.state.global_step)
                    rec.failed(e)  # status.json, and the error line in train.log
                    if isinstance(e, ConfigError) and resume_from is None and self.state.global_step == 0:
                        rec.unstart()  # a config fault found at the first step: the launch leaves no run behind
                    raise e
                end_session(self)
                return self.state
        finally:
            rec.close()

    def _loop(self, t: TrainConfig) -> None:
        s, n_micro, fmt = self.state, self.micro_batches_per_epoch, self.checkpointer.format
        autocast = functools.partial(autocast_context, self.config.train.amp, self.device.type)
        step = WindowStep(self.model, self.optimizer, self.scaler, self.ema, t, autocast=autocast,
                          distributed=self.info.distributed or is_fsdp(self.model), objective=self.objective,
                          before_step=fmt.wait_staged if fmt.asynchronous else None,  # (async: staged first)
                          before_forward=micro_batch_seeder(self.config.train.seed, self.state, self.data_info)
                          if self.config.data.order == "global" else None,
                          window_flags=functools.partial(window_flags, self),  # (stop flags in its all-reduce)
                          on_window_flags=self.stop_agreement.window_verdict, records_next=self.recorder.records_next)
        self.model.train()
        evaluated_at_end = False
        with self.recorder.training():
            while s.epoch < t.epochs and not self._at_max_steps(t):
                epoch = s.epoch
                stop_at_epoch_end = self._train_epoch(step, t)
                if s.stop_reason is not None and not stop_at_epoch_end:
                    break  # stopped mid-epoch: the final save follows, no evaluation
                epoch_done = s.iter >= n_micro
                if epoch_done:
                    s.epoch, s.iter = epoch + 1, 0
                run_ends = s.epoch >= t.epochs or self._at_max_steps(t)
                every = self.config.eval.every_epochs
                if epoch_done and every and ((epoch + 1) % every == 0 or run_ends):
                    evaluate_and_record(self, epoch)
                    evaluated_at_end = run_ends
                if stop_at_epoch_end:
                    break
                if epoch_done:
                    untimed(self, self.checkpointer.on_epoch_end, epoch, run_ends=run_ends)
            if s.stop_reason is None:
                if not evaluated_at_end and self.config.eval.every_epochs and s.eval_step != s.global_step:
                    evaluate_and_record(self, s.epoch - 1 if s.iter == 0 else s.epoch)
                s.finished = True
            failure = self.checkpointer.on_end()
            if failure is not None and s.stop_reason is None:
                s.stop_reason, s.save_error = str(failure), failure

    def _train_epoch(self, step: WindowStep, t: TrainConfig) -> bool:
        """Train the rest of the current epoch, announcing each optimizer step.

        Returns:
            True when the run stops at this epoch's end (after its evaluation).
        """
        s, n_micro = self.state, self.micro_batches_per_epoch
        epoch = s.epoch
        start_epoch(self)
        # a stream yielding more than its __len__ promises is cut at the epoch's end
        batches = self.loader if self.sampler is not None else itertools.islice(self.loader, n_micro - s.iter)
        for outcome, loss, samples in step.windows(batches, s, n_micro, self.device):
            if outcome == STOP:
                stop_nonfinite(self, epoch)
                return s.iter >= n_micro
            after_step(self, outcome, loss, samples, epoch, step.grad_norm)
            if s.stop_reason is not None:
                return s.iter >= n_micro  # True: at the epoch end, its evaluation runs first
            run_ends = self._at_max_steps(t)
            untimed(self, self.checkpointer.on_step, run_ends=run_ends)
            if run_ends:
                break
        else:
            if s.iter < n_micro:  # only a stream can end early (a sampler yields len(loader) batches)
                raise ConfigError(f"data: the train split yielded {s.iter} batches in epoch {epoch}; its __len__ "
                                  f"({len(self.data.train)} samples) promises {n_micro}")
        return False
