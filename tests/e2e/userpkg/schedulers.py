"""LR schedules a user names as ``[scheduler] target``: torch's own lr_scheduler objects."""

from __future__ import annotations

import torch
from torch.optim import lr_scheduler


def exponential(optimizer: torch.optim.Optimizer, gamma: float = 0.9) -> lr_scheduler.ExponentialLR:
    return lr_scheduler.ExponentialLR(optimizer, gamma=gamma)


def warmup_then_exponential(optimizer: torch.optim.Optimizer, warmup: int = 3,
                            gamma: float = 0.8) -> lr_scheduler.SequentialLR:
    return lr_scheduler.SequentialLR(optimizer, [lr_scheduler.LinearLR(optimizer, 0.1, 1.0, total_iters=warmup),
                                                 lr_scheduler.ExponentialLR(optimizer, gamma=gamma)],
                                     milestones=[warmup])
