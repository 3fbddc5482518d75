"""What a step computes: the loss to minimize and the metrics to report (``objective``).

An objective is called as ``objective(model, batch) -> (loss, metrics)``:

- ``loss``: what the trainer backpropagates, in one of two forms:

  - a pair ``(sum, count)``: the loss summed over ``count`` items (samples, tokens that
    are not padding), a 0-d tensor and an int or 0-d tensor. An accumulation window's
    gradient is then the sum over every micro-batch of every rank divided by the window's
    total count (:mod:`pimm_core.train.window_average`): one optimizer step equals the
    step on the whole window as one batch, however it is cut into micro-batches and ranks.
    The built-ins return this form.
  - a scalar tensor, the batch's mean: a window averages its micro-batches' means (each
    weighs the same, whatever its size), as pimm always did.
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
  ``(B, C, d1, ...)`` with targets ``(B, d1, ...)``), int64 class targets (``-100``:
  ignored); cross-entropy summed over the targets that are not ignored, with their count;
  metrics ``loss`` (nats per target) and ``acc`` (fraction).
- ``regression``: batches ``(inputs, targets, ...)``; outputs of the targets' shape (or
  the same number of elements, e.g. ``(B, 1)`` for ``(B,)``); squared error summed over
  the target elements, with their count; metrics ``loss`` (MSE per element) and ``mae``.
- ``language_modeling``: batches of int64 tokens ``(B, T)`` (or a tuple whose first item
  is, or a mapping with ``"input_ids"`` and optionally ``"attention_mask"`` (0: padding)
  and/or ``"labels"`` (``-100``: ignored), as Hugging Face tokenizers and collators make
  them); the model maps ``(B, T-1)`` tokens to logits ``(B, T-1, V)``; next-token
  cross-entropy summed over the target tokens that are neither padding nor ignored, with
  their count; metrics ``loss`` (nats per counted token) and ``perplexity``
  (``exp(loss)``).

The built-ins read the model's output as a tensor, or take its logits from a
``ModelOutput``/object with a ``logits`` attribute (Hugging Face ``transformers``) or a
mapping with a ``"logits"`` key (:func:`logits_of`); any other output is a
:class:`ObjectiveOutputError` naming what the model returned.

A user objective is a target ``"package.module:function"`` with that signature; it may
also name an :class:`Objective` instance to add derived metrics. The built-in step
functions (:func:`classification`, ...) can be called from one: they return the
``(sum, count)`` form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import OBJECTIVES as OBJECTIVE_METRICS
from .errors import ConfigError
from .targets import TargetSpec, check_args, resolve

#: A metric as the trainer accumulates it: ``(sum, count)``.
Pair = tuple[torch.Tensor, torch.Tensor | float]

#: Targets with this value are ignored (``F.cross_entropy``'s default, Hugging Face's labels).
IGNORE_INDEX = -100


class Loss(NamedTuple):
    """A micro-batch's loss as :meth:`Objective.__call__` returns it.

    Attributes:
        value: a 0-d tensor (with its graph): the sum over ``count`` items, or the batch's
            mean when ``count`` is None.
        count: the number of items summed (an int or a 0-d tensor, e.g. the tokens that
            are not padding); None: ``value`` is a mean.
    """

    value: torch.Tensor
    count: torch.Tensor | int | float | None = None

    def mean(self) -> torch.Tensor:
        """The loss per item (0-d tensor): ``value / count``, or ``value`` when it is a mean."""
        return self.value if self.count is None else self.value / self.count


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
        train_loss: ``(model, batch) -> loss``: the loss alone, the same value ``step``
            returns first, for training steps, which read no metric (the built-ins skip
            their accuracy and the like there); ``None``: ``step``'s, its metrics unused.
    """

    name: str
    step: Callable[[nn.Module, Any], tuple[torch.Tensor, Mapping[str, Any]]]
    derived: Callable[[dict[str, float]], dict[str, float]] | None = None
    train_loss: Callable[[nn.Module, Any], Any] | None = None

    def _bad(self, what: str) -> ConfigError:
        return ConfigError(f'objective = "{self.name}": {what}')

    def __call__(self, model: nn.Module, batch: Any) -> tuple[Loss, dict[str, Pair]]:
        """Run the step; returns its :class:`Loss` and every metric as a detached ``(sum, count)`` pair.

        Raises:
            ConfigError: the step returned something other than ``(loss, {metric: value})``
                with a loss that is a scalar tensor or a ``(sum, count)`` pair, or a metric
                value that is neither a pair nor a scalar.
        """
        out = self.step(model, batch)
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], Mapping)):
            raise self._bad(f"must return (loss, {{metric: value}}), got {type(out).__name__}")
        loss, metrics = self._loss(out[0]), out[1]
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

    def loss(self, model: nn.Module, batch: Any) -> Loss:
        """A training step's :class:`Loss` of ``batch``: :attr:`train_loss`, else ``step``'s loss
        (its metrics are not read: evaluation checks and reduces them).

        Raises:
            ConfigError: the step returned something other than ``(loss, {metric: value})``, or
                a loss that is neither a scalar tensor nor a ``(sum, count)`` pair.
        """
        if self.train_loss is not None:
            return self._loss(self.train_loss(model, batch))
        out = self.step(model, batch)
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], Mapping)):
            raise self._bad(f"must return (loss, {{metric: value}}), got {type(out).__name__}")
        return self._loss(out[0])

    def _loss(self, loss: Any) -> Loss:
        """The step's loss as a :class:`Loss`: a scalar tensor (a mean) or a ``(sum, count)`` pair."""
        if isinstance(loss, torch.Tensor):
            if loss.dim() != 0:
                raise self._bad(f"the loss must be a scalar (the batch mean) or a (sum, count) pair, "
                                f"got shape {tuple(loss.shape)}")
            return Loss(loss)
        if not (isinstance(loss, (tuple, list)) and len(loss) == 2 and isinstance(loss[0], torch.Tensor)):
            what = type(loss).__name__
            if isinstance(loss, (tuple, list)):
                what += f" of ({', '.join(type(v).__name__ for v in loss)})"
            raise self._bad(f"the loss must be a scalar tensor (the batch mean) or a (sum tensor, count) pair, "
                            f"got a {what}")
        total, count = loss
        if total.dim() != 0:
            raise self._bad(f"the loss sum must be a scalar, got shape {tuple(total.shape)}")
        if isinstance(count, torch.Tensor):
            if count.numel() != 1:
                raise self._bad(f"the loss count must be a number, got shape {tuple(count.shape)}")
            if count.requires_grad:  # (each op costs at a small model: only those that change something)
                count = count.detach()
            if count.dim():
                count = count.reshape(())
        elif isinstance(count, bool) or not isinstance(count, (int, float)):
            raise self._bad(f"the loss count must be an int or a 0-d tensor, got {type(count).__name__}")
        return Loss(total, count)

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
    loss = F.cross_entropy(logits, y, reduction="sum", ignore_index=IGNORE_INDEX)
    counted = y != IGNORE_INDEX
    n = counted.sum()
    with torch.no_grad():  # the summed loss in float32 whatever the autocast dtype, as evaluation always added it
        total = loss.detach() if logits.dtype == torch.float32 else \
            F.cross_entropy(logits.float(), y, reduction="sum", ignore_index=IGNORE_INDEX)
        correct = ((logits.argmax(1) == y) & counted).sum()
    return (loss, n), {"loss": (total, n), "acc": (correct, n)}


