"""The optimizer and the LR schedule a config asks for.

Optimizer (:func:`build_optimizer`), first match wins:

- ``[optimizer] name``: any ``torch.optim`` optimizer class, case-insensitive
  (``"AdamW"``, ``"sgd"``, ``"RMSprop"``...), built as
  ``cls(param_groups, lr=train.lr, **optimizer.args)``.
- ``[optimizer] target``: ``factory(param_groups, lr=train.lr, **optimizer.args)``,
  returning a ``torch.optim.Optimizer``.
- else the older ``train.optimizer`` (``adamw``/``sgd`` with ``train.momentum``), with one
  parameter group in which every parameter decays, as pimm always did.

Parameter groups (:func:`param_groups`) for ``[optimizer]``: the trainable parameters
(``requires_grad``), each once even when tied, in two groups: weight decay
``train.weight_decay`` for weights, and 0 for *biases and normalization weights*: a
parameter named ``...bias``, any parameter with fewer than 2 dimensions, and every
parameter of a normalization layer (BatchNorm, LayerNorm, GroupNorm, InstanceNorm,
RMSNorm, LocalResponseNorm). Decaying those pulls activations' scales and offsets toward
0 and mostly hurts (the GPT-2/timm convention). ``optimizer.decay_bias_and_norm = true``
makes one group where everything decays. A ``torch.optim`` class without a
``weight_decay`` argument gets one group without it; a target always gets the groups.

LR schedule (:func:`build_scheduler`), stepped once per optimizer step:

- ``[scheduler] name``: ``train.warmup_steps`` of linear warmup from ``train.lr / W`` to
  ``train.lr``, then a kind of :class:`~pimm_core.train.schedule.WarmupSchedule` with its options
  in ``scheduler.args`` (checked like a target's args).
- ``[scheduler] target``: ``factory(optimizer, **scheduler.args)``, plus
  ``total_steps=`` (the run's last optimizer step) and ``warmup_steps=`` when its
  signature takes them, returning an object with ``step()``, ``state_dict()`` and
  ``load_state_dict()`` (any ``torch.optim.lr_scheduler`` qualifies); the schedule is
  then all its own (pimm applies no warmup and cannot move its horizon on a resume).
- else the older ``train.scheduler`` (cosine/constant) as
  :class:`~pimm_core.train.schedule.WarmupCosine`.

Every built-in schedule is a pure function of the step and its saved state, so a
``state_dict`` / ``load_state_dict`` round trip gives the same LRs afterwards.
``plateau`` also takes the selection metric at each evaluation (:func:`observe_metric`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .config import Config
from .errors import ConfigError
from .targets import TargetSpec, accepts, check_args, load
from .train.schedule import KIND_OPTIONS, WarmupCosine, WarmupSchedule

#: Modules whose parameters never decay in the default parameter groups.
NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm,
)


def param_groups(model: nn.Module, weight_decay: float, decay_bias_and_norm: bool = False) -> list[dict[str, Any]]:
    """The trainable parameters of ``model`` in optimizer parameter groups (see module docstring).

    Returns:
        ``[{"params": [...], "weight_decay": weight_decay}, {"params": [...], "weight_decay": 0.0}]``
        in ``named_modules`` order, empty groups left out.
    """
    decay, no_decay, seen = [], [], set()
    for _, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            plain = decay_bias_and_norm or not (name.endswith("bias") or p.dim() < 2 or isinstance(module, NORM_LAYERS))
            (decay if plain else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` optimizer class called ``name`` (case-insensitive).

    Raises:
        ConfigError: no such class (with a near-miss suggestion).
    """
    classes = {n.lower(): c for n, c in vars(torch.optim).items()
               if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    if name.lower() in classes:
        return classes[name.lower()]
    import difflib

    names = sorted(c.__name__ for c in classes.values())
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(f"optimizer.name = {name!r} is not a torch.optim optimizer; {hint}use one of {names}")


def optimizer_factory(cfg: Config, config_path: str | Path | None = None) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """Resolve and check the config's optimizer without building it.

    Returns:
        ``model -> optimizer`` for the unwrapped model (not the DDP wrapper).

    Raises:
        ConfigError: unknown class or target, wrong ``optimizer.args``, a target that
            takes no ``lr``.
        Exception: anything a user module raises while imported, unchanged.
    """
    t, o = cfg.train, cfg.optimizer
    if o.name is None and o.target is None:
        if t.optimizer == "sgd":
            return lambda model: torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum,
                                                 weight_decay=t.weight_decay)
        return lambda model: torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    args = dict(o.args or {})
    if o.name is not None:
        spec = TargetSpec("optimizer.name", o.name, args, "optimizer.args")
        fn: Any = optimizer_class(o.name)
        check_args(spec, fn, provided=("lr",), positional=1)
    else:
        spec = TargetSpec("optimizer.target", o.target, args, "optimizer.args")
        fn = load(spec, config_path, provided=("lr",), positional=1)
        if not accepts(fn, "lr"):
            raise ConfigError(f"{spec.label()}: takes no 'lr'; pimm passes train.lr as lr=")
    split = o.name is None or accepts(fn, "weight_decay")  # e.g. Rprop, LBFGS take none: nothing to split

    def build(model: nn.Module) -> torch.optim.Optimizer:
        groups = param_groups(model, t.weight_decay, bool(o.decay_bias_and_norm))
        if not split:
            groups = [{"params": [p for g in groups for p in g["params"]]}]
        opt = fn(groups, lr=t.lr, **args)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"{spec.label()}: returned {type(opt).__name__}, not a torch.optim.Optimizer")
        return opt

    return build


