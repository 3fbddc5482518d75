"""The optimizer a resume loads into must be the one the checkpoint was saved from; its settings are this config's.

Structure: a checkpoint's optimizer state belongs to an optimizer class and to parameter groups
(which parameters, by name, in which group). ``torch.optim``'s and DCP's loads map state and
each group's hyperparameters by position, so another class or another grouping either fails
after the first step (``KeyError: 'betas'``, a ``zip()`` length error) or silently gives one
group's settings to another. :func:`structure_problem` names the difference before anything
is loaded; a strict resume refuses it (the ``optimizer`` row of the resume policy), a resume
with ``resume_strict_state = false`` starts the optimizer fresh with a warning.

Settings: a load restores each group's saved hyperparameters. Every checkpoint also records
the hyperparameters the config built each group with (:func:`built_hyperparameters`); where
this config builds another value (``weight_decay``, ``betas``, ``eps``, ``momentum``...) the new
value is applied after the load (:func:`apply_built_hyperparameters`) and said in the log, so a
change the config diff reports takes effect. A value a callback changed during the run, with the
config unchanged, stays as saved. ``lr`` is the LR schedule's (``train.lr``: :mod:`pimm_core.train.resume`).
"""

from __future__ import annotations

from typing import Any

import torch

#: Group keys that are not the config's to set on a resume: the parameters, and the LR the schedule drives.
NOT_SETTINGS = ("params", "lr", "initial_lr")


def built_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's hyperparameters as the optimizer holds them now (right after it was
    built from the config): ``[{key: value}]`` without ``params``; tensors copied."""
    return [{k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def _groups(skeleton: Any) -> list[list[str]] | None:
    """The parameter names of each group of an FQN-keyed optimizer state dict (its skeleton), or None."""
    groups = skeleton.get("param_groups") if isinstance(skeleton, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        return None
    return [[str(p) for p in g["params"]] for g in groups]


def _describe(cls: str | None, groups: list[list[str]]) -> str:
    sizes = ", ".join(str(len(g)) for g in groups)
    return (f"{cls.rsplit('.', 1)[-1] + ' with ' if cls else ''}{len(groups)} parameter group"
            f"{'s' if len(groups) != 1 else ''} ({sizes} parameters)")


def structure_problem(saved: Any, saved_class: str | None, now: Any, now_class: str,
                      frozen: frozenset[str] | set[str] = frozenset()) -> str | None:
    """How the optimizer now differs from the one a checkpoint's state was saved from, or None.

    Args:
        saved, now: FQN-keyed optimizer state dicts (their skeletons: ``param_groups`` with
            parameter names), as DCP's ``get_optimizer_state_dict`` gives them.
        saved_class: ``module.Class`` recorded with the checkpoint (None: an older checkpoint,
            whose class is not compared).
        frozen: names of parameters frozen now (``requires_grad`` False): an optimizer built
            without them is not another structure (the state check names their state instead).
    """
    a, b = _groups(saved), _groups(now)
    if a is None or b is None:
        return None
    parts = []
    if saved_class is not None and saved_class != now_class:
        parts.append(f"the class ({saved_class} -> {now_class})")
    if len(a) != len(b):
        parts.append(f"the parameter groups ({len(a)} -> {len(b)})")
    else:
        for i, (x, y) in enumerate(zip(a, b)):
            if set(x) - frozen != set(y) - frozen:
                moved = sorted((set(x) ^ set(y)) - frozen)
                parts.append(f"the parameters of group {i} ({len(x)} -> {len(y)}; e.g. {moved[0]} "
                             f"{'left it' if moved[0] in x else 'joined it'})")
                break
    if not parts:
        return None
    return (f"the optimizer differs from the one the checkpoint was saved from: {' and '.join(parts)}; saved "
            f"{_describe(saved_class, a)}, now {_describe(now_class, b)}")


def structure_fix(ckpt: Any) -> str:
    """The advice after :func:`structure_problem` (strict resume)."""
    return ("resume with the optimizer settings the run was saved with (optimizer.*, train.optimizer, "
            "optimizer.decay_bias_and_norm), or set resume_strict_state = false to start the optimizer fresh "
            f"(its moments are lost), or warm-start a new run with --train.weight {ckpt}")


def named_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"param_groups": [{"params": [name, ...]}, ...]}`` of ``optimizer`` over ``model``'s
    parameters (the FQN-keyed layout :func:`structure_problem` compares), without making state."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {"param_groups": [{"params": [names.get(id(p), "?") for p in g["params"]]} for g in optimizer.param_groups]}


def planned_change(meta: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """:func:`structure_problem` of a checkpoint's trainer state ``meta`` against ``optimizer`` built
    over ``model`` (a dry run's view of the optimizer row), or None."""
    if not isinstance(meta, dict):
        return None
    cls = type(optimizer)
    return structure_problem(meta.get("optim"), meta.get("optimizer_class"), named_groups(model, optimizer),
                             f"{cls.__module__}.{cls.__qualname__}",
                             {n for n, p in model.named_parameters() if not p.requires_grad})


def apply_built_hyperparameters(optimizer: torch.optim.Optimizer, saved_built: Any,
                                now_built: list[dict[str, Any]], step: int) -> list[str]:
    """After a load: give each group the hyperparameters this config builds where they differ from
    the ones the checkpoint's config built (see the module docstring); one line each.

    ``saved_built`` None (a checkpoint from before they were recorded): the restored value is
    compared with the one this config builds instead.
    """
    notes: list[str] = []
    if isinstance(saved_built, list) and len(saved_built) != len(optimizer.param_groups):
        return notes  # another structure, whose state was not loaded (resume_strict_state=false): all this config's
    for i, (group, now) in enumerate(zip(optimizer.param_groups, now_built)):
        then = saved_built[i] if isinstance(saved_built, list) and i < len(saved_built) \
            and isinstance(saved_built[i], dict) else None
        for key, value in now.items():
            if key in NOT_SETTINGS or key not in group:
                continue
            before = then.get(key, group[key]) if then is not None else group[key]
            if _same(before, value):
                continue
            restored = group[key]
            group[key] = value.clone() if isinstance(value, torch.Tensor) else value
            notes.append(f"optimizer param_groups[{i}].{key} changed {_show(restored)} -> {_show(value)} on resume "
                         f"(this config's value): applied from step {step}")
    return notes


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _show(v: Any) -> str:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_show(x) for x in v) + ")"
    return repr(v)
