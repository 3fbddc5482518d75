"""What a Trainer trains, from its config or from the caller: model, data and objective.

Each part comes from the Python caller when given (``Trainer(cfg, model=..., datasets=...,
objective=...)``), else from the config's target (:mod:`pimm_core.targets`): the built-in
``model.name``/``data.name`` are the targets ``pimm_core.models:<name>`` and
``pimm_core.data:<name>`` (:func:`~pimm_core.models.model_spec`,
:func:`~pimm_core.data.data_spec`), so the bundled digits run and a user's own code take
the same path. An exception inside user code propagates unchanged (the user's traceback);
a wrong target or argument is a :class:`~pimm_core.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable

from torch import nn

from ..checkpoint.tensors.safe_state import install_extra_state_codec
from ..config import Config, TrainConfig
from ..data.loaders import Datasets, as_datasets, data_spec
from ..errors import ConfigError
from ..models import model_spec
from ..objectives import Objective, get_objective
from ..targets import TargetSpec, call


def build_data(cfg: Config, config_path: str | Path | None, given: Any = None) -> Datasets:
    """The train and validation datasets: ``given`` (anything :func:`~pimm_core.data.as_datasets`
    accepts) or ``data.target``/``data.name`` called with its args.

    Raises:
        ConfigError: wrong target or args, or a return value that is not two datasets.
    """
    if given is not None:
        out = as_datasets(given, TargetSpec("datasets", "Trainer(datasets=...)"))
    else:
        spec = data_spec(cfg.data)
        out = as_datasets(call(spec, config_path=config_path), spec)
    return out


def data_length(train: Any) -> int | None:
    """The train split's ``len``, recorded with every checkpoint so that a resume applies a loader
    cursor (a position in the sampler's order over that many samples) only to the data it was
    saved for; None when it has none, and for a stream (its ``__len__`` is per rank, and its
    position is its own state; its fingerprint, when it gives one, is compared)."""
    from ..data.loaders import is_stream

    if is_stream(train):
        return None
    try:
        return int(len(train))
    except TypeError:
        return None


def data_resume_policy(train: Any, is_main: bool) -> str:
    """How a mid-epoch resume continues the training split: ``"exact"`` (map-style, or a
    stream with ``state_dict``/``load_state_dict``) or ``"replay_from_boundary"`` (a stream
    without them: the interrupted epoch replays from its start; a warning on rank 0 says so)."""
    from ..data.loaders import is_stateful, is_stream

    if is_stream(train) and not is_stateful(train):
        if is_main:
            logging.getLogger("pimm").warning(
                "warning: the train split %s is an IterableDataset without state_dict/load_state_dict: a resume "
                "inside an epoch replays that epoch from its start", type(train).__name__)
        return "replay_from_boundary"
    return "exact"


def user_code_of(model: nn.Module, data: Datasets, objective: Objective) -> list[dict[str, Any]]:
    """:func:`~pimm_core.run.provenance.user_code` of the modules defining the model's class, the
    datasets' classes and the objective's step function (pimm's own are left out)."""
    from ..run.provenance import user_code

    return user_code([type(model).__module__, type(data.train).__module__, type(data.val).__module__,
                      getattr(objective.step, "__module__", "")])


def build_model(cfg: Config, config_path: str | Path | None, given: nn.Module | None = None) -> nn.Module:
    """The model: ``given``, or ``model.target``/``model.name`` called with its args.

    Raises:
        ConfigError: wrong target or args, or a target that returns no ``nn.Module``.
    """
    if given is not None:
        model = given
        label = "Trainer(model=...)"
    else:
        spec = model_spec(cfg.model)
        model = call(spec, config_path=config_path)
        label = spec.label()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{label}: returned {type(model).__name__}, not a torch.nn.Module")
    install_extra_state_codec(model)  # a module's non-tensor extra state is saved so that a resume loads it
    return model


def build_objective(cfg: Config, config_path: str | Path | None,
                    given: Objective | Callable | str | None = None) -> Objective:
    """The objective: ``given`` (an :class:`~pimm_core.objectives.Objective`, a built-in name
    or target text, or a plain ``(model, batch) -> (loss, metrics)`` function), else
    ``objective`` of the config.

    Raises:
        ConfigError: unknown name, wrong target, a function that cannot take two arguments.
    """
    if isinstance(given, Objective):
        return given
    if callable(given):
        return Objective(getattr(given, "__qualname__", "objective"), given)
    return get_objective(given if given is not None else cfg.objective, config_path)


def warm_start_model(t: TrainConfig, model: nn.Module, ema: Any, is_main: bool, remote: Any = None,
                     rank: int = 0):
    """Load ``t.weight`` into the new (unwrapped) ``model``: weights only, the report logged on
    rank 0; the EMA (if any) restarts from the loaded weights. ``remote``: the run's
    ``checkpoint`` config, whose ``remote_options`` serve a ``train.weight`` URL on the same store.

    Returns:
        The :class:`~pimm_core.checkpoint.weights.warm_start` report.

    Raises:
        CheckpointError: as :func:`pimm_core.checkpoint.weights.warm_start.warm_start` (zero match...).
    """
    from ..checkpoint.remote.source import is_store_url, options_for
    from ..checkpoint.weights.warm_start import warm_start
    from .remote_weight import node_copy

    rules = [tuple(r) for r in t.key_rules] if t.key_rules is not None else None
    quiet = logging.getLogger("pimm.quiet")
    quiet.propagate = False
    options = options_for(t.weight, remote.remote, remote.remote_options) if remote is not None else None
    shared = node_copy(t.weight, options, rank) if is_store_url(t.weight) else contextlib.nullcontext()
    with shared:  # a remote source: one download per node, for all of its ranks
        report = warm_start(model, t.weight, weight_set=t.weight_set, rules=rules, storage_options=options,
                            logger=logging.getLogger("pimm") if is_main else quiet)
    if ema is not None:
        ema.restart(model)
    return report
