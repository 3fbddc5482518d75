"""``checkpoint.async = true``: the standard format with periodic saves written in the background.

:class:`AsyncStandardFormat` wraps :class:`~pimm_core.checkpoint.formats.standard.StandardFormat`
(the pattern of Lightning's ``AsyncCheckpointIO``): ``save(..., background=True)`` stages
the state to CPU and returns while a background thread writes and publishes it; any other
save first waits for the one in flight, then saves through the wrapped format. The files
are those of a synchronous standard save. For a sharded (FSDP2) model nothing is gathered
on the training thread: once every rank has written its shards, rank 0's background
thread reads ``weights.pth``'s tensors back from ``trainer.dcp/`` (the same values a gather
gives, without stalling the ranks).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.staging import AsyncStager

from ...errors import CheckpointSaveError
from ...fsio import release_cached_pages
from ...process import dist
from ..publish.follow import FollowingHasher
from ..publish.rotation import follow_hashes, intact_note, on_main, prepare, publish, remove_quietly, short_error
from ..select.selection import TRAINER_DCP, WEIGHTS_FIELD
from ..tensors.staging import StagingBuffers
from ..tensors.state import is_sharded, unwrap
from ..tensors.ties import find_aliases
from .protocol import LoadedState, SaveItem
from .sharded import read_checkpoint_weights
from .standard import StandardFormat, dcp_state
from .weights_file import weights_payload


class _ReusedStaging(StagingBuffers, AsyncStager):
    """DCP's stager for :class:`AsyncStandardFormat`: CPU copies of the checkpointed tensors in
    :class:`~..tensors.staging.StagingBuffers` kept from one save to the next (staging is all
    of an async save's stall). Safe because at most one save is in flight
    (:meth:`AsyncStandardFormat.save_in_background` waits for the previous one before copying).
    """

    _synchronize_after_execute = False

    def __init__(self, pool: ThreadPoolExecutor | None = None) -> None:
        super().__init__()
        self.pool = pool

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | Future:
        """Copy DCP's state dict into the kept buffers: on :attr:`pool` when set (DCP's
        ``async_save`` then waits for the returned future before writing), else now."""
        if self.pool is None:
            return self._stage_now(state_dict)
        return self.pool.submit(self._stage_now, state_dict)

    def _stage_now(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k: self.copy(f"dcp/{k}", v) if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}


class AsyncStandardFormat:
    """The standard format whose ``background`` saves are written in the background.

    A background ``save`` stages the state to CPU (the optimizer and trainer state through
    DCP's ``async_save``, the ``weights.pth`` tensors here, both into :class:`_ReusedStaging`
    buffers) and returns; the write runs in a
    background thread, DCP's collectives on a separate gloo process group so they never
    interleave with training collectives. Publication — ``trainer.dcp/.complete``,
    ``weights.pth``, ``manifest.json``, ``.complete`` and the rotation — happens only
    after the background write has finished. At most one save is in flight: the next
    ``save`` (and :meth:`wait`) waits for the previous one. Until it is published the
    previous ``last`` stays the selected candidate, so a crash mid-write loses nothing
    but the save in flight.

    Args:
        inner: the wrapped synchronous format (loads, and saves that are not ``background``).
    """

    name = "standard"
    asynchronous = True

    def __init__(self, inner: StandardFormat):
        self.inner = inner
        self.info = info = inner.info
        self.pg = torch.distributed.new_group(backend="gloo", timeout=dist.timeout()) if info.distributed else None
        self._future = None
        self._thread = None
        self._error: str | None = None
        self._tmp: Path | None = None  # where the save in flight writes
        # Staging copies run on this thread while the training thread goes on with the next
        # forward/backward passes; the trainer calls wait_staged() before the optimizer
        # step, the first thing that changes what is being copied.
        self._staging_pool = ThreadPoolExecutor(1, thread_name_prefix="pimm-staging")
        self._staging = _ReusedStaging(self._staging_pool)
        self._staged: list[Future] = []

    def save(self, model_dir: Path, item: SaveItem, *, background: bool = False) -> Path:
        """A ``background`` save starts (see :meth:`save_in_background`); any other waits for the
        save in flight to be published (before it rotates ``last``), then saves synchronously."""
        if background:
            return self.save_in_background(model_dir, item)
        self.wait()
        return self.inner.save(model_dir, item)

    def load(self, path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             strict: bool = True, ema_target: dict[str, torch.Tensor] | None = None) -> LoadedState:
        return self.inner.load(path, model=model, optimizer=optimizer, strict=strict, ema_target=ema_target)

    def save_in_background(self, model_dir: Path, item: SaveItem, name: str = "last") -> Path:
        """Start a background save (every rank calls it); returns the path it will publish.

        Until :meth:`wait_staged` returns, the parameters, EMA weights and optimizer state
        must not change (the trainer waits before its next optimizer step). Buffers
        (BatchNorm running statistics change in forward) and the packed trainer state are
        copied before this returns.

        Raises:
            CheckpointSaveError: the previous background save failed (on every rank).
        """
        ema_state_dict = item.ema_weights()
        self.wait()
        final, tmp = model_dir / name, model_dir / f"{name}.tmp"
        self._tmp = tmp

        on_main(self.info, lambda: prepare(tmp), tmp, model_dir)
        if self.info.local_rank == 0:  # on the staging thread, which runs before the write starts
            self._staging_pool.submit(release_cached_pages, final)
        hasher = follow_hashes(tmp) if self.info.is_main else None
        try:
            self._start(model_dir, final, tmp, hasher, model=item.model, optimizer=item.optimizer, meta=item.meta,
                        rank_state=item.rank_state, manifest=item.manifest, ema_state_dict=ema_state_dict,
                        gather_weights=item.gather_weights)
        except BaseException:
            if hasher is not None:  # the publishing thread, which owns it otherwise, never started
                hasher.close()
            raise
        return final

    def _start(self, model_dir: Path, final: Path, tmp: Path, hasher: FollowingHasher | None, *, model: nn.Module,
               optimizer: torch.optim.Optimizer, meta: dict[str, Any], rank_state: dict[str, Any],
               manifest: dict[str, Any], ema_state_dict: dict[str, torch.Tensor] | None,
               gather_weights: bool = True) -> None:
        """Stage and start the background write; on rank 0 also the thread that publishes it."""
        plain = unwrap(model)
        state = dcp_state(plain, optimizer, meta, rank_state, self.info.rank, ema_state_dict)
        response = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(tmp / TRAINER_DCP, sync_files=True),
                                  process_group=self.pg, no_dist=not self.info.distributed,
                                  async_stager=self._staging)
        future = self._future = response.upload_completion  # wait() waits for it even if the rest fails
        self._staged = [response.staging_completion]
        payload: dict[str, Any] | None = None
        sharded = is_sharded(plain)
        if sharded and not gather_weights:
            manifest = {**manifest, WEIGHTS_FIELD: TRAINER_DCP}
        elif self.info.is_main and not sharded:
            payload = weights_payload(plain, ema_state_dict)
        if not self.info.is_main:
            return
        staged = self._stage_weights(plain, payload) if payload is not None else None
        # Sharded: no gather on the training thread (a collective that would stall every rank);
        # once every rank's shards are written, rank 0 reads weights.pth's tensors back from them.
        from_shards = sharded and gather_weights

        def finish() -> None:
            try:
                future.result()  # rank 0's completes after every rank's write (DCP's finish step)
                if staged is not None:
                    staged[1].result()
                weights = read_checkpoint_weights(tmp) if from_shards else staged[0] if staged is not None else None
                publish(tmp, final, weights, manifest, hasher, getattr(self.inner, "keep_full", 1))
                logging.getLogger("pimm").info("saved %s (step %s, epoch %s, iter %s; written in the background)",
                                               final, manifest.get("step"), manifest.get("epoch"),
                                               manifest.get("iter"))
            except (Exception, CheckpointException) as e:  # (DCP's is a BaseException)
                hasher.close()
                cause = short_error(e, tmp)  # (before the removal: the file system's state names the cause)
                remove_quietly(tmp)
                self._error = f"checkpoint save failed: {cause}{intact_note(model_dir)}"

        self._thread = threading.Thread(target=finish, name="pimm-async-save", daemon=False)
        self._thread.start()

    def _stage_weights(self, plain: nn.Module, payload: dict[str, Any]) -> tuple[dict[str, Any], Future]:
        """Copy ``weights.pth``'s tensors into staging buffers: the model's buffers (changed by
        forward passes) now, the rest on the staging thread (the returned future, which
        :meth:`wait_staged` also waits for). Tied entries are copied once and stay tied."""
        buffers = {n for n, _ in plain.named_buffers()}
        weights = {k: dict(v) if isinstance(v, dict) else v for k, v in payload.items()}
        ties = {k: find_aliases(v) for k, v in weights.items() if isinstance(v, dict)}  # copied once, kept tied
        for n in buffers & weights["state_dict"].keys() - ties["state_dict"].keys():
            weights["state_dict"][n] = self._staging.copy(f"state_dict/{n}", weights["state_dict"][n])

        def stage_weights() -> None:
            for k, v in weights.items():
                if isinstance(v, dict):
                    for n, t in v.items():
                        if not (k == "state_dict" and n in buffers) and n not in ties[k]:
                            v[n] = self._staging.copy(f"{k}/{n}", t)
                    v.update({alias: v[kept] for alias, kept in ties[k].items()})

        weights_staged = self._staging_pool.submit(stage_weights)
        self._staged.append(weights_staged)
        return weights, weights_staged

    def wait_staged(self) -> None:
        """Block until the save in flight has copied everything it saves (not until it is
        written): after this the parameters and optimizer state may change. A staging
        failure is reported by :meth:`wait`."""
        if self._staged:
            futures_wait(self._staged)
            self._staged = []

    @property
    def in_flight(self) -> bool:
        return (self._thread is not None and self._thread.is_alive()) or (
            self._future is not None and not self._future.done())

    def wait(self) -> None:
        """Block until the save in flight is published (every rank calls it at the same point).

        Raises:
            CheckpointSaveError: on every rank, when the background save failed.
        """
        error = None
        self.wait_staged()
        try:
            if self._future is not None:
                self._future.result()
        except (Exception, CheckpointException) as e:  # (DCP's is a BaseException)
            error = f"checkpoint save failed: {short_error(e, self._tmp)}"
        if self._thread is not None:
            self._thread.join()
        error = self._error or error  # rank 0's publishing thread adds what a resume would now select
        self._future = self._thread = None
        self._error = None
        errors = dist.all_gather_object(error) if self.info.distributed else [error]
        first = next((e for e in errors if e), None)
        if first:
            raise CheckpointSaveError(first)