def classification_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`classification`'s loss alone, ``(sum, count)``: the same ops, without the metrics
    (a training step reads none; at a small model they cost as much as the forward)."""
    x, y = _inputs_targets("classification", batch)
    logits = logits_of("classification", model(x))
    return F.cross_entropy(logits, y, reduction="sum", ignore_index=IGNORE_INDEX), (y != IGNORE_INDEX).sum()


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
    loss = err.pow(2).sum()
    n = y.numel()
    return (loss, n), {"loss": (loss.detach(), n), "mae": (err.detach().abs().sum(), n)}


def language_modeling(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Pair]]:
    """Next-token cross-entropy over int64 token batches ``(B, T)`` (see module docstring)."""
    tokens, targets = _tokens_targets(batch)
    logits = logits_of("language_modeling", model(tokens[:, :-1]))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
    n = (targets != IGNORE_INDEX).sum()
    return (loss, n), {"loss": (loss.detach(), n)}


def _tokens_targets(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A language-modeling batch's tokens ``(B, T)`` and next-token targets ``(B, T-1)``, padding
    (``attention_mask`` 0) and ``labels`` of -100 set to :data:`IGNORE_INDEX`."""
    mask = labels = None
    if isinstance(batch, Mapping):
        tokens, mask, labels = batch.get("input_ids"), batch.get("attention_mask"), batch.get("labels")
    else:
        tokens = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if not (isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and not tokens.is_floating_point()
            and tokens.shape[1] >= 2):
        what = f"shape {tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ConfigError(f'objective = "language_modeling": needs integer token batches (B, T) with T >= 2 '
                          f'(or a mapping with "input_ids"); got {what}')
    for name, t in (("attention_mask", mask), ("labels", labels)):
        if t is not None and not (isinstance(t, torch.Tensor) and t.shape == tokens.shape):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ConfigError(f'objective = "language_modeling": "{name}" must have the tokens\' shape '
                              f"{tuple(tokens.shape)}; got {shape}")
    targets = (labels if labels is not None else tokens)[:, 1:]
    if mask is not None:
        targets = targets.masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
    return tokens, targets


def _perplexity(means: dict[str, float]) -> dict[str, float]:
    loss = means.get("loss", math.nan)
    return {"perplexity": math.exp(loss) if loss < 709 else math.inf}  # exp overflows a double past ~709.8


#: The built-in objectives by ``objective`` name.
BUILTIN: dict[str, Objective] = {
    "classification": Objective("classification", classification, train_loss=classification_loss),
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
                (:func:`pimm_core.process.dist.all_reduce_sum`); ``None``: this rank alone.
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
