"""A small CNN with BatchNorm for 8×8 grey digits.

``BNNet`` maps ``(B, 1, 8, 8)`` (or flat ``(B, 64)``) float32 images to ``(B, num_classes)``
logits: three 3×3 conv–BatchNorm–ReLU layers (two max-pools: 8→4→2), dropout, a linear
head. Its BatchNorm running statistics are buffers, so they are part of every weight set
pimm saves (raw and EMA) and of an exact resume.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]


class BNNet(nn.Module):
    """Args: num_classes; width: channels of the first two convs (the third has 2×);
    dropout: before the head."""

    def __init__(self, num_classes: int = 10, width: int = 32, dropout: float = 0.1):
        super().__init__()
        self.features = nn.Sequential(*_conv(1, width), *_conv(width, width), nn.MaxPool2d(2),
                                      *_conv(width, 2 * width), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * width * 2 * 2, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, 1, 8, 8)`` or ``(B, 64)`` float32 -> ``(B, num_classes)`` logits."""
        return self.head(self.features(x.view(x.shape[0], 1, 8, 8)))
