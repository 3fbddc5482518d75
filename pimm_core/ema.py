"""Exponential moving average (EMA) of model parameters.

After every optimizer step: ``ema = d * ema + (1 - d) * param`` with
``d = min(decay, (1 + n) / (10 + n))`` when warm-up is on, ``n`` being the number
of updates so far (the warm-up of TensorFlow's ``ExponentialMovingAverage`` with
``num_updates``, as used by timm's ``ModelEmaV2/V3``). Parameters are averaged;
buffers (e.g. BatchNorm statistics) are not: at checkpoint time the EMA weight set
takes the raw model's buffers, so it is a complete state dict.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class EMA:
    """EMA of ``model``'s parameters (fp32 copies on the parameters' device).

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
        self.shadow = {n: p.detach().float().clone() for n, p in model.named_parameters()}

    def current_decay(self) -> float:
        n = self.updates
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the model's current parameters into the average (call after each optimizer step)."""
        d = self.current_decay()
        names = list(self.shadow)
        params = dict(model.named_parameters())
        ema = [self.shadow[n] for n in names]
        cur = [params[n].detach().float() for n in names]
        torch._foreach_lerp_(ema, cur, 1.0 - d)
        self.updates += 1

    def state_dict_for(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The EMA weight set: averaged parameters (in the parameters' dtype) plus the model's buffers."""
        own = model.state_dict()
        params = dict(model.named_parameters())
        out = {}
        for k, v in own.items():
            out[k] = self.shadow[k].to(v.dtype).clone() if k in self.shadow and k in params else v.detach().clone()
        return out

    def load(self, ema_sd: dict[str, torch.Tensor], updates: int) -> None:
        """Restore from a saved EMA weight set and update counter (bitwise for fp32 parameters)."""
        for n in self.shadow:
            self.shadow[n].copy_(ema_sd[n].float())
        self.updates = int(updates)

    def state_dict(self) -> dict[str, Any]:
        """The update count and settings, saved as the checkpoint's ``ema`` entry (the averaged
        weights are a weight set of their own: :meth:`state_dict_for`, restored by :meth:`load`)."""
        return {"updates": self.updates, "decay": self.decay, "warmup": self.warmup}
