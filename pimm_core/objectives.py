"""What a step computes: the loss to minimize and the metrics to report (``objective``).

An objective is called as ``objective(model, batch) -> (loss, metrics)``:

- ``loss``: a scalar tensor, the mean over the batch; the trainer backpropagates it.
- ``metrics``: ``{name: value}``. A value is either a pair ``(sum, count)`` (e.g. the
  summed loss and the number of tokens), which reduces exactly, or a plain number / 0-d
  tensor taken as the batch's mean and weighted by the batch size (the first dimension of
  the first tensor in the batch). Return pairs when your batches' sizes vary in a way
  that guess cannot see (padding, masks).

Evaluation adds every batch's sums and counts (:class:`MetricTotals`), sums them over
the ranks in one all-reduce and only then divides, so a metric is that of the whole
validation split at any world size, never an average of per-rank averages. The
objective's :meth:`Objective.finalize` then adds metrics derived from the means
(perplexity = exp(mean loss)). The trainer reports them as ``val/<name>``.

Built-ins (the names of :data:`pimm_core.config.OBJECTIVES`):

- ``classification``: batches ``(inputs, targets, ...)``, logits ``(B, C)`` (or
  ``(B, C, d1, ...)`` with targets ``(B, d1, ...)``), int64 class targets; cross-entropy;
  metrics ``loss`` (nats per target) and ``acc`` (fraction).
- ``regression``: batches ``(inputs, targets, ...)``; outputs of the targets' shape (or
  the same number of elements, e.g. ``(B, 1)`` for ``(B,)``); mean squared error;
  metrics ``loss`` (MSE per element) and ``mae``.
- ``language_modeling``: batches of int64 tokens ``(B, T)`` (or a tuple whose first item
  is), the model mapping ``(B, T-1)`` tokens to logits ``(B, T-1, V)``; next-token
  cross-entropy over all ``B * (T-1)`` positions; metrics ``loss`` (nats per token) and
  ``perplexity`` (``exp(loss)``).

The built-ins read the model's output as a tensor, or take its logits from a
``ModelOutput``/object with a ``logits`` attribute (Hugging Face ``transformers``) or a
mapping with a ``"logits"`` key (:func:`logits_of`); any other output is a
:class:`ObjectiveOutputError` naming what the model returned.

A user objective is a target ``"package.module:function"`` with that signature; it may
also name an :class:`Objective` instance to add derived metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .config import OBJECTIVES as OBJECTIVE_METRICS
from .errors import ConfigError
from .targets import TargetSpec, check_args, resolve

#: A metric as the trainer accumulates it: ``(sum, count)``.
Pair = tuple[torch.Tensor, torch.Tensor | float]


def batch_size(batch: Any) -> int:
    """The first dimension of the first tensor in ``batch`` (depth-first through tuples,
    lists and mappings); 1 when there is none (or it is 0-d)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        if isinstance(item, (torch.Tensor, tuple, list, Mapping)):
            return batch_size(item)
    return 1


