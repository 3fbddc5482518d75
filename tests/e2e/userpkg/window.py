"""Right-padded token rows for the per-sample window tests: items are Hugging Face style mappings
``{"input_ids", "attention_mask"}`` whose real lengths differ, so micro-batches hold different
numbers of counted tokens; and a tiny language model over them."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

VOCAB, LENGTH = 13, 8


class Padded(Dataset):
    """``n`` rows of ``LENGTH`` tokens; row ``i`` has ``2 + (i * 5) % (LENGTH - 1)`` real tokens, the
    rest padding (token 0, ``attention_mask`` 0)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        self.mask = torch.zeros(n, LENGTH, dtype=torch.long)
        for i in range(n):
            self.mask[i, :2 + (i * 5) % (LENGTH - 1)] = 1
        self.ids[self.mask == 0] = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index]}


def padded(train: int = 14, val: int = 4):
    return Padded(train, 0), Padded(val, 1)


def tiny_lm(width: int = 8) -> nn.Module:
    """``(B, T)`` int64 tokens -> logits ``(B, T, VOCAB)``."""
    return nn.Sequential(nn.Embedding(VOCAB, width), nn.Tanh(), nn.Linear(width, VOCAB))
