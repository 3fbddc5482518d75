"""The run's progress record (:class:`TrainState`), saved in every checkpoint's trainer state."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..config import TrainConfig
from ..errors import CheckpointSaveError


@dataclass
class TrainState:
    """Progress of a run; :meth:`Trainer.train` returns it.

    Attributes:
        global_step: optimizer steps taken over the whole run.
        epoch: epoch of the next batch to train (0-based).
        iter: micro-batch index of the next batch within ``epoch``.
        best_metric: best value of ``eval.metric`` so far (None before any evaluation).
        best_epoch: epoch (0-based) that produced ``best_metric``.
        best_of: ``{"name", "mode"}`` of the selection metric ``best_metric`` is a value of (None:
            before any evaluation, or a checkpoint from before it was recorded).
        epoch_start_step: ``global_step`` when ``epoch`` began (a resume that must replay
            the epoch restarts here, whatever the new batching).
        last_eval: metrics of the latest evaluation, e.g. ``{"val/acc": 0.97, "val/loss": 0.1}``.
        eval_step: ``global_step`` of that evaluation (a resumed run does not evaluate the same step twice).
        stop_reason: None when the run reached its end; otherwise why it stopped early.
        error: set when the stop is a failure (non-finite values with ``train.on_nonfinite
            = "stop"``): the CLI then exits 1.
        finished: the run reached its configured end (epochs or ``train.max_steps``).
        save_error: set when the run stopped because a checkpoint save failed
            (``stop_reason`` is its message): the CLI then exits 1.
    """

    global_step: int = 0
    epoch: int = 0
    iter: int = 0
    best_metric: float | None = None
    best_epoch: int | None = None
    best_of: dict[str, str] | None = None
    epoch_start_step: int = 0
    last_eval: dict[str, float] = field(default_factory=dict)
    eval_step: int | None = None
    stop_reason: str | None = None
    error: str | None = None
    finished: bool = False
    save_error: CheckpointSaveError | None = None

    def state_dict(self) -> dict[str, Any]:
        """The checkpointed progress: every field but ``save_error``, with ``stop_reason`` and
        ``error`` None (they describe this session's end, not the position)."""
        out = asdict(replace(self, stop_reason=None, error=None, save_error=None))
        del out["save_error"]
        return out

    def load_state_dict(self, saved: dict[str, Any], *, epoch_start_step: int = 0) -> None:
        """Continue from ``saved`` (a :meth:`state_dict`); this session's outcome is reset.

        Args:
            epoch_start_step: for a state saved before ``epoch_start_step`` was recorded.

        Raises:
            KeyError: ``saved`` lacks a counter or the best-metric fields.
        """
        loaded = TrainState(global_step=saved["global_step"], epoch=saved["epoch"], iter=saved["iter"],
                            best_metric=saved["best_metric"], best_epoch=saved["best_epoch"],
                            best_of=saved.get("best_of"), last_eval=saved["last_eval"], eval_step=saved.get("eval_step"),
                            epoch_start_step=saved.get("epoch_start_step", epoch_start_step))
        for f in fields(self):
            setattr(self, f.name, getattr(loaded, f.name))


def end_step(s: TrainState, t: TrainConfig, *, micro_batches: int, steps_per_epoch: int) -> int:
    """The global step at which training will end from position ``s``.

    The optimizer steps left in the current epoch (windows of ``t.grad_accum`` from
    ``s.iter`` over the epoch's ``micro_batches``) plus ``steps_per_epoch`` for each
    whole epoch up to ``t.epochs``, capped by ``t.max_steps``: the horizon of the LR
    schedule and ``total_steps`` in ``status.json``.
    """
    left = 0
    if s.epoch < t.epochs:
        left = math.ceil(max(0, micro_batches - s.iter) / t.grad_accum)
        left += (t.epochs - s.epoch - 1) * steps_per_epoch
    end = s.global_step + left
    return min(end, t.max_steps) if t.max_steps else end
