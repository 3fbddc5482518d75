"""The train step: accumulation windows of micro-batches and the optimizer step that ends one.

For each micro-batch, :meth:`WindowStep.backward` runs forward (under autocast) and
backward; under DDP the gradient all-reduce (FSDP: reduce-scatter) happens only on the
window's last micro-batch. The window's gradient is the per-sample average over every
micro-batch of every rank when the objective returns ``(sum, count)``, else the mean of
the micro-batch means (:mod:`~pimm_core.train.window_average`). At the window's end
:meth:`WindowStep.finish` divides by the window's count, unscales and clips
(``train.grad_clip``, the global L2 norm), applies the ``train.on_nonfinite`` policy,
steps the optimizer through the AMP GradScaler, clears the gradients and updates the EMA.
The gradient norm is skipped on a step where nothing reads it (:meth:`WindowStep.norm_unread`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from ..checkpoint.tensors.state import unwrap
from ..config import TrainConfig
from ..errors import ConfigError, TrainingError
from ..objectives import BUILTIN, Loss, Objective, batch_size
from ..run.heartbeat import beat, forward_done
from .ema import EMA
from .evaluator import to_device
from .parallel import is_fsdp
from .tensor_parallel import clip_grad_norm_, mixed_grads
from .state import TrainState
from .window_average import WindowAverage

APPLIED, SKIPPED, STOP = "applied", "skipped", "stop"


def check_finite(model: nn.Module, step: int) -> None:
    """A run whose weights are NaN/Inf never ends as ``done`` with exit 0.

    Raises:
        TrainingError: names the first non-finite parameter and the step.
    """
    for name, p in unwrap(model).named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise TrainingError(f"the weights are not finite after step {step} ({name} holds "
                                "NaN or Inf); the run failed: resume from an earlier checkpoint with a lower "
                                "train.lr, or start over")


def _plain(grads: list[torch.Tensor]) -> bool:
    """Every gradient a plain tensor on one CPU or CUDA device, in one dtype (the common case)."""
    if not grads:
        return False
    device, dtype = grads[0].device, grads[0].dtype
    return device.type in ("cpu", "cuda") and all(
        type(g) is torch.Tensor and g.device == device and g.dtype == dtype for g in grads)


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``grads`` as one vector (0-d tensor): :func:`torch.nn.utils.get_total_norm`'s
    ops (so its bits), without its per-call grouping and dispatch checks in the common case (at
    a small model they cost as much as the norm); FSDP's DTensors, several devices or dtypes go
    through it."""
    if not _plain(grads):
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)


def all_finite(grads: list[torch.Tensor]) -> bool | None:
    """Whether every element of ``grads`` is finite, by one fused pass and one host read; None where
    the fast path does not apply (not :func:`_plain`, sparse, complex or other dtypes than float16,
    bfloat16, float32 and float64, a gradient that is an expanded view): the caller takes the norm.

    The pass is torch's own AMP check (:func:`torch._amp_foreach_non_finite_check_and_unscale_`, the
    one :class:`torch.amp.GradScaler` runs) with an inverse scale of 1: ``x * 1.0`` is ``x`` for
    every float, NaN and Inf included, so no gradient changes. On the quickstart's MLP it takes
    ~4 µs against ~12 µs for the norm and its read.
    """
    if not _plain(grads) or grads[0].dtype not in _AMP_DTYPES or any(g.layout != torch.strided for g in grads):
        return None  # (sparse or complex gradients: the kernel has none for them)
    device = grads[0].device
    found_inf, one = _AMP_CHECK.get(device) or _AMP_CHECK.setdefault(device, (
        torch.zeros(1, dtype=torch.float32, device=device), torch.ones(1, dtype=torch.float32, device=device)))
    found_inf.zero_()
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one)
    except (RuntimeError, NotImplementedError):  # (a gradient that is an expanded view: it writes in place)
        return None
    return not found_inf.item()