@dataclass(frozen=True)
class Objective:
    """A step function with a name and the metrics it derives at the end of an evaluation.

    Attributes:
        name: the ``objective`` config value (a built-in name or the target).
        step: ``(model, batch) -> (loss, {metric: value})`` (see the module docstring).
        derived: ``means -> {metric: value}``: metrics computed from the reduced means
            (e.g. perplexity from the mean loss); ``None``: none.
    """

    name: str
    step: Callable[[nn.Module, Any], tuple[torch.Tensor, Mapping[str, Any]]]
    derived: Callable[[dict[str, float]], dict[str, float]] | None = None

    def _bad(self, what: str) -> ConfigError:
        return ConfigError(f'objective = "{self.name}": {what}')

    def __call__(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Pair]]:
        """Run the step; returns the loss and every metric as a detached ``(sum, count)`` pair.

        Raises:
            ConfigError: the step returned something other than ``(loss, {metric: value})``,
                or a metric value that is neither a pair nor a scalar.
        """
        out = self.step(model, batch)
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], torch.Tensor)
                and isinstance(out[1], Mapping)):
            raise self._bad(f"must return (loss tensor, {{metric: value}}), got {type(out).__name__}")
        loss, metrics = out
        if loss.dim() != 0:
            raise self._bad(f"the loss must be a scalar (the batch mean), got shape {tuple(loss.shape)}")
        n = None
        pairs: dict[str, Pair] = {}
        for name, value in metrics.items():
            is_pair = isinstance(value, (tuple, list)) and len(value) == 2
            if is_pair:
                s, c = value
            else:  # a batch mean: weighted by the batch size
                n = batch_size(batch) if n is None else n
                s, c = value, n
            if isinstance(s, torch.Tensor) and s.numel() != 1:
                raise self._bad(f"metric {name!r} must be a scalar or a (sum, count) pair, got shape {tuple(s.shape)}")
            s = s.detach().double().reshape(()) if isinstance(s, torch.Tensor) else torch.tensor(float(s), dtype=torch.float64)
            pairs[name] = (s if is_pair else s * c, c.detach() if isinstance(c, torch.Tensor) else c)
        return loss, pairs

    def finalize(self, means: Mapping[str, float]) -> dict[str, float]:
        """The reduced means plus the derived metrics."""
        out = dict(means)
        if self.derived is not None:
            out.update(self.derived(out))
        return out


class ObjectiveOutputError(ConfigError):
    """A built-in objective cannot read the model's output (neither a tensor nor logits)."""


def logits_of(name: str, out: Any) -> torch.Tensor:
    """The logits tensor of a model output: the tensor itself, ``out["logits"]`` of a mapping
    (a ``transformers`` ``ModelOutput`` is one) or ``out.logits``.

    Raises:
        ObjectiveOutputError: ``out`` is none of these; the message names its type and how
            to write an objective that reads it.
    """
    if isinstance(out, torch.Tensor):
        return out
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    what = type(out).__name__
    if isinstance(out, Mapping):
        what += f" with keys {sorted(map(str, out))}"
    raise ObjectiveOutputError(
        f'objective = "{name}": the model returned a {what}, not a tensor or an output with logits; '
        'return logits from forward, or write an objective "package.module:function" taking (model, batch) '
        "and returning (loss, {metric: value}) (README: Your own model, data and objective)")


def _inputs_targets(name: str, batch: Any) -> tuple[Any, torch.Tensor]:
    if not (isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[1], torch.Tensor)):
        raise ConfigError(f'objective = "{name}": needs batches (inputs, targets, ...); got {type(batch).__name__}')
    return batch[0], batch[1]


def classification(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Pair]]:
    """Cross-entropy of ``model(inputs)`` logits against int64 class targets (see module docstring)."""
    x, y = _inputs_targets("classification", batch)
    logits = logits_of("classification", model(x))
    loss = F.cross_entropy(logits, y)  # the mean, exactly as pimm's digits training computes it
    with torch.no_grad():  # the summed loss, as pimm's evaluation always added it (bit for bit)
        total = F.cross_entropy(logits.float(), y, reduction="sum")
    n = y.numel()
    return loss, {"loss": (total, n), "acc": ((logits.argmax(1) == y).sum(), n)}


def regression(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Pair]]:
    """Mean squared error of ``model(inputs)`` against float targets (see module docstring)."""
    x, y = _inputs_targets("regression", batch)
    pred = logits_of("regression", model(x))
    if pred.shape != y.shape:
        if pred.numel() != y.numel():
            raise ConfigError(f'objective = "regression": model output shape {tuple(pred.shape)} does not match '
                              f"targets {tuple(y.shape)}")
        pred = pred.reshape(y.shape)
    err = pred.float() - y.float()
    loss = err.pow(2).mean()
    n = y.numel()
    return loss, {"loss": (loss.detach().double() * n, n), "mae": (err.detach().abs().sum(), n)}


