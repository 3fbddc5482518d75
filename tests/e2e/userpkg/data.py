"""The user data: a slice of the bundled digits, the training split randomly shifted and noised
per sample with :class:`pimm_core.data.rng.EpochSeeded` (independent of worker count)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from pimm_core.data.rng import EpochSeeded


class Digits(EpochSeeded, Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, *, augment: bool, seed: int = 0):
        super().__init__(seed)
        self.x, self.y, self.augment = x, y, augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        x = self.x[index]
        if self.augment:
            g = self.generator(index)
            shift = int(torch.randint(-1, 2, (), generator=g))
            x = torch.roll(x.view(8, 8), shift, 1).flatten() + 0.05 * torch.randn(64, generator=g)
        return x, self.y[index]


def digits_aug(train: int = 192, val: int = 61, seed: int = 0):
    """``(train, val)`` datasets of ``train`` and ``val`` digits."""
    from pimm_core.data.loaders import digits_arrays

    data, target = digits_arrays()
    x = torch.tensor(data, dtype=torch.float32) / 16.0
    y = torch.tensor(target, dtype=torch.int64)
    return (Digits(x[:train], y[:train], augment=True, seed=seed),
            Digits(x[train:train + val], y[train:train + val], augment=False))


class Indexed(EpochSeeded, Dataset):
    """Digits whose items are ``(x, y, index)``: ``userpkg.objective:seen_ce`` records the indices trained.
    With ``augment``, the training split is shifted and noised per sample from ``(seed, epoch, index)``
    (:class:`pimm_core.data.rng.EpochSeeded`: the same at any worker count or world size)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, *, augment: bool = False, seed: int = 0):
        super().__init__(seed)
        self.x, self.y, self.augment = x, y, augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        x = self.x[index]
        if self.augment:
            g = self.generator(index)
            shift = int(torch.randint(-1, 2, (), generator=g))
            x = torch.roll(x.view(8, 8), shift, 1).flatten() + 0.05 * torch.randn(64, generator=g)
        return x, self.y[index], index


def indexed(train: int = 100, val: int = 20, augment: bool = False, seed: int = 0):
    """``(train, val)`` datasets of the first ``train`` digits and the ``val`` after them, with indices
    (the training split randomly augmented with ``augment``)."""
    from pimm_core.data.loaders import digits_arrays

    data, target = digits_arrays()
    x = torch.tensor(data, dtype=torch.float32) / 16.0
    y = torch.tensor(target, dtype=torch.int64)
    return (Indexed(x[:train], y[:train], augment=augment, seed=seed),
            Indexed(x[train:train + val], y[train:train + val]))
