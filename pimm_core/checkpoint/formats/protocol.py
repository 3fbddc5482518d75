"""The checkpoint format protocol: what a format saves and what a load gives back.

A format (:class:`CheckpointFormat`) is the on-disk layout of one checkpoint, in the manner
of Lightning's ``CheckpointIO``: ``save`` publishes a :class:`SaveItem`, ``load`` restores
one into a model and optimizer and returns the rest as a :class:`LoadedState`, ``wait``
returns once nothing is in flight. Implementations: ``standard``
(:class:`~pimm_core.checkpoint.formats.standard.StandardFormat`), its background-writing wrapper
(:class:`~pimm_core.checkpoint.formats.async_save.AsyncStandardFormat`), ``legacy`` and ``single``
(:mod:`pimm_core.checkpoint.formats.files`); :func:`pimm_core.checkpoint.formats.choose.make_format` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch import nn


@dataclass
class SaveItem:
    """What one checkpoint holds; every rank builds its own.

    Attributes:
        model: the trained module (wrappers allowed; weights are saved unwrapped).
        optimizer: its optimizer (state saved FQN-keyed).
        meta: replicated, non-tensor trainer state: ``trainer`` counters, ``scheduler``,
            ``scaler``, ``ema`` and the topology (``world_size``, ``workers_per_rank``,
            ``batch_size``, ``grad_accum``).
        rank_state: this rank's state: ``{"rng": ..., "loader": cursor or None}``.
        manifest: fields for the manifest (step, epoch, iter, world size, metrics...).
        step: the global step (names a ``single`` file).
        ema_weights: returns the EMA weight set, or None without EMA; called at save time
            on the ranks that write it (the weights change after the save returns).
        pointers: ``single`` only: the pointers (``last``, ``best``, ``final``) to move to it.
        gather_weights: ``standard`` with a sharded (FSDP2) model only
            (``checkpoint.gather_weights``): also gather the full weights into
            ``weights.pth``; False writes none, the weights stay sharded in ``trainer.dcp/``
            and the manifest says ``"weights": "trainer.dcp"``.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    meta: dict[str, Any]
    rank_state: dict[str, Any]
    manifest: dict[str, Any]
    step: int
    ema_weights: Callable[[], dict[str, torch.Tensor] | None] = lambda: None
    pointers: tuple[str, ...] = ("last",)
    gather_weights: bool = True


@dataclass
class LoadedState:
    """What a load restored (:meth:`CheckpointFormat.load`).

    Attributes:
        meta: the replicated trainer state saved as ``meta`` (optimizer structure removed).
        rank_state: this rank's saved RNG/loader state, or None when the checkpoint has
            no entry for this rank (world size grew).
        ema_state_dict: the EMA weights: the ``ema_target`` passed to the load, filled in
            place (a standard checkpoint of a sharded run: ``trainer.dcp/ema/*``); else the
            saved full weight set (CPU tensors); None when the checkpoint has none.
        saved_ranks: ranks that have a ``rank_state`` entry.
        skipped: warnings of a non-strict load (state skipped or cast).
    """

    meta: dict[str, Any]
    rank_state: dict[str, Any] | None
    ema_state_dict: dict[str, torch.Tensor] | None = None
    saved_ranks: list[int] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


class CheckpointFormat(Protocol):
    """One checkpoint layout. Every rank calls every method at the same point (they may be collective).

    Attributes:
        name: ``"standard"``, ``"legacy"`` or ``"single"`` (``checkpoint_format``).
        asynchronous: ``save(..., background=True)`` returns before the files are written:
            the format then logs ``saved ...`` itself once they are published, and the
            trainer calls :meth:`wait_staged` before changing the weights.
    """

    name: str
    asynchronous: bool

    def save(self, model_dir: Path, item: SaveItem, *, background: bool = False) -> Path:
        """Publish ``item`` under ``model_dir``; returns the path it is (or will be) published as.

        Raises:
            CheckpointSaveError: on every rank, when the write failed on any (names the path
                and what a resume would now select); an earlier background save's failure
                is raised here too.
        """
        ...

    def load(self, path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             strict: bool = True, ema_target: dict[str, torch.Tensor] | None = None) -> LoadedState:
        """Restore weights and optimizer state from ``path``; the caller applies the rest.

        ``ema_target`` (name -> tensor: the EMA's own tensors, ``DTensor`` shards under FSDP)
        is filled in place when the checkpoint stores its EMA weights sharded (the standard
        format's ``trainer.dcp/ema/*``) and returned as ``LoadedState.ema_state_dict``;
        otherwise it is ignored and the saved full EMA weight set is returned.

        Raises:
            CheckpointError: the state does not fit (names the tensors), or a file cannot be read.
            CheckpointParseError: a file is hostile or malformed (nothing in it ran).
        """
        ...

    def wait_staged(self) -> None:
        """Return once a background save has copied what it saves (the weights may change after)."""
        ...

    def wait(self) -> None:
        """Return once nothing is in flight.

        Raises:
            CheckpointSaveError: on every rank, when a background save failed.
        """
        ...


META_KEYS = ("trainer", "scheduler", "scaler", "world_size", "workers_per_rank")
COUNTERS = ("global_step", "epoch", "iter")


def meta_problem(meta: Any, *extra: str) -> str | None:
    """What makes ``meta`` (the trainer state a loader returns) unusable by a resume, or None."""
    if not isinstance(meta, dict):
        return f"is a {type(meta).__name__}, not a dict"
    missing = [k for k in (*META_KEYS, *extra) if k not in meta]
    if missing:
        return f"has no {', '.join(missing)}"
    trainer = meta["trainer"]
    if not isinstance(trainer, dict) or not all(isinstance(trainer.get(k), int) for k in COUNTERS):
        return "has no integer trainer counters (global_step, epoch, iter)"
    if not isinstance(meta["world_size"], int) or not isinstance(meta["workers_per_rank"], int):
        return "has a world_size or workers_per_rank that is not an integer"
    return None
