"""Data (layer **train**, except :mod:`.global_order`): datasets, loaders, their workers and randomness.

- :mod:`.loaders`: the built-in datasets (``data.name``), :class:`Datasets`, the samplers and
  DataLoaders a rank trains and evaluates with (torch).
- :mod:`.rng`: random augmentation that resumes exactly (one RNG per sample from seed, epoch, index).
- :mod:`.workers`: where DataLoader workers come from (a clean process, never a fork of a busy rank).
- :mod:`.global_order`: the world-size-free batching of ``data.order = "global"``; torch-free at import
  and in the **run** layer, since the resume policy (:mod:`pimm_core.run.topology`) reads it.

May import: ``config``, ``targets``, ``process.*``, ``errors`` (never ``train``, ``checkpoint``, ``watch``).
This ``__init__`` imports nothing at import time: importing :mod:`.global_order` stays torch-free.
The loaders' names are re-exported lazily, so ``from pimm_core.data import Datasets, digits`` and the
config target ``"pimm_core.data:digits"`` (the spelling of ``data.name``, also in written runs'
``config.toml``) work as they did when this was one module.
"""

from __future__ import annotations

from typing import Any

#: The public names of :mod:`.loaders`, importable from ``pimm_core.data``.
LOADERS = ("DATASETS", "DataTimeoutError", "DatasetSplits", "Datasets", "ShardSampler", "TrainLoader", "as_datasets", "build_datasets",
           "data_spec", "digits", "digits_arrays", "eval_loader", "ignore_stop_signals", "init_worker", "is_stateful",
           "is_stream", "stop_workers", "stream_shard", "train_loader")


def __getattr__(name: str) -> Any:
    if name in LOADERS:
        from . import loaders

        return getattr(loaders, name)
    raise AttributeError(f"module 'pimm_core.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *LOADERS])
