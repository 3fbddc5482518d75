"""The learning-rate schedule: linear warmup, then cosine decay (or constant), with a
horizon that follows the run.

For optimizer step ``s`` (the number of steps already taken), base LR ``lr``, floor
``min_lr`` (ratio ``m = min_lr / lr``), ``W`` warmup steps and last step ``T``::

    s < W:         lr * (s + 1) / W
    constant:      lr
    cosine:        lr * (m + (1 - m) * (1 + cos(pi * p(s))) / 2)
                   p(s) = clamp(p_a + (1 - p_a) * (s - s_a) / (T - s_a), 0, 1)

(SGDR, Loshchilov & Hutter 2017, without restarts.) A fresh run has the anchor
``(s_a, p_a) = (W, 0)``, the usual cosine from the end of warmup to ``T``. When a
resume changes the horizon ``T`` (another world size, micro-batch size or accumulation
window, more epochs or a new ``train.max_steps``), :meth:`WarmupCosine.retarget`
moves the anchor to the resume step with the progress the saved schedule had reached
there: the LR is continuous at the resume and still reaches ``min_lr`` at the new
last step.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class WarmupCosine(torch.optim.lr_scheduler.LRScheduler):
    """Warmup + cosine (or constant) LR schedule with a movable horizon.

    Args:
        optimizer: every param group gets ``base_lr * factor(step)``.
        warmup: linear warmup steps ``W``.
        total: the optimizer step at which the run ends (``T``).
        min_ratio: ``min_lr / lr`` (the cosine's floor as a fraction of the base LR).
        kind: ``"cosine"`` or ``"constant"``.

    ``state_dict()`` holds the horizon and anchor next to ``LRScheduler``'s own fields,
    so a resumed schedule continues where the saved one was.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup: int, total: int, min_ratio: float, kind: str):
        self.warmup, self.total, self.min_ratio, self.kind = warmup, total, min_ratio, kind
        self.anchor_step, self.anchor_progress = warmup, 0.0
        super().__init__(optimizer)

    def progress(self, step: int) -> float:
        """Fraction of the decay done after ``step`` optimizer steps, in [0, 1]."""
        span = max(1, self.total - self.anchor_step)
        p = self.anchor_progress + (1 - self.anchor_progress) * (step - self.anchor_step) / span
        return min(1.0, max(0.0, p))

    def factor(self, step: int) -> float:
        """Multiplier of the base LR after ``step`` optimizer steps (the formula above)."""
        if self.warmup and step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        m = self.min_ratio
        return m + (1 - m) * 0.5 * (1 + math.cos(math.pi * self.progress(step)))

    def get_lr(self) -> list[float]:
        return [base * self.factor(self.last_epoch) for base in self.base_lrs]

    def set_step(self, step: int) -> None:
        """Point the schedule (and the optimizer's LR) at ``step`` optimizer steps taken."""
        self.last_epoch = step
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs

    def retarget(self, step: int, total: int) -> None:
        """Make ``total`` the last step while keeping the LR at ``step`` unchanged.

        Anchors the decay at ``(step, progress(step))``; before the end of warmup the
        decay has not started, so only the horizon moves.
        """
        if total == self.total:
            return
        if step > self.warmup:
            self.anchor_step, self.anchor_progress = step, self.progress(step)
        self.total = total

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a saved schedule; a ``LambdaLR`` state (pimm before 0.2) restores the
        step and base LRs only, keeping this schedule's horizon and anchor."""
        keep = ("warmup", "total", "min_ratio", "kind", "anchor_step", "anchor_progress")
        for k, v in state_dict.items():
            if k in keep or k in ("base_lrs", "last_epoch", "_last_lr", "_step_count"):
                setattr(self, k, v)
