"""The Checkpointer: when the trainer saves, in which format, and the weights-only files beside it.

The trainer announces moments — an optimizer step (:meth:`Checkpointer.on_step`), the end
of an epoch (:meth:`~Checkpointer.on_epoch_end`), a new best evaluation
(:meth:`~Checkpointer.on_best`), the end of the session (:meth:`~Checkpointer.on_end`) —
and the Checkpointer decides what to write, as torchtitan's ``CheckpointManager`` does.
The decisions are :class:`SaveSchedule`'s (pure); the writes go through the
:class:`~pimm_core.checkpoint.formats.protocol.CheckpointFormat` of ``checkpoint_format``
(wrapped for background writes with ``checkpoint.async``).

The schedule (``checkpoint.every_steps``, ``every_epochs``, ``keep_iter``):

- an optimizer step inside an epoch at a multiple of ``every_steps``: a mid-epoch save
  (in the background with ``checkpoint.async``), unless the run ends at that step;
- the end of an epoch at a multiple of ``every_steps`` or of ``every_epochs`` epochs: a
  save, unless the run ends there (the final save follows);
- the end of the session: once the save in flight is published, the final save (pointers
  ``last``, plus ``final`` when the run finished), then the removal of the superseded
  ``last.prev`` before the run reports its end;
- after each successful save at a multiple of ``every_steps`` (the final one too, when the
  run finished) with ``keep_iter``: a weights-only ``iter_<step>.pth`` snapshot, the oldest
  beyond ``keep_iter`` removed;
- after each evaluation: ``model_best.pth`` when it improved the selection metric, and with
  ``keep_best`` its ``best_<step>.pth`` when it ranks among the k best (:mod:`.best_files`).

A periodic save that fails, or a best/iter file that cannot be written, is logged; with
``checkpoint.on_error = "stop"`` it stops the run: a stop request whose ``cause`` is the
:class:`~pimm_core.errors.CheckpointSaveError`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sized

import torch
from torch import nn

from ..checkpoint.formats.choose import make_format
from ..checkpoint.formats.optim_structure import built_hyperparameters
from ..checkpoint.formats.protocol import SaveItem
from ..checkpoint.formats.weights_file import weights_payload, write_weights_file
from ..checkpoint.publish.rotation import on_main, retry_stale, short_error, wait_for_purges
from ..checkpoint.select.selection import ITER_RE
from ..checkpoint.tensors.state import full_state_dict, full_tensors, is_sharded, load_problem, rng_state, unwrap
from ..config import CheckpointConfig, Config
from ..errors import CheckpointSaveError, UsageError
from ..faults import point
from ..fsio import remove_stale_temporaries
from ..process import dist
from ..process.dist import DistInfo
from ..process.stop import StopRequest
from ..run import now_iso
from ..run.heartbeat import beat
from . import best_files
from .best_k import BestKeeper
from .ema import EMA
from .loadable import check_loadable, optimizer_class_name, stateful_objective
from .state import TrainState

log = logging.getLogger("pimm")

#: The keys of a checkpoint's trainer state (``meta``), in the order checkpoints have always
#: stored them (the packed bytes stay the same): the parts' state dicts and the topology.
META_ORDER = ("trainer", "scheduler", "scaler", "world_size", "ema", "workers_per_rank", "batch_size", "grad_accum",
              "data_length", "data_fingerprint",
              "callbacks", "objective", "optimizer_class", "optimizer_built")


@dataclass(frozen=True)
class Save:
    """One save the schedule asks for.

    Attributes:
        mid_epoch: the position is inside an epoch (the loader cursor is saved with it).
        snapshot: also write ``iter_<step>.pth`` once the save succeeded.
        background: may be written in the background (``checkpoint.async``).
        pointers: the names it becomes (single format: the symlinks moved to it).
    """

    mid_epoch: bool
    snapshot: bool = False
    background: bool = True
    pointers: tuple[str, ...] = ("last",)


class SaveSchedule:
    """When to save: pure decisions from the position and ``checkpoint.*`` (see the module docstring).

    Args:
        every_steps: save at multiples of this global step (0: never by step).
        every_epochs: save at the end of every this many epochs (0: never by epoch).
        keep_iter: keep this many ``iter_<step>.pth`` snapshots of step saves (0: none).
    """

    def __init__(self, every_steps: int = 0, every_epochs: int = 0, keep_iter: int = 0):
        self.every_steps, self.every_epochs, self.keep_iter = every_steps, every_epochs, keep_iter

    @classmethod
    def from_config(cls, c: CheckpointConfig) -> SaveSchedule:
        return cls(c.every_steps, c.every_epochs, c.keep_iter)

    def _by_step(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def after_step(self, step: int, *, mid_epoch: bool, run_ends: bool) -> Save | None:
        """After optimizer step ``step``; ``mid_epoch``: the epoch has micro-batches left;
        ``run_ends``: this is the run's last step (the final save follows)."""
        if mid_epoch and not run_ends and self._by_step(step):
            return Save(mid_epoch=True, snapshot=bool(self.keep_iter))
        return None

    def after_epoch(self, step: int, epoch: int, *, run_ends: bool) -> Save | None:
        """At the end of epoch ``epoch`` (0-based), after its evaluation, at global step ``step``."""
        by_step = self._by_step(step)
        by_epoch = bool(self.every_epochs) and (epoch + 1) % self.every_epochs == 0
        if run_ends or not (by_step or by_epoch):
            return None
        return Save(mid_epoch=False, snapshot=by_step and bool(self.keep_iter))

    def at_end(self, step: int, *, finished: bool, mid_epoch: bool) -> Save:
        """The final save of a session that ``finished`` (reached its end) or stopped early."""
        return Save(mid_epoch=mid_epoch, snapshot=finished and bool(self.keep_iter) and self._by_step(step),
                    background=False, pointers=("last", "final") if finished else ("last",))



