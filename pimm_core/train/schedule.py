"""The learning-rate schedule: linear warmup, then cosine decay (or constant), with a
horizon that follows the run; :class:`WarmupSchedule` adds the other kinds of
``[scheduler]`` (linear, step, multistep, exponential, one-cycle, reduce-on-plateau).

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

import bisect
import math
from typing import Any

import torch

from ..errors import ConfigError


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

    def logged_factor(self, step: int) -> float:
        """The factor of the LR that optimizer step ``step`` (1-based, as ``metrics.jsonl``
        numbers it) trained with: ``factor(step - 1)``, as this schedule's state has it."""
        return self.factor(step - 1)

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


# --------------------------------------------------------------------------- more kinds
# Each kind's options are the keyword parameters of its function below: the config's
# ``[scheduler.args]`` are checked against that signature (pimm_core.targets.check_args), and
# the function checks the values. Steps count optimizer steps *after* warmup (as PyTorch's
# SequentialLR starts the second schedule at the milestone), so every kind starts at the
# base LR when the warmup ends.

def _bad(name: str, value: Any, must: str) -> ConfigError:
    return ConfigError(f"scheduler.args.{name} = {value!r}: must be {must}")


def _positive_int(name: str, v: Any, zero_ok: bool = False) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < (0 if zero_ok else 1):
        raise _bad(name, v, "an integer >= 0" if zero_ok else "an integer >= 1")
    return v


def _fraction(name: str, v: Any, *, one_ok: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < 1 or (one_ok and v == 1)):
        raise _bad(name, v, "a number in (0, 1]" if one_ok else "a number in (0, 1)")
    return float(v)


