"""Every save is one a resume can load: the trainer state's parts are checked before anything is written.

A checkpoint is read back with ``torch.load(weights_only=True)``. State that loader refuses (a
user class in a callback's ``state_dict()``, a module's extra state holding an open file) would
be saved, verified and never loaded; numpy values and ``io.BytesIO`` are encoded instead
(:mod:`pimm_core.checkpoint.tensors.safe_state`). :func:`check_loadable` walks the non-tensor state of a
save (cheap: no tensor is copied) and refuses the save, naming the value, its owner and the fix.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..process import dist
from ..checkpoint.tensors.safe_state import UnloadableStateError, extra_state_problem, state_problem
from ..checkpoint.tensors.state import unwrap
from ..process.dist import DistInfo

#: Who owns each part of a checkpoint's trainer state, for a refusal's message.
OWNERS = {"trainer": "the trainer state", "scheduler": "the LR scheduler ([scheduler])",
          "scaler": "the AMP GradScaler", "ema": "the EMA", "objective": "the objective"}


def optimizer_class_name(optimizer: Any) -> str:
    """``module.Class`` of ``optimizer`` (recorded with every checkpoint: a resume refuses another class)."""
    t = type(optimizer)
    return f"{t.__module__}.{t.__qualname__}"


def stateful_objective(objective: Any) -> Any:
    """The object whose ``state_dict()``/``load_state_dict()`` is the objective's state: the
    objective itself, or the callable it wraps (a user's class instance as ``objective``); None."""
    for obj in (objective, getattr(objective, "step", None)):
        if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            return obj
    return None


def loadable_problem(meta: dict[str, Any], model: nn.Module) -> str | None:
    """Why a save of ``meta`` (the trainer state's parts) and ``model`` could not be loaded by a resume,
    in one line naming the value, its owner and the fix; None when it could."""
    for name, state in meta.items():
        if name == "callbacks":
            problem = next((p for key, st in (state or {}).items()
                            if (p := state_problem(st, f"callback {key}")) is not None), None)
        else:
            problem = state_problem(state, OWNERS.get(name, f"the trainer state's {name!r}"))
        if problem is not None:
            return problem
    return extra_state_problem(unwrap(model))


def check_loadable(meta: dict[str, Any], model: nn.Module, info: DistInfo, manifest: dict[str, Any]) -> None:
    """Refuse, on every rank and before anything is written, a save a resume could not load; when it
    can, ``manifest`` (the checkpoint's ``manifest.json`` fields) records the loader it was checked for
    (``state_checked``).

    Raises:
        UnloadableStateError: (exit code 2) on every rank, when any rank found such state.
    """
    problem = loadable_problem(meta, model)
    if info.distributed:
        problem = next((p for p in dist.all_gather_object(problem) if p), None)
    if problem is not None:
        raise UnloadableStateError(f"cannot save a checkpoint a resume could load (torch.load(weights_only=True) "
                                   f"would refuse it; nothing was saved): {problem}")
    manifest["state_checked"] = "torch.load(weights_only=True)"
