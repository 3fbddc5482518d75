"""pimm: a PyTorch training engine whose runs can always be stopped, resumed and exported.

The heavy names (``Trainer``...) import torch, so they are loaded lazily: importing
``pimm_core`` itself (as the scripting commands do) stays torch-free.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Trainer", "TrainState", "Config", "TrainConfig", "load_config", "StopRequest", "load_weights", "export_weights"]


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "TrainState"):
        from . import trainer

        return getattr(trainer, name)
    if name == "load_weights":
        from .checkpoint.weights.strict_load import load_weights

        return load_weights
    if name == "export_weights":
        from .checkpoint.export.model_dir import export_weights

        return export_weights
    if name == "StopRequest":
        from .process.stop import StopRequest

        return StopRequest
    if name in ("Config", "TrainConfig", "load_config"):
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module 'pimm_core' has no attribute {name!r}")
