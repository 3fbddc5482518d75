"""The run configuration (layer **run**, torch-free): its schema, reading and checking it, showing it.

- :mod:`.schema`: one dataclass per TOML table (:class:`Config` and its tables), with the defaults.
- :mod:`.tables`: TOML tables onto those dataclasses (types, unknown keys, the file line of a key).
- :mod:`.checks`: the checks that span keys (ranges, targets, the objective and its metric).
- :mod:`.load`: reading a file with overrides (:func:`load_config`), writing and re-reading ``config.toml``.
- :mod:`.show`: the resolved config as TOML with changed values marked; :mod:`.help`: one line per key.

May import: ``errors``, ``fsio``, ``targets``, ``run.layout``, ``process.stop``, ``process.time_limit``
(the bottom layer and the run layer), never ``data``, ``checkpoint`` or torch. Inside it ``tables``
imports no other module of the package, ``schema`` only ``tables``, ``checks`` reads ``schema`` only for
its annotations, and only ``load`` runs the checks; no submodule imports this package back.

The names below are re-exported, so ``from pimm_core.config import Config, load_config`` (and a run's
saved config naming them) works as it did when this was one module.
"""

from .checks import OBJECTIVES, RANGES, TARGET_KEYS, validate
from .load import config_from_dict, flatten, load_config, parse_override, read_saved_config, write_config
from .schema import (SCHEDULER_KINDS, CallbackConfig, CheckpointConfig, Config, DataConfig, DistConfig, EmaConfig,
                     EvalConfig, FsdpConfig, LogConfig, MlflowConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                     RunConfig, SchedulerConfig, SchedulerKind, TrainConfig, WandbConfig)
from .tables import Where, build, toml_key

__all__ = [
    "OBJECTIVES", "RANGES", "SCHEDULER_KINDS", "TARGET_KEYS", "CallbackConfig", "CheckpointConfig", "Config",
    "DataConfig", "DistConfig", "EmaConfig", "EvalConfig", "FsdpConfig", "LogConfig", "MlflowConfig", "ModelConfig",
    "OptimizerConfig", "ParallelConfig", "RunConfig", "SchedulerConfig", "SchedulerKind", "TrainConfig", "WandbConfig", "Where",
    "build", "config_from_dict", "flatten", "load_config", "parse_override", "read_saved_config", "toml_key",
    "validate", "write_config",
]
