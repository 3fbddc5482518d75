"""Evaluation on the validation split: the objective's metrics, summed exactly over ranks.

Each rank evaluates its shard of the split (:class:`~pimm_core.data.ShardSampler`: every
sample on exactly one rank, no padding); the objective's ``(sum, count)`` pairs are added
per batch (:class:`~pimm_core.objectives.MetricTotals`) and all-reduced once, so the
metrics are those of the whole split at any world size, never an average of per-rank
averages.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..checkpoint.tensors.state import unwrap
from ..objectives import BUILTIN, MetricTotals, Objective
from ..process import dist
from ..run.heartbeat import beat
from .ema import EMA
from .parallel import is_fsdp, reshard


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (through tuples, lists and dicts) moved to ``device``."""
    if isinstance(batch, torch.Tensor):  # (already there: no dispatch, a CPU run's every batch)
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class _Step(nn.Module):
    """The objective as a module whose only child is the model, so ``functional_call`` can run it
    with other weights (the EMA ones) however the objective calls the model."""

    def __init__(self, model: nn.Module, objective: Objective):
        super().__init__()
        self.model, self.objective = model, objective

    def forward(self, batch: Any):
        return self.objective(self.model, batch)


class Evaluator:
    """The objective's metrics of the raw or the EMA weights.

    Args:
        val_loader: yields this rank's shard of the validation split.
        device: where the batches go.
        autocast: a context-manager factory for the forward pass (mixed precision).
        weights: ``"raw"`` or ``"ema"`` (``eval.weights``); EMA needs ``ema``.
        objective: computes the loss and metrics of a batch (classification by default).
    """

    def __init__(self, val_loader: Iterable, device: torch.device,
                 autocast: Callable[[], contextlib.AbstractContextManager], weights: str = "raw",
                 objective: Objective = BUILTIN["classification"]):
        self.val_loader, self.device, self.autocast, self.weights = val_loader, device, autocast, weights
        self.objective = objective

    @torch.no_grad()
    def evaluate(self, model: nn.Module, ema: EMA | None = None) -> dict[str, float]:
        """The objective's metrics over the whole validation split, reduced as sums and counts.

        Returns:
            ``{"val/<name>": mean}``, e.g. classification's ``{"val/acc": fraction in [0, 1],
            "val/loss": nats per sample}``.
        """
        beat("evaluation")
        model = unwrap(model)
        was_training = model.training
        model.eval()
        step = _Step(model, self.objective)
        # one name per tensor (tied ones follow), prefixed with the wrapper's child name
        use_ema = self.weights == "ema" and ema is not None
        sharded = is_fsdp(model)  # FSDP2 all-gathers its own shards: swap the values in place
        ema_sd = {f"model.{k}": v for k, v in ema.parameters_for(model).items()} \
            if use_ema and not sharded else None
        totals = MetricTotals()
        with ema.swapped_into(model) if use_ema and sharded else contextlib.nullcontext():
            for batch in self.val_loader:
                batch = to_device(batch, self.device)
                with self.autocast():
                    _, pairs = torch.func.functional_call(step, ema_sd, (batch,)) if ema_sd is not None \
                        else step(batch)
                totals.add(pairs)
            if sharded:  # drop the gathered (possibly EMA) values before the raw ones are restored
                reshard(model)
        means = totals.reduce(dist.all_reduce_sum, dist.all_gather_object, device=self.device)
        model.train(was_training)
        return {f"val/{k}": v for k, v in self.objective.finalize(means).items()}