def build_optimizer(cfg: Config, model: nn.Module, config_path: str | Path | None = None) -> torch.optim.Optimizer:
    """The optimizer for ``model`` (unwrapped), as the module docstring says.

    Raises:
        ConfigError: as :func:`optimizer_factory`, or a target that returns no optimizer.
        Exception: anything a user target raises, unchanged.
    """
    return optimizer_factory(cfg, config_path)(model)


def scheduler_factory(cfg: Config, config_path: str | Path | None = None) -> Callable[[torch.optim.Optimizer, int], Any]:
    """Resolve and check the config's LR schedule without building it.

    Returns:
        ``(optimizer, total_steps) -> scheduler``; ``total_steps`` is the optimizer step at
        which the run ends (the horizon).

    Raises:
        ConfigError: wrong ``scheduler.args`` (names or values); a target that cannot take
            the warmup asked for.
        Exception: anything a user module raises while imported, unchanged.
    """
    t, s = cfg.train, cfg.scheduler
    min_ratio = t.min_lr / t.lr if t.lr else 0.0
    if s.name is None and s.target is None:
        return lambda opt, total: WarmupCosine(opt, warmup=t.warmup_steps, total=total, min_ratio=min_ratio,
                                               kind=t.scheduler)
    args = dict(s.args or {})
    if s.name is not None:
        spec = TargetSpec("scheduler.name", s.name, args, "scheduler.args")
        check_args(spec, KIND_OPTIONS[s.name])
        options = KIND_OPTIONS[s.name](**args)
        return lambda opt, total: WarmupSchedule(opt, warmup=t.warmup_steps, total=total, min_ratio=min_ratio,
                                                 kind=s.name, options=options, mode=cfg.eval.mode)
    spec = TargetSpec("scheduler.target", s.target, args, "scheduler.args")
    fn = load(spec, config_path, positional=1, provided=("total_steps", "warmup_steps"))
    takes_total = accepts(fn, "total_steps")
    if not accepts(fn, "warmup_steps") and t.warmup_steps:
        raise ConfigError(f"{spec.label()}: takes no warmup_steps; set train.warmup_steps = 0 or give it a "
                          "warmup_steps parameter")
    takes_warmup = accepts(fn, "warmup_steps")

    def build(opt: torch.optim.Optimizer, total: int) -> Any:
        extra = {**({"total_steps": total} if takes_total else {}),
                 **({"warmup_steps": t.warmup_steps} if takes_warmup else {})}
        sch = fn(opt, **extra, **args)
        if not all(callable(getattr(sch, m, None)) for m in ("step", "state_dict", "load_state_dict")):
            raise ConfigError(f"{spec.label()}: returned {type(sch).__name__}, not a scheduler "
                              "(step, state_dict, load_state_dict)")
        return sch

    return build


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int,
                    config_path: str | Path | None = None) -> Any:
    """The LR schedule of ``optimizer`` over ``total_steps`` optimizer steps, as the module
    docstring says.

    Raises:
        ConfigError: as :func:`scheduler_factory`, or a target that returns no scheduler.
        Exception: anything a user target raises, unchanged.
    """
    return scheduler_factory(cfg, config_path)(optimizer, total_steps)


def observe_metric(scheduler: Any, value: float) -> bool:
    """Give the schedule an evaluation's selection metric (``eval.metric``).

    Returns:
        True when the schedule lowered the LR (reduce-on-plateau); other schedules
        ignore the metric and return False.
    """
    observe = getattr(scheduler, "observe", None)
    return bool(observe(value)) if callable(observe) else False
