"""The memory tier's snapshots (``checkpoint.memory_every_steps = N``): every N-th optimizer step each
rank stages its complete trainer state into CPU memory, and a background thread writes it to
node-local shared memory and sends it to its buddy rank (:mod:`pimm_core.checkpoint.memory`).

What a snapshot holds is what the disk ``last`` holds, built by the same code
(:meth:`~.checkpointer.Checkpointer.meta`, ``manifest``, the RNG and loader cursor of
:meth:`~.checkpointer.Checkpointer.save`): the unwrapped model's ``state_dict``, the optimizer's,
the EMA weights, and ``meta``/``rank_state``/``manifest`` packed as a disk checkpoint packs them, so
one ``torch.load(weights_only=True)`` reads it back. A sharded model's (FSDP2, tensor parallel) ``DTensor``
entries are this rank's local shards with what rebuilds them (:func:`~..checkpoint.tensors.local_shards.to_local`):
a rank's copy is its shard of the state, not the whole model's. Taken after a step inside an epoch or at an
epoch's end (after its evaluation, as the epoch-end save is), never at the run's last step (the final
disk save follows).

The training stall of a snapshot is the staging (a copy of every tensor to CPU, into the buffers the
previous snapshot used: :class:`~pimm_core.checkpoint.tensors.staging.StagingBuffers`) plus any wait for the
previous snapshot: one snapshot is in flight at a time, and a snapshot due while the previous one is
still being copied *waits* for it (skipping would need every rank to agree to skip; waiting keeps the
rounds of the buddy exchange aligned on every rank and the steps lost per failure at most N).

A round: serialize (``torch.save``), write the own copy, swap with the buddy (send to
:func:`~pimm_core.checkpoint.memory.exchange.buddy_of`, receive from the rank whose copy this one
holds), write the buddy copy, then an all-reduce on the side group says every rank completed the
round: only then are the older steps dropped. A rank killed during a round leaves the previous round
complete everywhere.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import statistics
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

import torch

from ..checkpoint.memory import exchange
from ..checkpoint.memory.store import RankStore, remove_stale
from ..checkpoint.tensors.local_shards import to_local
from ..checkpoint.tensors.staging import StagingBuffers
from ..checkpoint.tensors.state import pack, rng_state, unwrap
from ..errors import ConfigError
from ..faults import point, register
from ..process import dist
from ..process.lock import launcher_pid
from ..run.memory_index import RankMemory, remove_rank_index, write_rank_index

if TYPE_CHECKING:
    from .host import TrainerHost

log = logging.getLogger("pimm")
register("memory.step", "memory.round")


def local_world_size(world_size: int) -> int:
    """Ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``; the world size when unknown)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)


