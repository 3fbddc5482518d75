"""The training loop.

One optimizer step per accumulation window of ``train.grad_accum`` micro-batches
(the last window of an epoch may be shorter; its loss is averaged over the
micro-batches it has). The LR schedule advances once per optimizer step. At the
end of an epoch the evaluator runs first and the checkpoint saver second, so the
saver sees the evaluator's result of the same epoch (``model_best.pth``).

Counters follow PyTorch/torchtitan usage: ``global_step`` counts optimizer steps
over the whole run; ``epoch`` and ``iter`` (micro-batch index in the epoch) name
the *next* batch to train, so a checkpoint at an epoch end says ``(epoch+1, 0)``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import socket
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import dist
from .checkpoint.selection import BEST, ITER_RE
from .checkpoint.standard import save_standard, unwrap, write_weights_file
from .checkpoint.state import rng_state
from .config import Config, TrainConfig, write_config
from .data import build_datasets, eval_loader, train_loader
from .errors import ConfigError
from .models import build_model
from .run import CONFIG, LOG, METRICS, MODEL, MetricsWriter, append_provenance, code_version, now_iso, write_status

log = logging.getLogger("pimm")

EVAL_METRICS = ("val/acc", "val/loss")


@dataclass
class TrainState:
    """Progress of a run; :meth:`Trainer.train` returns it.

    Attributes:
        global_step: optimizer steps taken over the whole run.
        epoch: epoch of the next batch to train (0-based).
        iter: micro-batch index of the next batch within ``epoch``.
        best_metric: best value of ``eval.metric`` so far (None before any evaluation).
        best_epoch: epoch (0-based) that produced ``best_metric``.
        last_eval: metrics of the latest evaluation, e.g. ``{"val/acc": 0.97, "val/loss": 0.1}``.
        stop_reason: None when the run reached its end; otherwise why it stopped early.
        finished: the run reached its configured end (epochs or ``train.max_steps``).
    """

    global_step: int = 0
    epoch: int = 0
    iter: int = 0
    best_metric: float | None = None
    best_epoch: int | None = None
    last_eval: dict[str, float] = field(default_factory=dict)
    stop_reason: str | None = None
    finished: bool = False


def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy's global RNG and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float, kind: str) -> float:
    """Multiplier of the base LR after ``step`` optimizer steps.

    Linear warmup over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``
    (SGDR, Loshchilov & Hutter 2017, without restarts), or constant.
    """
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


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

    Under torchrun the process group is created here (gloo on CPU, NCCL on CUDA) and
    the model is wrapped in DDP.
    """

    def __init__(self, config: Config, run_dir: Path | None = None):
        self.config = config
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.info = dist.env_world()
        self.device = dist.pick_device(config.train.device, self.info)
        dist.init(self.device, self.info)
        if config.train.amp == "fp16" and self.device.type != "cuda":
            raise ConfigError("train.amp = 'fp16' needs CUDA; use 'bf16' or 'none' on CPU")
        if config.eval.metric not in EVAL_METRICS:
            raise ConfigError(f"eval.metric = {config.eval.metric!r} is not produced by the evaluator; use one of {list(EVAL_METRICS)}")

        self.data = build_datasets(config.data)
        torch.manual_seed(config.train.seed)  # identical initial weights on every rank
        model = build_model(config.model, self.data.in_features, self.data.in_shape, self.data.num_classes).to(self.device)
        self.model: nn.Module = DDP(model) if self.info.distributed else model
        seed_everything(config.train.seed + self.info.rank)  # rank-distinct dropout streams

        self.loader, self.sampler = train_loader(self.data.train, config.data, self.info, config.train.seed)
        self.val_loader = eval_loader(self.data.val, config.data, self.info)
        self.optimizer = self._build_optimizer()
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.train.amp == "fp16")
        self.state = TrainState()
        self._metrics: MetricsWriter | None = None

    # ----------------------------------------------------------------- set-up
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

    def total_steps(self, t: TrainConfig) -> int:
        total = t.epochs * self.steps_per_epoch
        return min(total, t.max_steps) if t.max_steps else total

    def _build_scheduler(self, t: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
        total = self.total_steps(t)
        ratio = t.min_lr / t.lr if t.lr else 0.0
        return torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup=t.warmup_steps, total=total, min_ratio=ratio, kind=t.scheduler))

    def _autocast(self):
        amp = self.config.train.amp
        if amp == "none":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)

    # ---------------------------------------------------------------- logging
    def _setup_files(self, checkpoint_dir: Path | None) -> None:
        if self.run_dir is None or not self.info.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_config(self.config, self.run_dir / CONFIG)
        handler = logging.FileHandler(self.run_dir / LOG)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        self._metrics = MetricsWriter(self.run_dir / METRICS)
        base = {
            "code_version": code_version(), "torch_version": torch.__version__, "host": socket.gethostname(),
            "world_size": self.info.world_size, "workers_per_rank": self.config.data.num_workers,
            "data_fingerprint": self.data.fingerprint, "python": sys.version.split()[0],
        }
        append_provenance(self.run_dir, base, {"time": now_iso(), "kind": "start", "world_size": self.info.world_size,
                                               "workers_per_rank": self.config.data.num_workers,
                                               "checkpoint_dir": str(checkpoint_dir) if checkpoint_dir else None})

    def _status(self, state: str, **extra: Any) -> None:
        if self.run_dir is not None and self.info.is_main:
            s = self.state
            write_status(self.run_dir, state, step=s.global_step, epoch=s.epoch, iter=s.iter,
                         total_steps=self._total, steps_per_epoch=self.steps_per_epoch,
                         epochs=self._t.epochs, world_size=self.info.world_size, stop_reason=s.stop_reason, **extra)

    def _record(self, record: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(record)

    # ------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Accuracy and mean cross-entropy on the validation split, summed exactly over ranks.

        Returns:
            ``{"val/acc": fraction in [0, 1], "val/loss": nats per sample}``.
        """
        model = unwrap(self.model)
        was_training = model.training
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64)
        for x, y, _ in self.val_loader:
            x, y = x.to(self.device), y.to(self.device)
            with self._autocast():
                logits = model(x)
            totals[0] += F.cross_entropy(logits.float(), y, reduction="sum").item()
            totals[1] += (logits.argmax(1) == y).sum().item()
            totals[2] += len(y)
        dist.all_reduce_sum(totals)
        model.train(was_training)
        return {"val/acc": float(totals[1] / totals[2]), "val/loss": float(totals[0] / totals[2])}

    # ------------------------------------------------------------ checkpoints
    def _meta(self) -> dict[str, Any]:
        return {"trainer": asdict(replace(self.state, stop_reason=None)), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(), "world_size": self.info.world_size,
                "workers_per_rank": self.config.data.num_workers}

    def _manifest(self, kind: str) -> dict[str, Any]:
        s = self.state
        return {"kind": kind, "step": s.global_step, "epoch": s.epoch, "iter": s.iter,
                "world_size": self.info.world_size, "workers_per_rank": self.config.data.num_workers,
                "metrics": s.last_eval, "created": now_iso(), "torch_version": torch.__version__,
                "data_fingerprint": self.data.fingerprint}

    def save_checkpoint(self, checkpoint_dir: Path, *, mid_epoch: bool) -> Path:
        """Publish ``checkpoint_dir/last`` (standard format); every rank must call it."""
        rank_state = {"rng": rng_state(), "loader": self.loader.state_dict() if mid_epoch else None}
        path = save_standard(checkpoint_dir, model=self.model, optimizer=self.optimizer, meta=self._meta(),
                             rank_state=rank_state, manifest=self._manifest("last"), info=self.info)
        log.info("saved %s (step %d, epoch %d, iter %d)", path, self.state.global_step, self.state.epoch, self.state.iter)
        return path

    def _save_iter_snapshot(self, checkpoint_dir: Path) -> None:
        if not self.info.is_main:
            return
        write_weights_file(checkpoint_dir / f"iter_{self.state.global_step}.pth", self.model, self._manifest("iter"))
        keep = self.config.checkpoint.keep_iter
        snaps = sorted((int(m.group(1)), p) for p in checkpoint_dir.iterdir() if (m := ITER_RE.match(p.name)))
        for _, old in snaps[: max(0, len(snaps) - keep)]:
            old.with_name(old.name + ".json").unlink(missing_ok=True)
            old.unlink(missing_ok=True)

    def _update_best(self, metrics: dict[str, float], epoch: int, checkpoint_dir: Path | None) -> None:
        e = self.config.eval
        value = metrics[e.metric]
        best = self.state.best_metric
        if best is not None and not (value > best if e.mode == "max" else value < best):
            return
        self.state.best_metric, self.state.best_epoch = value, epoch
        if checkpoint_dir is not None and self.info.is_main:
            manifest = {**self._manifest("best"), "selection_metric": {
                "name": e.metric, "value": value, "mode": e.mode, "split": "val", "epoch": epoch}}
            write_weights_file(checkpoint_dir / BEST, self.model, manifest)

    # ------------------------------------------------------------------ train
    def train(self, train_config: TrainConfig | None = None, *, checkpoint_dir: Path | None = None,
              resume_from: Path | None = None) -> TrainState:
        """Train until the configured end.

        Args:
            train_config: replaces ``config.train`` for this call (e.g. more epochs).
            checkpoint_dir: where checkpoints go (``<run_dir>/model`` from the CLI);
                None saves nothing.
            resume_from: reserved for resume (not available in this version).

        Returns:
            The final :class:`TrainState`.
        """
        t = train_config or self.config.train
        self._t = t
        self.scheduler = self._build_scheduler(t)
        self._total = self.total_steps(t)
        checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        if checkpoint_dir is not None and self.info.is_main:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self._setup_files(checkpoint_dir)
        self._status("running")
        try:
            self._loop(t, checkpoint_dir)
        except BaseException as e:
            self._status("failed", error=f"{e.__class__.__name__}: {e}")
            raise
        self._status("finished" if self.state.finished else "stopped")
        if self._metrics is not None:
            self._metrics.close()
        return self.state

    def _loop(self, t: TrainConfig, checkpoint_dir: Path | None) -> None:
        s = self.state
        ckpt = self.config.checkpoint
        accum = t.grad_accum
        n_micro = self.micro_batches_per_epoch
        batch = self.config.data.batch_size
        model, optimizer, scheduler, scaler = self.model, self.optimizer, self.scheduler, self.scaler
        model.train()
        progress = _Progress(self.info.is_main, total=self._total)
        progress.start(s.global_step)
        evaluated_at_end = False
        last_log_time, last_log_samples, samples = time.perf_counter(), 0, 0
        try:
            while s.epoch < t.epochs and not self._at_max_steps(t):
                epoch = s.epoch
                self.sampler.set_epoch(epoch)
                window_loss = torch.zeros((), device=self.device)
                for x, y, _ in self.loader:
                    x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                    window_start = (s.iter // accum) * accum
                    window_len = min(accum, n_micro - window_start)
                    last_in_window = s.iter + 1 == window_start + window_len
                    sync = contextlib.nullcontext() if (last_in_window or not self.info.distributed) else model.no_sync()
                    with sync:
                        with self._autocast():
                            loss = F.cross_entropy(model(x), y) / window_len
                        scaler.scale(loss).backward()
                    window_loss += loss.detach()
                    s.iter += 1
                    samples += len(y)
                    if not last_in_window:
                        continue
                    if t.grad_clip:
                        scaler.unscale_(optimizer)
                        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad(set_to_none=True)
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
                    at_max = self._at_max_steps(t)
                    if checkpoint_dir is not None and ckpt.every_steps and s.global_step % ckpt.every_steps == 0 \
                            and s.iter < n_micro and not at_max:
                        self.save_checkpoint(checkpoint_dir, mid_epoch=True)
                        if ckpt.keep_iter:
                            self._save_iter_snapshot(checkpoint_dir)
                    if at_max:
                        break
                epoch_done = s.iter >= n_micro
                if epoch_done:
                    s.epoch, s.iter = epoch + 1, 0
                is_end = s.epoch >= t.epochs or self._at_max_steps(t)
                if epoch_done and self.config.eval.every_epochs and (
                        (epoch + 1) % self.config.eval.every_epochs == 0 or is_end):
                    self._evaluate_and_record(epoch, checkpoint_dir)
                    evaluated_at_end = is_end
                if checkpoint_dir is not None and not is_end and epoch_done and ckpt.every_epochs \
                        and (epoch + 1) % ckpt.every_epochs == 0:
                    self.save_checkpoint(checkpoint_dir, mid_epoch=False)
            if not evaluated_at_end and self.config.eval.every_epochs:
                self._evaluate_and_record(s.epoch - 1 if s.iter == 0 else s.epoch, checkpoint_dir)
            s.finished = True
            if checkpoint_dir is not None:
                self.save_checkpoint(checkpoint_dir, mid_epoch=0 < s.iter < n_micro)
        finally:
            progress.stop()

    def _at_max_steps(self, t: TrainConfig) -> bool:
        return bool(t.max_steps) and self.state.global_step >= t.max_steps

    def _evaluate_and_record(self, epoch: int, checkpoint_dir: Path | None) -> None:
        metrics = self.evaluate()
        self.state.last_eval = metrics
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
