"""The bundled digits with random augmentation that resumes exactly.

Each training image is shifted by up to ``max_shift`` pixels in each direction (zeros
shifted in) and its contrast scaled by a factor in ``[1 - contrast, 1 + contrast]``,
both drawn from the sample's own RNG, seeded by (seed, epoch, index)
(:mod:`pimm_core.data.rng`): a sample's augmentation is the same whichever DataLoader
worker loads it, at any ``data.num_workers``, and after a resume. The validation images
are not augmented. Items are ``(image (1, 8, 8) float32, label int64, index int64)``.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

from pimm_core.data.loaders import Datasets, digits
from pimm_core.data.rng import EpochSeeded


class AugmentedDigits(EpochSeeded, torch.utils.data.Dataset):
    """Digits images ``(N, 1, 8, 8)`` with labels ``(N,)``; random shift and contrast when ``augment``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, augment: bool, seed: int = 0,
                 max_shift: int = 1, contrast: float = 0.2):
        super().__init__(seed)
        self.images, self.labels = images, labels
        self.augment, self.max_shift, self.contrast = augment, max_shift, contrast

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.images[i]
        if self.augment:
            g = self.generator(i)
            s = self.max_shift
            dy, dx = (torch.randint(-s, s + 1, (2,), generator=g) + s).tolist()
            x = F.pad(x, (s, s, s, s))[:, dy:dy + 8, dx:dx + 8]
            scale = 1 + self.contrast * (2 * torch.rand((), generator=g) - 1)
            x = (x * scale).clamp(0, 1)
        return x, self.labels[i], torch.tensor(i)


def digits_aug(val_fraction: float = 0.2, split_seed: int = 0, seed: int = 0, max_shift: int = 1,
               contrast: float = 0.2) -> Datasets:
    """pimm's digits split (:func:`pimm_core.data.digits`) as augmented training images and
    plain validation images (the ``data.target`` of configs/digits_aug.toml).

    Args:
        val_fraction, split_seed: the split, as ``data.val_fraction``/``data.split_seed``.
        seed: the augmentation seed.
        max_shift: largest shift in pixels; contrast: largest relative contrast change.
    """
    splits = digits(val_fraction=val_fraction, split_seed=split_seed)

    def images(ds) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, _ = ds.tensors
        return x.view(-1, 1, 8, 8), y

    fp = hashlib.sha256(f"{splits.fingerprint}|{seed}|{max_shift}|{contrast}".encode()).hexdigest()[:16]
    return Datasets(AugmentedDigits(*images(splits.train), augment=True, seed=seed, max_shift=max_shift,
                                    contrast=contrast),
                    AugmentedDigits(*images(splits.val), augment=False), fingerprint=fp)
