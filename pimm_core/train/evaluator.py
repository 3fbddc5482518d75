"""Evaluation on the validation split: metrics summed exactly over ranks.

Each rank evaluates its shard of the split; the sums (loss, correct predictions,
samples) are all-reduced, so the metrics are those of the whole split, never an
average of per-rank averages.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .. import dist
from ..checkpoint.state import unwrap
from ..ema import EMA


class Evaluator:
    """Classification metrics of the raw or the EMA weights.

    Args:
        val_loader: yields ``(inputs, targets, indices)`` of this rank's shard.
        device: where the batches go.
        autocast: a context-manager factory for the forward pass (mixed precision).
        weights: ``"raw"`` or ``"ema"`` (``eval.weights``); EMA needs ``ema``.
    """

    def __init__(self, val_loader: Iterable, device: torch.device,
                 autocast: Callable[[], contextlib.AbstractContextManager], weights: str = "raw"):
        self.val_loader, self.device, self.autocast, self.weights = val_loader, device, autocast, weights

    @torch.no_grad()
    def evaluate(self, model: nn.Module, ema: EMA | None = None) -> dict[str, float]:
        """Accuracy and mean cross-entropy on the validation split, summed exactly over ranks.

        Returns:
            ``{"val/acc": fraction in [0, 1], "val/loss": nats per sample}``.
        """
        model = unwrap(model)
        was_training = model.training
        model.eval()
        use_ema = self.weights == "ema" and ema is not None
        ema_sd = ema.parameters_for(model) if use_ema else None  # one name per tensor: tied ones follow
        totals = torch.zeros(3, dtype=torch.float64)
        for x, y, _ in self.val_loader:
            x, y = x.to(self.device), y.to(self.device)
            with self.autocast():
                logits = torch.func.functional_call(model, ema_sd, (x,)) if use_ema else model(x)
            totals[0] += F.cross_entropy(logits.float(), y, reduction="sum").item()
            totals[1] += (logits.argmax(1) == y).sum().item()
            totals[2] += len(y)
        dist.all_reduce_sum(totals)
        model.train(was_training)
        return {"val/acc": float(totals[1] / totals[2]), "val/loss": float(totals[0] / totals[2])}