def restart_count() -> int:
    """How often torchrun's agent restarted the ranks (``TORCHELASTIC_RESTART_COUNT``; 0 outside torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    except ValueError:
        return 0


class MemorySnapshots:
    """The memory tier of one rank; every rank builds one (:meth:`open` is a collective).

    Args:
        tr: the trainer (its checkpointer builds the state; its recorder shows ``memory_step``).
        every: ``checkpoint.memory_every_steps``.
    """

    def __init__(self, tr: TrainerHost, every: int):
        self.tr, self.every = tr, every
        info = tr.info
        self.rank, self.world = info.rank, info.world_size
        self.local = local_world_size(self.world)
        self.buddy = exchange.buddy_of(self.rank, self.world, self.local)
        self.holds = exchange.held_by_me(self.rank, self.world, self.local)
        self.store = RankStore(tr.run_dir, self.rank)
        self.group: Any = None
        self.staging = StagingBuffers()  # CPU copies, kept from one snapshot to the next
        self._thread: threading.Thread | None = None
        self._failure: str | None = None
        self.stalls: list[float] = []  # seconds training waited per snapshot (staging + wait for the previous)
        self.rounds: list[float] = []  # seconds per background round (serialize, write, swap, agree)
        self.complete_step: int | None = None  # newest step whose round completed on every rank
        self.own: Any = None
        self.held: Any = None
        self.status: dict[str, Any] = {}  # status.json's memory_step (and recovery), written by rank 0's recorder

    def open(self) -> None:
        """Create the side group, remove the memory tiers of dead runs on this node (local rank 0, before
        the others open theirs) and take this rank's directory (back, after a restart)."""
        if self.world > 1:
            self.group = exchange.side_group()
        if self.tr.info.local_rank == 0:
            # (a restart keeps this run's tier: it recovers from it; a new launch of the run never uses an
            # earlier launch's copies, left by a launcher that was killed)
            for path in remove_stale(keep=self.store.root if restart_count() else None):
                log.info("removed %s, the memory tier of a run that is gone", path)
        dist.barrier()
        agent = (launcher_pid() or os.getppid()) if restart_count() or "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
        try:
            self.store.open(agent_pid=agent)
        except OSError as e:
            raise ConfigError(f"checkpoint.memory_every_steps: cannot write the memory tier in {self.store.root} "
                              f"({e.strerror or e}); set $PIMM_SHM_ROOT to a writable node-local directory, or "
                              "checkpoint.memory_every_steps = 0") from None
        if self.tr.info.is_main:
            if self.buddy is None:
                log.info("memory tier: every %d steps in %s; no buddy copy: one rank", self.every, self.store.root)
            else:
                where = ("another node" if self.world > self.local else
                         "another local rank on this node: a node's loss loses both copies")
                log.info("memory tier: every %d steps in %s; rank r's copy is held by rank %s (%s)", self.every,
                         self.store.root, "(r+%d) %% %d" % (self.local if self.world > self.local else 1, self.world),
                         where)

    # ------------------------------------------------------------ snapshots
    def on_step(self, *, run_ends: bool) -> None:
        """After an optimizer step inside an epoch: a snapshot at every N-th step (not the last)."""
        s = self.tr.state
        point("memory.step")  # (tests: a rank killed at the k-th optimizer step)
        mid = s.iter < len(self.tr.loader)
        if mid and not run_ends and s.global_step % self.every == 0:
            self._snapshot(mid_epoch=True)

    def on_epoch_end(self, *, run_ends: bool) -> None:
        """After an epoch's end and its evaluation: the snapshot of an N-th step that ended the epoch."""
        if not run_ends and self.tr.state.global_step % self.every == 0:
            self._snapshot(mid_epoch=False)

    def _snapshot(self, *, mid_epoch: bool) -> None:
        started = time.perf_counter()
        self.wait()
        staged = self._stage(mid_epoch)
        self.stalls.append(time.perf_counter() - started)
        s = self.tr.state
        if self.tr.info.is_main and len(self.stalls) == 1:
            log.info("memory snapshot at step %d: %.1f MB staged to CPU, training stalled %.1f ms", s.global_step,
                     sum(t.numel() * t.element_size() for t in _tensors(staged)) / 1e6, self.stalls[0] * 1e3)
        self._thread = threading.Thread(target=self._round, args=(s.global_step, s.epoch, staged),
                                        name="pimm-memory", daemon=True)
        self._thread.start()

    def _stage(self, mid_epoch: bool) -> dict[str, Any]:
        ck = self.tr.checkpointer
        loader = ck._loader_state() if mid_epoch and ck.loader_state else None  # (a gather at 2+ ranks)
        manifest = json.loads(json.dumps(ck.manifest("memory", loader is not None), default=str))  # (plain values)
        # Copied into the buffers of the previous snapshot (whose round is over: _snapshot waited for it).
        cpu = self.staging.copy_tree
        # Sharded (FSDP2, tensor parallel): this rank's own shards, each with what rebuilds its DTensor.
        return {"model": cpu("model", to_local(unwrap(self.tr.model).state_dict())),
                "optimizer": cpu("optimizer", to_local(self.tr.optimizer.state_dict())),
                "ema": cpu("ema", to_local(ck.ema_weights())), "meta": pack(ck.meta()),
                "rank_state": pack({"rng": rng_state(), "loader": cpu("loader", loader)}), "manifest": pack(manifest)}

    def _round(self, step: int, epoch: int, staged: dict[str, Any]) -> None:
        """The background part of a snapshot (see the module docstring); every rank runs the same collectives."""
        started = time.perf_counter()
        ok = True
        buf = io.BytesIO()
        torch.save(staged, buf)
        del staged
        data = buf.getbuffer()
        try:
            self.own = self.store.write(self.rank, step, data, epoch=epoch, world=self.world)
        except OSError as e:
            ok = self._failed(f"writing the memory copy of step {step} failed: {e}")
        self._publish()
        try:
            if self.buddy is not None:
                received = exchange.swap(self.group, data, self.buddy, self.holds)
                try:
                    self.held = self.store.write(self.holds, step, received, world=self.world)
                except OSError as e:
                    ok = self._failed(f"writing rank {self.holds}'s memory copy of step {step} failed: {e}")
                self._publish()
            point("memory.round")
            if self.group is not None:
                ok = exchange.all_complete(self.group, ok)
        except RuntimeError as e:  # a peer died: this process is about to be restarted too
            self._failed(f"the memory copy of step {step} did not reach every rank: {e}")
            return
        finally:
            del data
            buf.close()
        if ok:
            self.store.keep_only(step, world=self.world)  # (and a larger world's, once replaced)
            self.complete_step = step
            self.status["memory_step"] = step
        self.rounds.append(time.perf_counter() - started)

    def _failed(self, why: str) -> bool:
        if self._failure is None:
            log.warning("warning: %s; the memory tier keeps its previous complete step", why)
        self._failure = why
        return False

    def _publish(self) -> None:
        try:
            write_rank_index(self.tr.run_dir, RankMemory(self.rank, _host(), os.getpid(), str(self.store.dir),
                                                          self.own, self.held))
        except OSError:
            pass  # (a reader's index; the copies themselves are what a recovery uses)

    def wait(self) -> None:
        """Until the snapshot in flight is done (its round complete or failed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------- the end
    def close(self, *, remove: bool) -> None:
        """The session ended: wait for the round in flight; with ``remove`` (the run ended or stopped, its
        disk ``last`` written) remove this rank's shared memory and index file; say the figures."""
        if remove:
            self.wait()
        if self.tr.info.is_main and self.stalls:
            rounds = f"; background round median {statistics.median(self.rounds) * 1e3:.0f} ms" if self.rounds else ""
            log.info("memory tier: %d snapshots, training stall median %.1f ms, max %.1f ms%s", len(self.stalls),
                     statistics.median(self.stalls) * 1e3, max(self.stalls) * 1e3, rounds)
        self.store.close(remove=remove)
        if remove:
            remove_rank_index(self.tr.run_dir, self.rank)


@contextlib.contextmanager
def memory_tier(ck: Any) -> Iterator[None]:
    """A ``train()`` session of the checkpointer ``ck``: its memory tier (``ck.memory``, opened at the
    start) is removed when the session ends or stops (the disk ``last`` holds the newest state), and
    kept when it fails (for torchrun's restart; the launcher removes it when its ranks are gone)."""
    try:
        yield
    except BaseException:
        mem, ck.memory = ck.memory, None
        if mem is not None:
            mem.close(remove=False)
        raise
    mem, ck.memory = ck.memory, None
    if mem is not None:
        mem.close(remove=True)


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _host() -> str:
    import socket

    return socket.gethostname()