def tp_entry(config: Config) -> dict[str, int]:
    """``{"tp": T}`` when tensor parallel is on; nothing at ``tp = 1`` (absent means 1), so a checkpoint
    without TP holds the same bytes as before."""
    return {"tp": config.parallel.tp} if config.parallel.tp > 1 else {}

class Checkpointer:
    """Saves the trainer's parts when the schedule says so; every rank calls every method.

    Args:
        config: the run configuration (``checkpoint_format``, ``checkpoint.*``, ``eval.*``).
        info: this process's rank layout.
        stop: the run's stop request (a failed save stops the run through it).
        model, optimizer: saved in every checkpoint.
        loader: the training loader (its cursor is saved mid-epoch; ``len`` is micro-batches per epoch).
        state, scaler, ema: parts whose state dicts are saved (mutated in place, never replaced).
        data_fingerprint, code_version: recorded in every manifest.
        data_length: the train split's ``len`` (None: it has none), recorded with the fingerprint in
            every manifest and trainer state: a resume applies the loader cursor only to the same data.
        loader_state: save the loader's cursor mid-epoch; False for a stream without state
            (a resume then replays the epoch: ``has_loader_state`` false).
    """

    def __init__(self, config: Config, info: DistInfo, stop: StopRequest, *, model: nn.Module,
                 optimizer: torch.optim.Optimizer, loader: Any, state: TrainState, scaler: torch.amp.GradScaler,
                 ema: EMA | None, data_fingerprint: str | None, code_version: str | None,
                 loader_state: bool = True, data_length: int | None = None,
                 callbacks: Any = None, objective: Any = None):
        c = config.checkpoint
        self.config, self.info, self.stop = config, info, stop
        self.format = make_format(config.checkpoint_format, info, background=c.async_, keep_last=c.keep_last,
                                  keep_full=c.keep_full)
        self.schedule = SaveSchedule.from_config(c)
        self.keeper = BestKeeper(c.keep_best, config.eval.metric, config.eval.mode)
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.state, self.scaler, self.ema = state, scaler, ema
        self.scheduler: Any = None
        self.grad_accum = config.train.grad_accum
        self.data_fingerprint, self.code_version = data_fingerprint, code_version
        self.data_length = data_length
        self.cursor_problem: str | None = None  # why the loader cursor cannot be saved (load_problem)
        self.loader_state = loader_state
        self.callbacks = callbacks  # their state_dict() goes into every checkpoint
        self.objective = objective  # its state_dict(), when it has one, too
        self.optimizer_built = built_hyperparameters(optimizer)  # each group's settings as the config built them
        self.on_saved: Callable[[Path], None] = lambda path: None  # a checkpoint was published
        self.dir: Path | None = None
        self.failed = False  # a save failed under on_error = "stop": no more saves
        self.uploader: Any = None  # checkpoint.remote: rank 0's background Uploader
        self.last_save_s: float | None = None  # seconds the last synchronous save took (train.max_time's rule)
        self.memory: Any = None  # checkpoint.memory_every_steps: this session's MemorySnapshots (train/memory.py)

    # ------------------------------------------------------------ contents
    def begin(self, checkpoint_dir: Path | None, *, scheduler: Any, grad_accum: int) -> None:
        """A ``train()`` call starts: where its checkpoints go, its LR schedule and accumulation
        window. Rank 0 creates the directory and removes temporaries an interrupted save left."""
        self.dir, self.scheduler, self.grad_accum = checkpoint_dir, scheduler, grad_accum
        if not self.optimizer.state:  # never stepped: its settings are the config's (train() may have rebuilt it)
            self.optimizer_built = built_hyperparameters(self.optimizer)
        if checkpoint_dir is not None and self.info.is_main:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            for name in remove_stale_temporaries(checkpoint_dir):
                log.warning("removed %s, left by a save that was interrupted", checkpoint_dir / name)
            if self.config.checkpoint.remote and self.uploader is None:
                from ..checkpoint.remote.store import run_prefix
                from ..checkpoint.remote.upload import Uploader

                c = self.config.checkpoint
                self.uploader = Uploader(c.remote, c.remote_options, checkpoint_dir,
                                         run_prefix(c.remote, checkpoint_dir.parent), keep_iter=c.keep_iter)

    def _upload(self) -> None:
        """Rank 0: what was just published is also uploaded to ``checkpoint.remote`` (in the background)."""
        if self.uploader is not None:
            self.uploader.request()

    def meta(self) -> dict[str, Any]:
        """The trainer state a checkpoint holds: each part's ``state_dict()`` (None for an absent
        EMA) and the topology it was trained with, under :data:`META_ORDER`'s keys."""
        parts = {"trainer": self.state, "scheduler": self.scheduler, "scaler": self.scaler, "ema": self.ema,
                 "callbacks": self.callbacks, "objective": stateful_objective(self.objective)}
        values: dict[str, Any] = {name: part.state_dict() if part is not None else None for name, part in parts.items()}
        values.update(world_size=self.info.world_size, workers_per_rank=self.config.data.num_workers,
                      data_length=self.data_length, data_fingerprint=self.data_fingerprint, **self._batching(),
                      optimizer_class=optimizer_class_name(self.optimizer), optimizer_built=self.optimizer_built)
        return {key: values[key] for key in META_ORDER} | tp_entry(self.config)

    def _batching(self) -> dict[str, Any]:
        """Per-rank micro-batch size and accumulation window (recorded with every checkpoint), and
        the data order with its global batch (in the manifest only)."""
        return {"batch_size": self.config.data.batch_size, "grad_accum": self.grad_accum,
                "data_order": self.config.data.order, "global_batch": self.config.train.global_batch}

    def manifest(self, kind: str, has_loader_state: bool = False) -> dict[str, Any]:
        """The manifest fields of a checkpoint of ``kind`` at the current position."""
        s = self.state
        return {"kind": kind, "step": s.global_step, "epoch": s.epoch, "iter": s.iter,
                "has_loader_state": has_loader_state, "code_version": self.code_version,
                "world_size": self.info.world_size, "strategy": self.config.train.strategy,
                "workers_per_rank": self.config.data.num_workers,
                **self._batching(), "epoch_start_step": s.epoch_start_step, "metrics": s.last_eval,
                "created": now_iso(), "torch_version": torch.__version__, "data_fingerprint": self.data_fingerprint,
                "data_length": self.data_length, **tp_entry(self.config)}

    def ema_weights(self) -> dict[str, torch.Tensor] | None:
        """The EMA weight set of the model as it is now, or None without EMA."""
        return self.ema.state_dict_for(unwrap(self.model)) if self.ema is not None else None

    @property
    def micro_batches(self) -> int:
        loader: Sized = self.loader
        return len(loader)

    # ------------------------------------------------------------- saving
    def save(self, checkpoint_dir: Path, *, mid_epoch: bool, pointers: tuple[str, ...] = ("last",),
             selection_metric: dict[str, Any] | None = None, background: bool = False) -> Path:
        """Publish a checkpoint of the current position in ``checkpoint_format``.

        Returns:
            The path it is published as (``last/``, ``model_last.pth``, ``step_<step>.pth``).

        Raises:
            CheckpointSaveError: on every rank, when the write failed.
        """
        s = self.state
        beat("save", "last" if pointers == ("last",) else "+".join(pointers))
        loader = self._loader_state() if mid_epoch and self.loader_state else None
        rank_state = {"rng": rng_state(), "loader": loader}
        manifest = self.manifest("last", loader is not None)
        if mid_epoch and self.loader_state and loader is None:
            manifest["loader_state_problem"] = self.cursor_problem
        if selection_metric is not None:
            manifest["selection_metric"] = selection_metric
        meta = self.meta()
        check_loadable(meta, self.model, self.info, manifest)  # (a walk of the non-tensor state; a gather at 2+ ranks)
        item = SaveItem(model=self.model, optimizer=self.optimizer, meta=meta, rank_state=rank_state,
                        manifest=manifest, step=s.global_step, ema_weights=self.ema_weights, pointers=pointers,
                        gather_weights=self.config.checkpoint.gather_weights)
        started = time.monotonic()
        path = self.format.save(checkpoint_dir, item, background=background)
        if not (background and self.format.asynchronous):
            self.last_save_s = time.monotonic() - started
        if self.info.is_main and not (background and self.format.asynchronous):
            # (a background save logs "saved" from its writer thread once it is published)
            log.info("saved %s (step %d, epoch %d, iter %d)", path, s.global_step, s.epoch, s.iter)
        self._upload()
        self.on_saved(path)
        return path

    def _loader_state(self) -> dict[str, Any] | None:
        """The loader cursor to save, or None when a resume could not load it (a dataset state
        holding an enum or a user class: :func:`~pimm_core.checkpoint.tensors.state.load_problem`, agreed
        by every rank): the checkpoint is then saved without it, and rank 0 warns with the fix."""
        state = self.loader.state_dict()
        problem = load_problem(state)
        if self.info.distributed:
            problem = next((p for p in dist.all_gather_object(problem) if p), None)
        if problem is None:
            return state
        if self.info.is_main and problem != self.cursor_problem:
            log.warning("warning: the loader cursor cannot be saved so that a resume loads it (the train split's "
                        "state_dict(): %s); checkpoints hold no loader cursor until it can, and a resume inside an "
                        "epoch replays that epoch from its start", problem)
        self.cursor_problem = problem
        return None

    def _periodic(self, save: Save) -> None:
        """A scheduled save; on failure log loudly and, with ``checkpoint.on_error = "stop"``
        (default), stop the run rather than train on without checkpoints."""
        try:
            self.save(self.dir, mid_epoch=save.mid_epoch, background=save.background)
        except CheckpointSaveError as e:
            if self.info.is_main:
                log.error("ERROR: %s", e)
            if self.config.checkpoint.on_error == "stop":
                self.failed = True
                self.stop.request(str(e), cause=e)
            return
        if save.snapshot:
            self._snapshot()

    def _last_purge(self) -> None:
        """Rank 0 at the run's end: wait for the background removals, try once more what could not be
        removed, and warn naming what is still there (it never fails the run)."""
        if not wait_for_purges():
            return
        for path in retry_stale(self.dir):
            log.warning("warning: %s (a superseded checkpoint) could still not be removed; the next save of "
                        "this run tries again, or remove it yourself", path)

    def _payload(self) -> dict[str, Any] | None:
        """What a weights-only file holds: made on every rank when the model is sharded (a
        gather), else on rank 0 alone (None on the others)."""
        if self.info.is_main or is_sharded(self.model):
            return weights_payload(self.model, self.ema_weights())
        return None

    def _write_weights(self, path: Path, manifest: dict[str, Any], payload: dict[str, Any]) -> bool:
        """Rank 0 writes a weights-only file (best, iter); a failure is loud and, by default, stops the run."""
        try:
            write_weights_file(path, self.model, manifest, payload=payload)
            return True
        except (OSError, RuntimeError) as e:  # (torch.save's zip writer raises RuntimeError for a failed write)
            cause = short_error(e, path.parent)
            log.error("ERROR: writing %s failed: %s", path, cause)
            if self.config.checkpoint.on_error == "stop":
                error = CheckpointSaveError(f"checkpoint save failed: {cause}")
                self.stop.request(str(error), cause=error)
            return False

    def _snapshot(self) -> None:
        """Rank 0: ``iter_<step>.pth``, then the oldest snapshots beyond ``checkpoint.keep_iter`` removed."""
        payload = self._payload()
        if not self.info.is_main:
            return
        if not self._write_weights(self.dir / f"iter_{self.state.global_step}.pth", self.manifest("iter"), payload):
            return
        snaps = sorted((int(m.group(1)), p) for p in self.dir.iterdir() if (m := ITER_RE.match(p.name)))
        for _, old in snaps[: max(0, len(snaps) - self.schedule.keep_iter)]:
            # The file before its sidecar: a reader beside the run never finds a snapshot without its
            # manifest (`checkpoints verify` would say "cannot verify"); a sidecar alone is ignored.
            old.unlink(missing_ok=True)
            point("checkpoint.snapshot_pruning", old)  # (tests: a reader looks at model/ here)
            old.with_name(old.name + ".json").unlink(missing_ok=True)
        for side in self.dir.glob("iter_*.pth.json"):  # left alone by a crash between those two removals
            if not side.with_suffix("").exists() and side.name != f"iter_{self.state.global_step}.pth.json":
                side.unlink(missing_ok=True)
        self._upload()

    # ------------------------------------------------------------- moments
    def on_step(self, *, run_ends: bool) -> None:
        """After an optimizer step that did not stop the run mid-epoch."""
        if self.dir is None:
            return
        save = self.schedule.after_step(self.state.global_step, mid_epoch=self.state.iter < self.micro_batches,
                                        run_ends=run_ends)
        if save is not None:
            self._periodic(save)
        if self.memory is not None:  # the memory tier's snapshot of an N-th step
            self.memory.on_step(run_ends=run_ends)

    def on_epoch_end(self, epoch: int, *, run_ends: bool) -> None:
        """After epoch ``epoch`` ended (and its evaluation ran), unless the run stops there."""
        if self.dir is None:
            return
        save = self.schedule.after_epoch(self.state.global_step, epoch, run_ends=run_ends)
        if save is not None:
            self._periodic(save)
        if self.memory is not None:
            self.memory.on_epoch_end(run_ends=run_ends)

    def on_evaluated(self, epoch: int, selection: dict[str, Any], *, improved: bool) -> None:
        """The evaluation of ``epoch`` gave ``selection`` (its name, value, mode, split, epoch, weights);
        ``improved``: it is the new best. Writes ``model_best.pth`` (or moves ``best``) and, with
        ``checkpoint.keep_best >= 2``, the kept ``best_<step>.pth`` (:mod:`.best_files`)."""
        best_files.on_evaluated(self, epoch, selection, improved=improved)

    def on_best(self, epoch: int, selection: dict[str, Any]) -> dict[str, Any] | None:
        """The evaluation of ``epoch`` improved the selection metric (:func:`.best_files.on_best`)."""
        return best_files.on_best(self, epoch, selection)

    def on_end(self) -> CheckpointSaveError | None:
        """The session ends (finished or stopped): wait for the save in flight, then the final save.

        Returns:
            The failure of the save that was in flight (the final save is then skipped), or None.

        Raises:
            CheckpointSaveError: the final save failed (on every rank).
        """
        s = self.state
        failure = None
        if self.format.asynchronous and not self.failed:
            beat("save", "waiting for the save in flight")
            try:
                self.format.wait()  # a stop or the end waits for the save in flight
            except CheckpointSaveError as e:
                if self.info.is_main:
                    log.error("ERROR: %s", e)
                self.failed = True
                failure = e
        if self.dir is not None and not self.failed:
            save = self.schedule.at_end(s.global_step, finished=s.finished, mid_epoch=0 < s.iter < self.micro_batches)
            self.save(self.dir, mid_epoch=save.mid_epoch, pointers=save.pointers, background=save.background)
            if save.snapshot:
                self._snapshot()
            # the last save's superseded checkpoint is removed before the run reports its end
            on_main(self.info, self._last_purge, self.dir / "last.prev", self.dir)
        self._finish_upload()
        return failure

    def _finish_upload(self) -> None:
        """Rank 0: wait (at most ``checkpoint.remote_timeout``) for the uploads; say what is not on the remote."""
        if self.uploader is not None:
            self.uploader.finish(self.config.checkpoint.remote_timeout)
            self.uploader = None


def export_live(ck: Checkpointer, path: Path, *, weights: str = "raw") -> Path:
    """Rank 0 writes the live model's ``raw`` or ``ema`` weights to ``path``: a ``.safetensors``
    file, else ``torch.save`` of the plain state dict (see :meth:`Trainer.save_model`).

    Raises:
        UsageError: ``weights="ema"`` without EMA; ``path`` is a directory or lies in a
            checkpoint or a run's ``model/`` directory.
    """
    from ..checkpoint.export.model_dir import write_bin, write_safetensors
    from ..checkpoint.records.outputs import check_output_file

    check_output_file(path)  # every rank: a refused path raises everywhere, before the gather
    if weights == "ema" and ck.ema is None:
        raise UsageError("this run keeps no EMA weights (ema.enabled = false); use weights='raw'")
    # (sharded: a gather every rank takes part in; rank 0 gets the full tensors)
    sd = full_tensors(ck.ema_weights()) if weights == "ema" else full_state_dict(ck.model)
    if ck.info.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        (write_safetensors if path.suffix == ".safetensors" else write_bin)(sd, path)
    return path
