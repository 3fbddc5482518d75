"""Random augmentation that resumes exactly: one RNG per sample, from (seed, epoch, index).

A transform that draws from its DataLoader worker's RNG gives a sample an augmentation
that depends on which worker loaded it and what that worker drew before: change
``data.num_workers``, or resume mid-epoch, and the same sample is augmented differently.
Drawing instead from an RNG made from ``(seed, epoch, sample index)`` makes each
sample's augmentation a function of those three numbers only: the same at any worker
count, world size or resume point, and new in each epoch.

How a dataset uses it::

    from pimm_core.data.rng import EpochSeeded

    class Augmented(EpochSeeded, torch.utils.data.Dataset):
        def __init__(self, images, labels, seed=0):
            super().__init__(seed)
            self.images, self.labels = images, labels

        def __len__(self):
            return len(self.images)

        def __getitem__(self, index):
            g = self.generator(index)            # = sample_generator(self.seed, self.epoch, index)
            shift = torch.randint(-2, 3, (2,), generator=g)
            return torch.roll(self.images[index], tuple(shift.tolist()), (1, 2)), self.labels[index]

The dataset needs the epoch: pimm calls ``dataset.set_epoch(epoch)`` on a training
dataset that has that method (:func:`set_epoch`) before it starts iterating each epoch,
the resumed one included. pimm's loaders do not keep workers alive between epochs, so
each epoch's workers receive the dataset with its new epoch. ``index`` is the index
``__getitem__`` receives (an iterable dataset: the sample's position in its stream), so
shuffling does not change a sample's augmentation either.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch


def sample_seed(seed: int, epoch: int, index: int, stream: int = 0) -> int:
    """A 64-bit seed for one sample, well mixed (BLAKE2b) so neighbouring indices or
    epochs give unrelated streams.

    Args:
        seed: the run's or dataset's seed (e.g. ``train.seed``).
        epoch: the 0-based epoch.
        index: the sample's index in the dataset.
        stream: tells apart several independent draws for the same sample.

    Returns:
        An integer in ``[0, 2**64)``.
    """
    text = f"{int(seed)}:{int(epoch)}:{int(index)}:{int(stream)}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def sample_generator(seed: int, epoch: int, index: int, stream: int = 0,
                     device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` for one sample's random transform (pass it as ``generator=``
    to ``torch.rand``/``randint``/``randperm``...)."""
    return torch.Generator(device=device).manual_seed(sample_seed(seed, epoch, index, stream))


def sample_numpy(seed: int, epoch: int, index: int, stream: int = 0) -> np.random.Generator:
    """A NumPy ``Generator`` (PCG64) for one sample, for NumPy-based transforms."""
    return np.random.default_rng(sample_seed(seed, epoch, index, stream))


def sample_random(seed: int, epoch: int, index: int, stream: int = 0) -> random.Random:
    """A standard-library ``random.Random`` for one sample."""
    return random.Random(sample_seed(seed, epoch, index, stream))


def set_epoch(dataset: Any, epoch: int) -> bool:
    """Tell ``dataset`` the epoch about to start, if it wants to know.

    Returns:
        True when ``dataset`` has a callable ``set_epoch`` (and it was called).
    """
    hook = getattr(dataset, "set_epoch", None)
    if callable(hook):
        hook(epoch)
        return True
    return False


class EpochSeeded:
    """Mixin for a dataset whose random transforms use per-sample RNGs.

    Args:
        seed: the augmentation seed.

    Attributes:
        seed, epoch: the first two parts of every sample's RNG seed; ``epoch`` is set by
            :meth:`set_epoch` (0 until then).
    """

    def __init__(self, seed: int = 0, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.seed, self.epoch = int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        """Called by pimm before each epoch (and on a resume, with the resumed epoch)."""
        self.epoch = int(epoch)

    def generator(self, index: int, stream: int = 0) -> torch.Generator:
        """:func:`sample_generator` for sample ``index`` in the current epoch."""
        return sample_generator(self.seed, self.epoch, index, stream)
