"""The user model: BatchNorm (buffers in every weight set) and a head tied to an embedding."""

from __future__ import annotations

import torch
from torch import nn


class TiedBN(nn.Module):
    """``(B, 64)`` float32 -> logits ``(B, classes)``; ``head.weight`` is ``classes.weight``."""

    def __init__(self, width: int, classes: int = 10, dropout: float = 0.1):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(dropout))
        self.classes = nn.Embedding(classes, width)
        self.head = nn.Linear(width, classes, bias=False)
        self.head.weight = self.classes.weight  # tied, as a language model's output to its input embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.flatten(1)))


def tied_bn(width: int, classes: int = 10, dropout: float = 0.1) -> TiedBN:
    return TiedBN(width, classes, dropout)
