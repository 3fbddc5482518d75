"""Per-sample averaging of an accumulation window: its gradient is the sum of the loss over
every micro-batch of every rank divided by the window's total count.

An objective that returns its loss as ``(sum, count)`` (:class:`~pimm_core.objectives.Loss`;
the built-ins do) gets the gradient of the window as one batch: with 7 samples cut into
micro-batches of 4 and 3, or spread over ranks, one optimizer step equals the step on all 7
(up to the order of floating-point additions). An objective that returns a plain mean
keeps the mean of the micro-batch means (each micro-batch weighs the same, whatever its
size; under DDP/FSDP the ranks' means are averaged too), as before.

How (the choice of torchtune's per-token normalisation over Hugging Face's
``num_items_in_batch``): each micro-batch backpropagates its *sum* times a scale ``K``;
after the window's last backward (which reduces the gradients across ranks, averaging them
over the ``W`` ranks) one all-reduce of ``[loss sum, count]`` gives the window's total
count ``N`` on every rank, and the gradients are multiplied once by ``W / (K * N)``.
Counting up front instead (pre-fetching the window's micro-batches and counting their
samples or tokens before any forward) would need a second definition of the count beside
the objective's own (masks, ignored labels) and would hold a window of batches in memory;
the count the objective returns with its sum is the one that is right by construction.
The price is one small all-reduce and one multiply per gradient element per window (the
same memory traffic as the clipping norm that follows).

``K`` keeps the gradients at the magnitude of a mean, which matters to fp16's loss scaling
(a sum over a million tokens would overflow at the GradScaler's scale): it is the power of
two nearest to ``1 / (count of the window's first micro-batch over all ranks * micro-batches
in the window)``. A power of two scales every floating-point value exactly, so ``K`` changes
no bit of the result (outside fp16's sub-normal range); it must be the same on every rank
(DDP/FSDP add the ranks' gradients before the rescale). The first window of a
:meth:`~pimm_core.train.step.WindowStep.windows` sequence gets that count by one all-reduce
between its first forward and its backward; every later window takes the first count of the
window before it, which that window's ``[loss sum, count]`` all-reduce carries as a third
element. So a window costs one small all-reduce besides the gradient reduction, not two:
on a machine where the ranks are not always scheduled at once, each collective waits for the
slowest rank, and at a small model that wait is most of the step. (With micro-batches of
changing size ``K`` may then differ by a power of two from the one of the window's own first
count: no bit of the gradient changes, as above; only fp16's headroom moves by that factor,
which the GradScaler absorbs.)
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from ..errors import ConfigError
from ..objectives import Loss
from ..process import dist


_SEEDS: dict[tuple, torch.Tensor] = {}  # (K, dtype, device) -> K as a 0-d tensor (WindowAverage._seed)


def _world_size() -> int:
    d = torch.distributed
    return d.get_world_size() if d.is_available() and d.is_initialized() else 1


def _as_tensor(count: torch.Tensor | int | float, device: torch.device) -> torch.Tensor:
    if isinstance(count, torch.Tensor):
        return count.to(device=device, dtype=torch.float64)
    return torch.tensor(float(count), dtype=torch.float64, device=device)


class WindowAverage:
    """The loss each micro-batch backpropagates, the gradient rescale at the window's end and
    the window's loss to log.

    Args:
        device: where the loss and the counts live (the reduced tensors under NCCL).
        distributed: gradients are reduced across ranks (DDP or FSDP, also at one rank).
        first_total: the count of the previous window's first micro-batch over every rank
            (float64, 0-d; :attr:`first_total` of the average that ended it), which gives
            ``K`` without a collective; None: the first window all-reduces its own.
    """

    def __init__(self, device: torch.device, distributed: bool, first_total: torch.Tensor | None = None):
        self.device, self.distributed = device, distributed
        self.flags_total: torch.Tensor | None = None  # the last finish()'s flags, summed over the ranks
        # (the same value on every rank: it came out of an all-reduce)
        self.first_total = None if first_total is None else first_total.to(device)
        self._world: int | None = None  # the world size, read once (the host path's rescale)
        self.start()

    def start(self) -> None:
        """A new window begins."""
        self.per_sample: bool | None = None  # set by the window's first micro-batch
        # On the host (one process, counts on the CPU or plain numbers): K and the counts are Python
        # floats, the same float64 arithmetic without a dozen tiny tensor ops per micro-batch (at a
        # small model they cost as much as the forward). Elsewhere tensors on ``device``: no sync.
        self.host: bool | None = None
        self.scale: torch.Tensor | float | None = None  # K (float64 0-d on device, or a float on the host)
        self.loss_sum: torch.Tensor | None = None  # float64, 0-d; from the window's first micro-batch
        # the micro-batches' losses (detached, their dtype) where the window's loss is only read on
        # the host (one process, or a mean window): summed in float64 when a record reads it
        self.parts: list[torch.Tensor] = []
        self.count: torch.Tensor | float = 0.0
        self.first: torch.Tensor | None = None  # this rank's count of the window's first micro-batch

    def to_backward(self, loss: Loss, *, window_len: int) -> torch.Tensor:
        """The tensor to backpropagate for one micro-batch of a window of ``window_len``
        (:meth:`seeded`'s tensor times its seed).

        Raises:
            ConfigError: the objective returned a mean for one micro-batch and a
                ``(sum, count)`` for another of the same window.
        """
        out, seed = self.seeded(loss, window_len=window_len)
        return out if seed is None else out * seed

    def seeded(self, loss: Loss, *, window_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`to_backward` as ``(tensor, seed)``: ``tensor.backward(seed)`` gives its gradients
        (``seed`` None: ones). On the host path ``K`` is the seed, not a multiply: a power of two
        scales exactly, so the seed ``K`` and a product's backward (``1 * K``) are the same value,
        without an op in the forward and one in the backward per micro-batch.

        Raises:
            ConfigError: as :meth:`to_backward`.
        """
        per_sample = loss.count is not None
        if self.per_sample is None:
            self.per_sample = per_sample
        elif self.per_sample != per_sample:
            raise ConfigError("the objective returned its loss as a mean for one batch and as a (sum, count) pair "
                              "for another; return the same form for every batch (docs/objectives.md)")
        if not per_sample:  # a mean: the window averages its micro-batches' means
            out = loss.value / window_len if window_len != 1 else loss.value  # (x / 1 is x, bit for bit)
            self.parts.append(out.detach())
            return out, None
        count = loss.count
        if self.host is None:
            self.host = not self.distributed and (not isinstance(count, torch.Tensor) or count.device.type == "cpu")
        if self.host:
            self.parts.append(loss.value.detach())
            count = float(count)  # (a CPU tensor, or a number: no device sync)
            self.count += count
            if self.scale is None:  # the window's first micro-batch: K, as below in float64
                self.scale = 2.0 ** -round(math.log2(max(count * window_len, 1.0)))
            value = loss.value  # K (a power of two: exact, as the tensor K's product) seeds its backward
            return value, None if self.scale == 1.0 else self._seed(self.scale, value)
        self._add_loss(loss.value.detach().double())
        count = _as_tensor(count, self.device)
        self.count = self.count + count if isinstance(self.count, torch.Tensor) else count.clone()
        if self.scale is None:  # the window's first micro-batch: K, the same on every rank
            self.first = count.clone()
            first = self.first_total
            if first is None:  # (the first window: no earlier one's count to take)
                first = count.clone()
                if self.distributed:
                    dist.all_reduce_sum(first)
            self.scale = torch.exp2(-torch.round(torch.log2(torch.clamp(first * window_len, min=1.0))))
        return loss.value * self.scale.to(loss.value.dtype), None

    def _seed(self, k: float, like: torch.Tensor) -> torch.Tensor:
        """``K`` as a 0-d tensor of ``like``'s dtype and device, made once per value (windows of
        one size reuse it: no tensor built per micro-batch)."""
        key = (k, like.dtype, like.device)
        seed = _SEEDS.get(key)
        if seed is None:
            if len(_SEEDS) > 64:  # (micro-batches of ever-changing counts: keep the cache small)
                _SEEDS.clear()
            seed = _SEEDS[key] = torch.tensor(k, dtype=like.dtype, device=like.device)
        return seed

    def _add_loss(self, value: torch.Tensor) -> None:
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value

    def finish(self, params: Iterable[torch.nn.Parameter], flags: list[float] | None = None, *,
               lazy: bool = False) -> torch.Tensor | WindowLoss:
        """At the window's end, after its last backward: divide the gradients by the window's total
        count (a per-sample window) and return the window's loss (0-d float32 tensor; per counted
        item over every rank, or this rank's mean of micro-batch means). A window with no counted
        item gets a zero gradient and a logged loss of 0.

        Args:
            lazy: where the loss is known on this rank alone (one process, a mean window), return
                it as a :class:`WindowLoss`, whose float64 sum and division run when it is read
                (a record reads one loss every ``train.log_every_steps``; at a small model these
                conversions cost as much as a part of the step).
            flags: numbers to sum over the ranks in the same all-reduce (the stop agreement's,
                :meth:`~pimm_core.train.stop_agreement.StopAgreement.window_flags`); their sums
                are then :attr:`flags_total` (float64, on ``device``). A mean window has no
                all-reduce of its own: it makes one for them.
        """
        extra = None if flags is None else torch.tensor(flags, dtype=torch.float64, device=self.device)
        self.flags_total = extra
        if not self.per_sample:
            if extra is not None and self.distributed:
                dist.all_reduce_sum(extra)
            out = WindowLoss(self.parts, None, self.device)
            self.start()
            return out if lazy else out.tensor()
        if self.host:  # (one process: no flags to reduce, flags_total is this rank's)
            n = self.count
            # the same float64 arithmetic as the tensors' below; a factor of 1 (full windows of a
            # power-of-two count) changes no gradient bit and is skipped
            if self._world is None:
                self._world = _world_size()
            factor = self._world / (self.scale * max(n, 1.0)) if n > 0 else 0.0
            if factor != 1.0:
                _scale_grads(params, factor)
            out = WindowLoss(self.parts, max(n, 1.0), self.device)
            self.start()
            return out if lazy else out.tensor()
        loss_sum = self.loss_sum if self.loss_sum is not None else torch.zeros((), dtype=torch.float64,
                                                                               device=self.device)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        totals = torch.stack([loss_sum, self.count if isinstance(self.count, torch.Tensor) else zero,
                              self.first if self.first is not None else zero])
        if extra is not None:
            totals = torch.cat([totals, extra])
        if self.distributed:
            dist.all_reduce_sum(totals)  # (the first count and the flags ride along)
        total, n = totals[0], totals[1]
        if self.first is not None:
            self.first_total = totals[2]
        if extra is not None:
            self.flags_total = totals[3:]
        safe_n = torch.clamp(n, min=1.0)
        # DDP and FSDP averaged the ranks' gradients: the sum over ranks is W times that
        factor = torch.where(n > 0, _world_size() / (self.scale * safe_n), torch.zeros_like(n))
        _scale_grads(params, factor)
        self.start()
        return (total / safe_n).float()


class WindowLoss:
    """A window's loss as a 0-d float32 tensor, computed when first read: the float64 sum of its
    micro-batches' losses (in their order), divided by ``divisor`` (None: not divided), the ops
    and so the bits of :meth:`WindowAverage.finish`'s tensor.

    Args:
        parts: the micro-batches' detached 0-d losses.
        divisor: the window's count (a float), or None (a mean window: the parts are its
            micro-batches' shares already).
    """

    __slots__ = ("_parts", "_divisor", "_device", "_value")

    def __init__(self, parts: list[torch.Tensor], divisor: float | None, device: torch.device):
        self._parts, self._divisor, self._device = parts, divisor, device
        self._value: torch.Tensor | None = None

    def tensor(self) -> torch.Tensor:
        """The loss (0-d float32 tensor; computed once)."""
        if self._value is None:
            parts = self._parts
            total = parts[0].double() if parts else torch.zeros((), dtype=torch.float64, device=self._device)
            for p in parts[1:]:
                total = total + p.double()
            self._value = (total if self._divisor is None else total / self._divisor).float()
            self._parts = []
        return self._value

    def item(self) -> float:
        """The loss as a Python float (one host read)."""
        return self.tensor().item()


def _scale_grads(params: Iterable[torch.nn.Parameter], factor: torch.Tensor | float) -> None:
    """Multiply every gradient by ``factor`` (rounded to the gradient's dtype first, as a tensor)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault((p.grad.device, p.grad.dtype, hasattr(p.grad, "full_tensor")), []).append(p.grad)
    for (device, dtype, sharded), grads in groups.items():
        f = factor.to(device=device, dtype=dtype) if isinstance(factor, torch.Tensor) else \
            torch.tensor(factor, device=device, dtype=dtype)
        if sharded:  # FSDP's DTensors: one multiply each (each applies to the local shard)
            for g in grads:
                g.mul_(f)
        else:
            torch._foreach_mul_(grads, f)