#: device -> (found_inf, inverse scale 1.0) of :func:`all_finite` (float32, as the kernel wants), made once.
_AMP_CHECK: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

#: The gradient dtypes :func:`all_finite` checks (the AMP kernel's); others take the norm.
_AMP_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """:func:`torch.nn.utils.clip_grad_norm_` (L2; its ops, so its bits) with :func:`total_norm`'s
    fast path; returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not _plain(grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = total_norm(grads)
    torch._foreach_mul_(grads, torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0))
    return norm


def _beating(batches: Iterable) -> Iterator[Any]:
    """``batches``, with this rank's heartbeat phase ``data`` while the next one is fetched and
    ``forward/backward`` while it is used (:mod:`pimm_core.run.heartbeat`: no I/O here)."""
    it = iter(batches)
    while True:
        beat("data")
        try:
            batch = next(it)
        except StopIteration:
            return
        beat("forward/backward")
        yield batch


def autocast_context(amp: str, device_type: str) -> contextlib.AbstractContextManager:
    """The forward pass's mixed-precision context: ``train.amp`` ``"bf16"``/``"fp16"`` autocast, or none."""
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Inside a window only the last micro-batch's backward reduces gradients across ranks:
    DDP's ``no_sync`` before it; FSDP2's ``set_requires_gradient_sync(False)`` (the unsharded
    gradients accumulate locally, one reduce-scatter per window)."""
    if is_fsdp(model):
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if enabled or not hasattr(model, "no_sync"):  # (TP alone: no data-parallel reduction to defer)
        return contextlib.nullcontext()
    return model.no_sync()


class WindowStep:
    """Forward/backward per micro-batch and one optimizer step per window.

    Args:
        model: the (DDP-wrapped, where distributed) model.
        optimizer, scaler: stepped at the end of each window.
        ema: updated after each applied or skipped step (None: no EMA).
        train: ``grad_clip`` and ``on_nonfinite`` are read from it.
        autocast: a context-manager factory for the forward pass (mixed precision).
        distributed: gradients are reduced across ranks (DDP or FSDP): only at a window's end.
        objective: ``(model, batch) -> (loss, metrics)`` (:mod:`pimm_core.objectives`;
            classification by default); only the loss is used here.
        before_step: called just before the optimizer step (e.g. an async save's staging
            must finish copying the weights first).
        before_forward: called with the micro-batch's position in its window before its forward
            (the global order seeds the model's randomness there).
        window_flags: called at each window's end, before its all-reduce: numbers summed over the
            ranks in that same all-reduce (the stop agreement's flags; None: nothing this
            window), whose sums go to ``on_window_flags`` (float64 tensor) before
            :meth:`finish`. One small collective per window besides the gradients' thus
            carries the loss, the count and the stop agreement.
        records_next: whether the step being taken writes a train record, which reads its
            :attr:`grad_norm` (:meth:`~.recorder.Recorder.records_next`; None: the norm every step).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 ema: EMA | None, train: TrainConfig, *, autocast: Callable[[], contextlib.AbstractContextManager],
                 distributed: bool, objective: Objective = BUILTIN["classification"],
                 before_step: Callable[[], None] | None = None,
                 before_forward: Callable[[int], None] | None = None,
                 window_flags: Callable[[], list[float] | None] | None = None,
                 on_window_flags: Callable[[torch.Tensor], None] | None = None,
                 records_next: Callable[[], bool] | None = None):
        self.model, self.optimizer, self.scaler, self.ema, self.train = model, optimizer, scaler, ema, train
        if not isinstance(objective, Objective):  # a bare step function: checked and normalised like one
            objective = Objective(getattr(objective, "__name__", "objective"), objective)
        self.autocast, self.distributed, self.objective, self.before_step = autocast, distributed, objective, before_step
        self.grad_norm: torch.Tensor | None = None
        self.before_forward = before_forward
        self.window_flags, self.on_window_flags = window_flags, on_window_flags
        self.records_next = records_next
        self._param_list: list[nn.Parameter] | None = None
        self._mixed: bool | None = None  # False: no parameter can carry a DTensor gradient (_params)
        self._raw_model: nn.Module = model  # unwrap(model), set with _param_list
        self.average = WindowAverage(torch.device("cpu"), distributed)  # windows() puts it on the step's device

    def windows(self, batches: Iterable, state: TrainState, micro_batches: int,
                device: torch.device) -> Iterator[tuple[str, torch.Tensor, int]]:
        """Train the rest of an epoch window by window, from where ``state.iter`` stands.

        A window holds ``train.grad_accum`` micro-batches counted from where the epoch
        continues (the epoch's last may be shorter). ``state.iter`` counts each micro-batch
        consumed; the caller advances ``global_step``.

        Args:
            batches: yields the loader's batches from ``state.iter`` on (the objective reads them).
            micro_batches: micro-batches in the whole epoch.

        Yields:
            At each window's end: :meth:`finish`'s outcome, the window's loss (a 0-d tensor on
            ``device``, or a :class:`~.window_average.WindowLoss` computed when read: per counted
            item over every rank for a ``(sum, count)`` objective, else this rank's mean of the
            micro-batch means; read it with ``.item()``) and the number of samples it used on this rank.
        """
        accum = self.train.grad_accum
        # (the previous epoch's last count carries K into this one: no collective for it)
        self.average = WindowAverage(device, self.distributed, self.average.first_total)
        self._param_list = None
        window_start, samples = state.iter, 0  # windows run from where this epoch continues
        for batch in _beating(batches):
            batch = to_device(batch, device)
            window_len = min(accum, micro_batches - window_start)
            last_in_window = state.iter + 1 == window_start + window_len
            if self.before_forward is not None:
                self.before_forward(state.iter - window_start)
            self.backward(batch, window_len=window_len, last_in_window=last_in_window)
            state.iter += 1
            samples += batch_size(batch)
            if not last_in_window:
                continue
            flags = self.window_flags() if self.window_flags is not None else None
            if flags is not None:
                beat("collective", "window all-reduce (loss, count, stop agreement)")
            # (gradients divided before clipping; the loss computed when a record reads it)
            window_loss = self.average.finish(self._params(), flags, lazy=True)
            if flags is not None and self.on_window_flags is not None:
                self.on_window_flags(self.average.flags_total)
            yield self.finish(), window_loss, samples
            window_start, samples = state.iter, 0

    def backward(self, batch: Any, *, window_len: int, last_in_window: bool) -> None:
        """One micro-batch of a window of ``window_len``: forward, then backward of its share
        (:meth:`WindowAverage.to_backward`); the window's end is :meth:`WindowAverage.finish`."""
        sync = gradient_sync(self.model, last_in_window) if self.distributed else contextlib.nullcontext()
        with sync:
            with self.autocast():
                loss, seed = self.average.seeded(self._forward(batch), window_len=window_len)
            forward_done()  # (the heartbeat's work_s: what a straggler is measured by)
            if self.scaler.is_enabled():  # (fp16: a disabled scaler's scale() is the tensor itself)
                loss = self.scaler.scale(loss)
            loss.backward(seed)

    def _forward(self, batch: Any) -> Loss:
        """The objective's loss of ``batch``.

        Raises:
            ConfigError: DDP found a parameter that got no gradient in the previous step (a layer
                frozen mid-run, a branch not taken) and ``train.find_unused_parameters`` is off.
        """
        try:
            return self.objective.loss(self.model, batch)
        except RuntimeError as e:
            if "Expected to have finished reduction in the prior iteration" not in str(e):
                raise
            raise ConfigError("a parameter got no gradient in the previous step (a layer frozen mid-run, a branch "
                              "not taken), which DDP refuses by default; set train.find_unused_parameters = true"
                              ) from None

    def gradients_finite(self) -> bool:
        """Unscale, clip (``train.grad_clip``) and say whether the window's gradients are finite;
        :attr:`grad_norm` is the window's total L2 gradient norm before clipping (0-d tensor), or
        None on a step where nothing reads it (:meth:`norm_unread`: then no norm is computed, and
        the check, unless ``on_nonfinite = "continue"``, is :func:`all_finite`'s).

        The check is on the total gradient norm, or on a step that computes none on each element
        (:func:`all_finite`; the difference: a norm that overflows while every element is finite,
        as fp16 parameters trained without AMP can give, is non-finite on a step that computes
        it, the same on each rank). After DDP's all-reduce every rank holds the same gradients,
        so every rank reaches the same verdict without a collective (a NaN loss on one rank makes
        the averaged gradients NaN everywhere). With
        ``amp = "fp16"`` the GradScaler's own skip-and-rescale handles overflow instead.
        """
        t = self.train
        unread = self.norm_unread()
        if unread and t.on_nonfinite == "continue":
            self.grad_norm = None
            return True
        params = [p for p in self._params() if p.grad is not None]
        if unread:
            self.grad_norm = None
            finite = all_finite([p.grad for p in params]) if self._mixed is False else None
            if finite is not None:
                return finite  # (else: the norm below, as torch computes it for these gradients)
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)  # the norm is of the true gradients
        if self._mixed is not False and mixed_grads(params):  # TP: DTensors of several meshes and plain tensors
            norm = clip_grad_norm_(params, t.grad_clip)
        elif t.grad_clip:
            norm = clip_grad_norm(params, t.grad_clip)  # the norm before clipping
        else:
            norm = total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):  # FSDP: a DTensor over the shards; full_tensor() reduces it
            norm = norm.full_tensor()
        self.grad_norm = norm.detach()  # logged as grad_norm (read only when a record is written)
        if t.on_nonfinite == "continue" or self.scaler.is_enabled():
            return True
        return math.isfinite(norm.item())  # (one host read, as bool() of the tensor was)

    def norm_unread(self) -> bool:
        """Whether nothing reads this window's gradient norm: no clipping (``train.grad_clip`` unset
        or 0), no fp16 GradScaler and no train record written at this step (``records_next``).

        Then :meth:`gradients_finite` computes no norm: on the quickstart's MLP the norm is a
        few percent of a step. ``train.on_nonfinite = "continue"`` then checks nothing; "stop" and
        "skip" check that the gradients are finite by :func:`all_finite` (plain tensors; a DTensor's
        check is the norm, a collective that every rank takes at the same steps). Without clipping
        the norm changes no gradient, so skipping it changes no bit of training.
        """
        t = self.train
        return (self.records_next is not None and not t.grad_clip and not self.scaler.is_enabled()
                and not self.records_next())

    def _params(self) -> list[nn.Parameter]:
        """The model's parameters, listed once per :meth:`windows` call (like the optimizer's, they
        are updated in place; a walk of the module tree per step costs as much as a small model's step)."""
        if self._param_list is None:
            self._param_list = list(self.model.parameters())
            # (every parameter a plain tensor: its gradient is one too, no mix of DTensor kinds to look for)
            self._mixed = None if any(type(p) is not nn.Parameter for p in self._param_list) else False
            self._raw_model = unwrap(self.model)
        return self._param_list

    def finish(self) -> str:
        """End the window: :data:`APPLIED`, :data:`SKIPPED` (non-finite, ``on_nonfinite = "skip"``)
        or :data:`STOP` (non-finite, ``"stop"``: nothing applied, the caller stops the run)."""
        finite = self.gradients_finite()
        if not finite and self.train.on_nonfinite == "stop":
            self.optimizer.zero_grad(set_to_none=True)
            return STOP
        if self.before_step is not None:
            self.before_step()
        outcome = APPLIED
        if finite or self.train.on_nonfinite == "continue":
            if self.scaler.is_enabled():
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:  # (what a disabled GradScaler's step() calls; its update() does nothing)
                self.optimizer.step()
        else:
            outcome = SKIPPED
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self._params()
            self.ema.update(self._raw_model)
        return outcome
