"""Model registry (``model.name``) and the built-in models as targets (``model.target``).

Each builder takes the :class:`~pimm_core.config.ModelConfig` and the dataset's
input description and returns an ``nn.Module`` mapping a float32 batch
``(B, in_features)`` to logits ``(B, num_classes)``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from .config import ModelConfig
from .errors import ConfigError
from .targets import TargetSpec


class MLP(nn.Module):
    """Two hidden layers with ReLU and dropout. Input ``(B, in_features)`` float32."""

    def __init__(self, in_features: int, num_classes: int, hidden: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class SmallCNN(nn.Module):
    """Two 3×3 conv blocks then a linear head. Input ``(B, C*H*W)`` reshaped to ``in_shape``."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, hidden: int, dropout: float):
        super().__init__()
        c, h, w = in_shape
        self.in_shape = in_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(32 * (h // 2) * (w // 2), hidden),
                                  nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(x.shape[0], *self.in_shape)))


def mlp(in_features: int = 64, num_classes: int = 10, hidden: int = 128, dropout: float = 0.1) -> MLP:
    """The ``mlp`` model as a target (``model.target = "pimm_core.models:mlp"``); the
    defaults fit the bundled digits (64 features, 10 classes) and ``model.*``'s defaults."""
    return MLP(in_features, num_classes, hidden, dropout)


def cnn(in_shape: Sequence[int] = (1, 8, 8), num_classes: int = 10, hidden: int = 128, dropout: float = 0.1) -> SmallCNN:
    """The ``cnn`` model as a target (``model.target = "pimm_core.models:cnn"``); input
    ``(B, C*H*W)`` with ``(C, H, W) = in_shape`` (the digits' 1×8×8 by default)."""
    return SmallCNN(tuple(in_shape), num_classes, hidden, dropout)


Builder = Callable[[ModelConfig, int, tuple[int, ...], int], nn.Module]
MODELS: dict[str, Builder] = {
    "mlp": lambda cfg, nin, shape, ncls: mlp(nin, ncls, cfg.hidden, cfg.dropout),
    "cnn": lambda cfg, nin, shape, ncls: cnn(shape, ncls, cfg.hidden, cfg.dropout),
}


def _unknown(cfg: ModelConfig) -> ConfigError:
    return ConfigError(f"model.name = {cfg.name!r} is not a known model; use one of {sorted(MODELS)}")


def build_model(cfg: ModelConfig, in_features: int, in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build registered model ``cfg.name``.

    Raises:
        ConfigError: unknown model name.
    """
    if cfg.name not in MODELS:
        raise _unknown(cfg)
    return MODELS[cfg.name](cfg, in_features, in_shape, num_classes)


def model_spec(cfg: ModelConfig) -> TargetSpec:
    """The target that builds ``cfg``'s model: ``model.target`` with its args, or the
    built-in ``model.name`` as the same kind of target (``"pimm_core.models:mlp"`` with
    ``hidden`` and ``dropout``; the bundled digits' input and class count are its defaults).

    Raises:
        ConfigError: unknown ``model.name``.
    """
    if cfg.target is not None:
        return TargetSpec("model.target", cfg.target, dict(cfg.args or {}), "model.args")
    if cfg.name not in MODELS:
        raise _unknown(cfg)
    return TargetSpec("model.name", f"pimm_core.models:{cfg.name}", {"hidden": cfg.hidden, "dropout": cfg.dropout},
                      "model")