def language_modeling(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Pair]]:
    """Next-token cross-entropy over int64 token batches ``(B, T)`` (see module docstring)."""
    tokens = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if not (isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and not tokens.is_floating_point()
            and tokens.shape[1] >= 2):
        what = f"shape {tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ConfigError(f'objective = "language_modeling": needs integer token batches (B, T) with T >= 2; got {what}')
    logits = logits_of("language_modeling", model(tokens[:, :-1]))
    targets = tokens[:, 1:]
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    n = targets.numel()
    return loss, {"loss": (loss.detach().double() * n, n)}


def _perplexity(means: dict[str, float]) -> dict[str, float]:
    loss = means.get("loss", math.nan)
    return {"perplexity": math.exp(loss) if loss < 709 else math.inf}  # exp overflows a double past ~709.8


#: The built-in objectives by ``objective`` name.
BUILTIN: dict[str, Objective] = {
    "classification": Objective("classification", classification),
    "regression": Objective("regression", regression),
    "language_modeling": Objective("language_modeling", language_modeling, _perplexity),
}
assert set(BUILTIN) == set(OBJECTIVE_METRICS)  # config.py validates eval.metric with these names


def get_objective(name: str, config_path: str | Path | None = None) -> Objective:
    """The objective ``name`` names: a built-in, or a user target (resolved and checked
    to take ``(model, batch)``; see :mod:`pimm_core.targets`).

    Raises:
        ConfigError: unknown module or attribute, or a function that cannot take two
            positional arguments.
    """
    if name in BUILTIN:
        return BUILTIN[name]
    spec = TargetSpec("objective", name)
    fn = resolve(spec, config_path)
    if isinstance(fn, Objective):
        return fn
    check_args(spec, fn, positional=2)
    return Objective(name, fn)


class MetricTotals:
    """Running ``(sum, count)`` of each metric over one evaluation on this rank.

    The sums stay tensors on the metrics' device (float64), so adding a batch does not
    wait for the device; :meth:`reduce` reads them once.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, Any] = {}

    def add(self, pairs: Mapping[str, Pair]) -> None:
        """Add one batch's metrics, as :meth:`Objective.__call__` returns them."""
        for name, (s, c) in pairs.items():
            self.sums[name] = self.sums[name] + s if name in self.sums else s
            self.counts[name] = self.counts[name] + c if name in self.counts else c

    def reduce(self, all_reduce_sum: Callable[[torch.Tensor], Any] | None = None,
               all_gather_object: Callable[[Any], list[Any]] | None = None,
               device: torch.device | str = "cpu") -> dict[str, float]:
        """The means over every rank: ``sum over ranks of sums / sum over ranks of counts``.

        Args:
            all_reduce_sum: in-place sum of a float64 tensor over ranks
                (:func:`pimm_core.dist.all_reduce_sum`); ``None``: this rank alone.
            all_gather_object: gathers each rank's metric names, so a rank that saw no
                batch (or a metric only some batches report) still joins the same reduce;
                ``None``: every rank must have the same names.
            device: where the reduced tensor lives (a CUDA device under NCCL).

        Returns:
            ``{name: mean}``; NaN for a metric whose total count is 0.
        """
        names = set(self.sums)
        if all_gather_object is not None:
            names = set().union(*all_gather_object(sorted(names)))
        names = sorted(names)
        flat = torch.zeros(2 * len(names), dtype=torch.float64, device=device)
        for i, name in enumerate(names):
            if name in self.sums:
                flat[i] = self.sums[name].to(device)
                c = self.counts[name]
                flat[len(names) + i] = c.to(device) if isinstance(c, torch.Tensor) else float(c)
        if all_reduce_sum is not None:
            all_reduce_sum(flat)
        values = flat.tolist()
        return {n: (values[i] / values[len(names) + i]) if values[len(names) + i] else math.nan
                for i, n in enumerate(names)}
