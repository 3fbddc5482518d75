"""Model registry (``model.name``).

Each builder takes the :class:`~pimm_core.config.ModelConfig` and the dataset's
input description and returns an ``nn.Module`` mapping a float32 batch
``(B, in_features)`` to logits ``(B, num_classes)``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .config import ModelConfig
from .errors import ConfigError


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


Builder = Callable[[ModelConfig, int, tuple[int, ...], int], nn.Module]
MODELS: dict[str, Builder] = {
    "mlp": lambda cfg, nin, shape, ncls: MLP(nin, ncls, cfg.hidden, cfg.dropout),
    "cnn": lambda cfg, nin, shape, ncls: SmallCNN(shape, ncls, cfg.hidden, cfg.dropout),
}


def build_model(cfg: ModelConfig, in_features: int, in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build registered model ``cfg.name``.

    Raises:
        ConfigError: unknown model name.
    """
    if cfg.name not in MODELS:
        raise ConfigError(f"model.name = {cfg.name!r} is not a known model; use one of {sorted(MODELS)}")
    return MODELS[cfg.name](cfg, in_features, in_shape, num_classes)