def _positive(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise _bad(name, v, "a number > 0")
    return float(v)


def _no_options() -> dict[str, Any]:
    return {}


def _step_options(step_size: int, gamma: float = 0.1) -> dict[str, Any]:
    """LR times ``gamma`` every ``step_size`` optimizer steps."""
    return {"step_size": _positive_int("step_size", step_size), "gamma": _fraction("gamma", gamma)}


def _multistep_options(milestones: list[int], gamma: float = 0.1) -> dict[str, Any]:
    """LR times ``gamma`` at each milestone (optimizer steps after warmup, ascending)."""
    ok = isinstance(milestones, list) and all(isinstance(m, int) and not isinstance(m, bool) and m >= 0
                                              for m in milestones)
    if not ok or milestones != sorted(set(milestones)):
        raise _bad("milestones", milestones, "a list of ascending integers >= 0")
    return {"milestones": list(milestones), "gamma": _fraction("gamma", gamma)}


def _exponential_options(gamma: float) -> dict[str, Any]:
    """LR times ``gamma`` every optimizer step."""
    return {"gamma": _fraction("gamma", gamma)}


def _onecycle_options(pct_start: float = 0.3, div_factor: float = 25.0, final_div_factor: float = 1e4) -> dict[str, Any]:
    """PyTorch OneCycleLR's LR curve (cosine annealing; momentum is not cycled)."""
    return {"pct_start": _fraction("pct_start", pct_start, one_ok=False), "div_factor": _positive("div_factor", div_factor),
            "final_div_factor": _positive("final_div_factor", final_div_factor)}


def _plateau_options(factor: float = 0.1, patience: int = 10, threshold: float = 1e-4, threshold_mode: str = "rel",
                     cooldown: int = 0) -> dict[str, Any]:
    """PyTorch ReduceLROnPlateau's rule, observed at each evaluation."""
    if threshold_mode not in ("rel", "abs"):
        raise _bad("threshold_mode", threshold_mode, "'rel' or 'abs'")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold < 0:
        raise _bad("threshold", threshold, "a number >= 0")
    return {"factor": _fraction("factor", factor, one_ok=False), "patience": _positive_int("patience", patience, True),
            "threshold": float(threshold), "threshold_mode": threshold_mode,
            "cooldown": _positive_int("cooldown", cooldown, True)}


#: ``scheduler.name`` -> the function whose keyword parameters are its options.
KIND_OPTIONS = {"constant": _no_options, "cosine": _no_options, "linear": _no_options, "step": _step_options,
                "multistep": _multistep_options, "exponential": _exponential_options,
                "onecycle": _onecycle_options, "plateau": _plateau_options}


def _anneal(start: float, end: float, t: float) -> float:
    return end + (start - end) * 0.5 * (1 + math.cos(math.pi * t))


class WarmupSchedule(WarmupCosine):
    """Linear warmup, then one of :data:`KIND_OPTIONS`; every kind resumes exactly.

    Factors after warmup (``s`` steps after warmup, ``p`` the horizon progress of
    :meth:`WarmupCosine.progress`, ``m = min_ratio``):

    - ``constant``/``cosine``: :class:`WarmupCosine`'s.
    - ``linear``: ``m + (1 - m) * (1 - p)`` (to ``train.min_lr`` at the last step).
    - ``step``: ``gamma ** (s // step_size)``; ``multistep``: ``gamma ** (milestones <= s)``;
      ``exponential``: ``gamma ** s``; these three never go below ``m``.
    - ``onecycle`` (no warmup): from ``1 / div_factor`` up to 1 over ``pct_start`` of the
      horizon, then down to ``1 / (div_factor * final_div_factor)``, both cosine.
    - ``plateau``: a scale, 1 at first, times ``factor`` when the selection metric has not
      improved for more than ``patience`` evaluations (:meth:`observe`), never below ``m``;
      multiplied into the warmup ramp too.

    The horizon-based kinds (cosine, linear, onecycle) follow :meth:`WarmupCosine.retarget`.

    Args:
        optimizer, warmup, total, min_ratio: as :class:`WarmupCosine`.
        kind: a key of :data:`KIND_OPTIONS`.
        options: the kind's options as its function returns them (validated).
        mode: ``"min"`` or ``"max"``: the selection metric's direction (plateau only).

    ``state_dict()`` holds the plateau's progress (scale, best, bad evaluations,
    cooldown) next to :class:`WarmupCosine`'s fields. ``load_state_dict`` restores them;
    the options stay those this schedule was built with (the config's).
    """

    _progress_keys = ("scale", "best", "num_bad", "cooldown_left", "cut_step", "scale_before_cut")

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup: int, total: int, min_ratio: float, kind: str,
                 options: dict[str, Any] | None = None, mode: str = "min"):
        if kind not in KIND_OPTIONS:
            raise ValueError(f"unknown schedule kind {kind!r}; use one of {sorted(KIND_OPTIONS)}")
        self.options = dict(options) if options is not None else KIND_OPTIONS[kind]()
        self.mode = mode
        self.scale, self.best = 1.0, (math.inf if mode == "min" else -math.inf)
        self.num_bad, self.cooldown_left = 0, 0
        self.cut_step, self.scale_before_cut = None, 1.0  # the last plateau cut: at which step, from what scale
        super().__init__(optimizer, warmup=warmup, total=total, min_ratio=min_ratio, kind=kind)

    def factor(self, step: int) -> float:
        kind, o, m = self.kind, self.options, self.min_ratio
        if kind in ("constant", "cosine"):
            return super().factor(step)
        if kind == "plateau":
            return (step + 1) / self.warmup * self.scale if step < self.warmup else self.scale
        if self.warmup and step < self.warmup:
            return (step + 1) / self.warmup
        s = step - self.warmup
        if kind == "linear":
            return m + (1 - m) * (1 - self.progress(step))
        if kind == "step":
            return max(m, o["gamma"] ** (s // o["step_size"]))
        if kind == "multistep":
            return max(m, o["gamma"] ** bisect.bisect_right(o["milestones"], s))
        if kind == "exponential":
            return max(m, o["gamma"] ** s)
        # onecycle
        p, pct = self.progress(step), o["pct_start"]
        low = 1 / o["div_factor"]
        if p <= pct:
            return _anneal(low, 1.0, p / pct)
        return _anneal(1.0, low / o["final_div_factor"], (p - pct) / (1 - pct))

    def _better(self, value: float) -> bool:
        o, best = self.options, self.best
        if o["threshold_mode"] == "rel":
            edge = best * (1 - o["threshold"]) if self.mode == "min" else best * (1 + o["threshold"])
        else:
            edge = best - o["threshold"] if self.mode == "min" else best + o["threshold"]
        return value < edge if self.mode == "min" else value > edge

    def observe(self, value: float) -> bool:
        """Feed one evaluation's selection metric (plateau only; other kinds ignore it).

        Returns:
            True when this evaluation lowered the LR (applied to the optimizer at once).
            A non-finite value counts as no improvement.
        """
        if self.kind != "plateau":
            return False
        o = self.options
        if math.isfinite(value) and self._better(value):
            self.best, self.num_bad = float(value), 0
        else:
            self.num_bad += 1
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.num_bad = 0
        reduced = False
        if self.num_bad > o["patience"]:
            new = max(self.scale * o["factor"], self.min_ratio)
            reduced = new < self.scale
            if reduced:
                self.cut_step, self.scale_before_cut = self.last_epoch, self.scale
            self.scale, self.cooldown_left, self.num_bad = new, o["cooldown"], 0
        self.set_step(self.last_epoch)
        return reduced

    def logged_factor(self, step: int) -> float:
        """As :meth:`WarmupCosine.logged_factor`; a step at or before the last plateau cut (an
        evaluation after that step lowered the LR) trained with the scale from before the cut."""
        if self.kind == "plateau" and self.cut_step is not None and step <= self.cut_step:
            scale = self.scale
            try:
                self.scale = self.scale_before_cut
                return self.factor(step - 1)
            finally:
                self.scale = scale
        return self.factor(step - 1)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for k in self._progress_keys:
            if k in state_dict:
                setattr(self, k, state_dict[k])
