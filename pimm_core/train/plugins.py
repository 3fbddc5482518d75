"""The checks of a config's user code that run before any rank starts (and in ``--dry-run``).

:func:`check_targets` resolves every target the config names (model, data, objective,
optimizer, scheduler, ``[[callbacks]]``) and checks each ``args`` table against its target's signature,
and the built-in scheduler kinds' options against theirs, without building anything: no
model, dataset, optimizer or schedule is created. Importing a user module runs its
top-level code, as any import does.
"""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from ..data.loaders import data_spec
from ..models import model_spec
from ..objectives import get_objective
from ..optim import optimizer_factory, scheduler_factory
from ..targets import load
from . import callbacks


def check_targets(cfg: Config, config_path: str | Path | None = None) -> None:
    """Raise the first wrong target or argument of ``cfg``, as the launch would.

    Args:
        cfg: a loaded config.
        config_path: the config file (its directory is searched for user code).

    Raises:
        ConfigError: a target's module or attribute is missing, an ``args`` key is not a
            parameter (near-miss suggested) or a required one is missing, a scheduler
            option's value is out of range, an unknown ``model.name``/``data.name``. One
            line naming the key, exit code 2.
        Exception: whatever a user module raises while it is imported, unchanged.
    """
    load(model_spec(cfg.model), config_path)
    load(data_spec(cfg.data), config_path)
    get_objective(cfg.objective, config_path)
    optimizer_factory(cfg, config_path)
    scheduler_factory(cfg, config_path)
    callbacks.check(cfg, config_path)
