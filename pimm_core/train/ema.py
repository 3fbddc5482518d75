"""Exponential moving average (EMA) of model parameters.

After every optimizer step: ``ema = d * ema + (1 - d) * param`` with
``d = min(decay, (1 + n) / (10 + n))`` when warm-up is on, ``n`` being the number
of updates so far (the warm-up of TensorFlow's ``ExponentialMovingAverage`` with
``num_updates``, as used by timm's ``ModelEmaV2/V3``).

Buffers are copied, not averaged: the EMA weight set takes the raw model's buffers
(BatchNorm ``running_mean``/``running_var``/``num_batches_tracked``...) as they are when
the set is made, so it is a complete state dict. timm's ``ModelEmaV3`` averages float
buffers by default; here they are copied because running statistics are already an
exponential average of their own, integer buffers cannot be averaged, and a copy needs
no state beyond the raw model's: a resume restores the EMA set exactly from the raw
buffers and the averaged parameters, with checkpoints of any earlier run read as before.

Tied parameters (``head.weight is embed.weight``) are one tensor: the average keeps one
entry per tensor object, under its canonical name (the first in registration order, as
``named_parameters()`` reports it), and the weight set gives every tied name that one
tensor, so a file written from it stores the tensor once and a load keeps the tie.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from ..checkpoint.tensors.ties import tied_groups


class EMA:
    """EMA of ``model``'s parameters (fp32 copies on the parameters' device, one per tensor).

    Args:
        model: the unwrapped model.
        decay: target decay in [0, 1).
        warmup: ramp the decay up with the update count (see module docstring).
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True):
        self.decay, self.warmup = decay, warmup
        self.restart(model)

    def restart(self, model: nn.Module) -> None:
        """Start the average over from ``model``'s current parameters (after a warm start, or
        a resume from a checkpoint without EMA weights)."""
        self.updates = 0
        self._params: tuple[nn.Module, list[tuple[list[torch.Tensor], list[torch.Tensor], bool]]] | None = None  # update()'s lists
        # named_parameters() drops duplicates by identity: a tied tensor is averaged once
        self.shadow = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        # every name of each averaged tensor, canonical first: a saved set is read by any of them
        self._names = {n: [n] for n in self.shadow}
        for group in tied_groups(model):
            if group[0] in self._names:
                self._names[group[0]] = group

    def current_decay(self) -> float:
        n = self.updates
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the model's current parameters into the average (call after each optimizer step).

        The parameter objects are looked up once per ``model`` (like the optimizer, the average
        follows the parameters it was made from, updated in place; :meth:`restart` after replacing
        them): a walk of the module tree per step costs more than the update at a small model.
        """
        d = self.current_decay()
        if self._params is None or self._params[0] is not model:
            params = dict(model.named_parameters())
            groups: dict[Any, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for n in self.shadow:  # one foreach per kind of tensor: plain, or DTensors of one mesh and layout (TP, FSDP)
                p = params[n]
                ema, cur = groups.setdefault((getattr(p, "device_mesh", None), getattr(p, "placements", None)), ([], []))
                ema.append(self.shadow[n])
                cur.append(p)
            self._params = (model, [(ema, cur, all(p.dtype == torch.float32 for p in cur)) for ema, cur in groups.values()])
        for ema, cur, fp32 in self._params[1]:  # (elementwise: the same values however grouped)
            torch._foreach_lerp_(ema, cur if fp32 else [p.detach().float() for p in cur], 1.0 - d)
        self.updates += 1

    def parameters_for(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The averaged parameters, one canonical name per tensor, in the parameters' dtypes.

        For ``torch.func.functional_call(model, ...)`` (whose ``tie_weights=True`` gives a
        tied tensor's value to all its names); the model's own buffers complete the set.
        Not copies where the dtype matches: read, never modify them.
        """
        return {n: self.shadow[n].to(p.dtype) for n, p in model.named_parameters() if n in self.shadow}

    @contextlib.contextmanager
    def swapped_into(self, model: nn.Module) -> Iterator[None]:
        """Inside the block the model's parameters hold the averaged values (copied in place,
        and the raw ones copied back after). For FSDP2, whose all-gather reads the sharded
        parameters it owns (``functional_call``'s substitutes would be ignored)."""
        params = dict(model.named_parameters())
        with torch.no_grad():
            raw = {n: params[n].detach().clone() for n in self.shadow}
            try:
                for n, t in self.shadow.items():
                    params[n].copy_(t.to(params[n].dtype))
                yield
            finally:
                for n, t in raw.items():
                    params[n].copy_(t)

    def state_dict_for(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The EMA weight set: averaged parameters (in the parameters' dtype) plus copies of the model's buffers.

        Keys and order are ``model.state_dict()``'s; names that are one tensor in the model
        get one tensor object here too (so ``torch.save`` and safetensors store it once).
        """
        canonical = {id(p): n for n, p in model.named_parameters()}
        made: dict[int, torch.Tensor] = {}  # the model's tensor's id -> its copy in the set
        out = {}
        for k, v in model.state_dict(keep_vars=True).items():
            if id(v) not in made:
                name = canonical.get(id(v))
                src = self.shadow[name] if name in self.shadow else v.detach()
                made[id(v)] = src.to(dtype=v.dtype, copy=True)
            out[k] = made[id(v)]
        return out

    def load(self, ema_sd: dict[str, torch.Tensor], updates: int) -> None:
        """Restore from a saved EMA weight set and update counter (bitwise for fp32 parameters).

        A tied tensor is read under its canonical name, else under any other of its names.

        Raises:
            KeyError: ``ema_sd`` has none of an averaged tensor's names.
        """
        for n, t in self.shadow.items():
            name = next((a for a in self._names[n] if a in ema_sd), n)
            src = ema_sd[name]
            if src is t:
                continue  # loaded in place (a sharded checkpoint's ema/ items)
            if hasattr(t, "device_mesh") and not hasattr(src, "device_mesh"):
                # a full saved tensor into an FSDP-sharded average: keep this rank's shard
                from torch.distributed.tensor import distribute_tensor

                src = distribute_tensor(src.to(t.device), t.device_mesh, t.placements, src_data_rank=None)
            t.copy_(src.float())
        self.updates = int(updates)

    def state_dict(self) -> dict[str, Any]:
        """The update count and settings, saved as the checkpoint's ``ema`` entry (the averaged
        weights are a weight set of their own: :meth:`state_dict_for`, restored by :meth:`load`)."""
        return {"updates": self.updates, "decay": self.decay, "warmup": self.warmup}
