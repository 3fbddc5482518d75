"""Best-checkpoint tracking: is this evaluation an improvement of the selection metric?

As timm's ``CheckpointSaver`` decides ``model_best``: a strict improvement in the
configured direction (``max`` or ``min``); the first finite evaluation is the first best;
NaN or ±Inf is never best (it would also block every later comparison).
"""

from __future__ import annotations

import math
from typing import Any


class BestTracker:
    """The best value of one metric so far and the epoch that produced it.

    Args:
        metric: the metric's name (e.g. ``"val/acc"``), for messages.
        mode: ``"max"`` or ``"min"``.
    """

    def __init__(self, metric: str, mode: str, *, best: float | None = None, epoch: int | None = None):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', not {mode!r}")
        self.metric, self.mode = metric, mode
        self.best, self.epoch = best, epoch

    def is_improvement(self, value: float) -> bool:
        """``value`` beats the best so far (strictly), and is finite."""
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        return value > self.best if self.mode == "max" else value < self.best

    def update(self, value: float, epoch: int) -> bool:
        """Record ``value`` of evaluation ``epoch``; returns True when it is the new best."""
        if not self.is_improvement(value):
            return False
        self.best, self.epoch = value, epoch
        return True

    def rebase(self, of: dict[str, Any] | None) -> str | None:
        """Forget the best so far when it is a value of another selection metric or direction
        (``of``: ``{"name", "mode"}`` the value was ranked by; None: unknown, kept). Returns the
        warning to give, or None when nothing changed."""
        if self.best is None or not isinstance(of, dict) or (of.get("name"), of.get("mode")) == (self.metric, self.mode):
            return None
        old = f"{of.get('name')} {self.best:.4g} at epoch {self.epoch}"
        self.best = self.epoch = None
        return (f"the selection metric changed from {of.get('name')} ({of.get('mode')}) to {self.metric} ({self.mode}): "
                f"the best so far ({old}) is not a value of it, so the best starts over and the next evaluation "
                "replaces model_best.pth")

    def state_dict(self) -> dict[str, Any]:
        return {"best_metric": self.best, "best_epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.epoch = state.get("best_metric"), state.get("best_epoch")
