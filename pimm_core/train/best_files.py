"""The Checkpointer's files of the best evaluations: ``model_best.pth`` (or the single format's
``best`` pointer) when the selection metric improves, and the ``best_<step>.pth`` files of
``checkpoint.keep_best`` (:class:`~.best_k.BestKeeper` decides which are kept).

Every rank calls these (a sharded model's weights are gathered by every rank); rank 0 writes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..checkpoint.select.selection import BEST
from ..checkpoint.tensors.state import is_sharded
from ..process import dist
from .best_k import best_name

if TYPE_CHECKING:
    from torch import nn

    from ..checkpoint.formats.protocol import CheckpointFormat
    from ..process.dist import DistInfo
    from .best_k import BestKeeper
    from .state import TrainState

log = logging.getLogger("pimm")


class BestFilesOwner(Protocol):
    """What these functions use of the :class:`~pimm_core.train.checkpointer.Checkpointer` that calls
    them (declared here, so this module does not import the checkpointer back)."""

    dir: Path | None
    info: DistInfo
    state: TrainState
    format: CheckpointFormat
    keeper: BestKeeper
    model: nn.Module

    def manifest(self, kind: str, has_loader_state: bool = False) -> dict[str, Any]: ...
    @property
    def micro_batches(self) -> int: ...
    def save(self, checkpoint_dir: Path, *, mid_epoch: bool, pointers: tuple[str, ...] = ("last",),
             selection_metric: dict[str, Any] | None = None, background: bool = False) -> Path: ...
    def _payload(self) -> dict[str, Any] | None: ...
    def _write_weights(self, path: Path, manifest: dict[str, Any], payload: dict[str, Any]) -> bool: ...
    def _upload(self) -> None: ...


def best_manifest(ck: BestFilesOwner, epoch: int, selection: dict[str, Any]) -> dict[str, Any]:
    """The sidecar fields of a best file of the evaluation of ``epoch``."""
    # a weights-only file says which epoch produced it (the one just evaluated), not where a
    # resume would continue: epoch 24 with its 45 micro-batches, as its metrics.jsonl records say
    s = ck.state
    trained = s.iter if s.epoch == epoch else ck.micro_batches
    return {**ck.manifest("best"), "epoch": epoch, "iter": trained, "selection_metric": selection}


def on_best(ck: BestFilesOwner, epoch: int, selection: dict[str, Any]) -> dict[str, Any] | None:
    """The evaluation of ``epoch`` improved the selection metric (``selection``: its name, value,
    mode, split, epoch, weights). Standard and legacy: rank 0 writes ``model_best.pth``; single:
    ``best`` must name a complete checkpoint at this position (a save every rank takes part in).

    Returns:
        The weights payload written (standard, legacy), for a ``best_<step>.pth`` of the same weights.
    """
    if ck.dir is None:
        return None
    s, n_micro = ck.state, ck.micro_batches
    if ck.format.name == "single":
        ck.save(ck.dir, mid_epoch=0 < s.iter < n_micro, pointers=("best",), selection_metric=selection)
        return None
    payload = ck._payload()
    if ck.info.is_main:
        ck._write_weights(ck.dir / BEST, best_manifest(ck, epoch, selection), payload)
        ck._upload()
    return payload


def on_evaluated(ck: BestFilesOwner, epoch: int, selection: dict[str, Any], *, improved: bool) -> None:
    """After every evaluation: :func:`on_best` when ``improved``, then with ``checkpoint.keep_best >= 2``
    ``best_<step>.pth`` when the evaluation ranks among the k best on disk, and the kept files
    ranked below the k-th removed."""
    payload = on_best(ck, epoch, selection) if improved else None
    keeper = ck.keeper
    if ck.dir is None or not keeper.enabled:
        return
    admitted = ck.info.is_main and keeper.admits(ck.dir, ck.state.global_step, selection["value"])
    if is_sharded(ck.model) and ck.info.distributed:
        admitted = dist.broadcast_object(admitted)  # rank 0 decides; the gather needs every rank
    if admitted:
        payload = payload or ck._payload()
    if not ck.info.is_main:
        return
    if admitted and not ck._write_weights(ck.dir / best_name(ck.state.global_step),
                                          best_manifest(ck, epoch, selection), payload):
        return  # nothing new: nothing is removed for it
    # (also without a new file: a resume with a smaller keep_best removes the surplus now)
    removed = keeper.rotate(ck.dir)
    for name in removed:
        log.info("removed %s (no longer among the %d best by %s)", ck.dir / name, keeper.keep, keeper.metric)
    if admitted or removed:
        ck._upload()
