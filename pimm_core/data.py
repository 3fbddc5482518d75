"""Datasets and loaders.

Registry of map-style datasets (``data.name``). The bundled example is
scikit-learn's handwritten digits (UCI ML hand-written digits, 1,797 8×8 grey
images, 10 classes), read from the package; no download at run time.

Loaders are torchdata ``StatefulDataLoader`` over a ``DistributedSampler`` whose
shuffle is addressed by epoch (seed + epoch, see PyTorch's ``DistributedSampler``),
so a loader cursor saved mid-epoch resumes at exactly the next batch.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DistributedSampler, Sampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from .config import DataConfig
from .dist import DistInfo
from .errors import ConfigError

# torchdata 0.11 calls the deprecated torch.set_vital on every iterator; nothing for us to fix.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


@dataclass
class DatasetSplits:
    """Train/val datasets plus what a model needs to know about them.

    Each item is ``(x, y, index)``: ``x`` float32 features, ``y`` int64 class,
    ``index`` int64 position in the split (lets tests check sample order).
    """

    train: TensorDataset
    val: TensorDataset
    in_features: int
    in_shape: tuple[int, ...]
    num_classes: int
    fingerprint: str  # sha256 (first 16 hex) of the data and the split


def _digits(cfg: DataConfig) -> DatasetSplits:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.data.astype(np.float32) / 16.0)  # pixel values 0..16 -> [0, 1]
    y = bunch.target.astype(np.int64)
    perm = np.random.RandomState(cfg.split_seed).permutation(len(x))
    n_val = int(round(len(x) * cfg.val_fraction))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    h = hashlib.sha256()
    for arr in (x, y, train_idx, val_idx):
        h.update(np.ascontiguousarray(arr).tobytes())

    def make(idx: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(x[idx]), torch.from_numpy(y[idx]), torch.arange(len(idx)))

    return DatasetSplits(make(train_idx), make(val_idx), 64, (1, 8, 8), 10, h.hexdigest()[:16])


DATASETS: dict[str, Callable[[DataConfig], DatasetSplits]] = {"digits": _digits}


def build_datasets(cfg: DataConfig) -> DatasetSplits:
    """Build the splits of dataset ``cfg.name``.

    Raises:
        ConfigError: unknown dataset name.
    """
    if cfg.name not in DATASETS:
        raise ConfigError(f"data.name = {cfg.name!r} is not a known dataset; use one of {sorted(DATASETS)}")
    return DATASETS[cfg.name](cfg)


class ShardSampler(Sampler[int]):
    """Deterministic, unpadded rank shard (``rank, rank + world, ...``) for evaluation.

    Unlike ``DistributedSampler`` it never repeats samples, so summed metrics are exact.
    """

    def __init__(self, n: int, info: DistInfo):
        self.indices = list(range(info.rank, n, info.world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def train_loader(ds: TensorDataset, cfg: DataConfig, info: DistInfo, seed: int) -> tuple[StatefulDataLoader, DistributedSampler]:
    """Shuffled, epoch-addressed training loader for this rank (``drop_last`` on the sampler off)."""
    sampler = DistributedSampler(ds, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=seed)
    # The loader's own generator: creating an iterator must not draw from the global
    # torch RNG, or a resumed run (which creates one mid-epoch) would shift the dropout stream.
    loader = StatefulDataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.num_workers,
                                drop_last=False, persistent_workers=False,
                                worker_init_fn=functools.partial(init_worker, os.getpid()),
                                generator=torch.Generator().manual_seed(seed + info.rank))
    return loader, sampler


def eval_loader(ds: TensorDataset, cfg: DataConfig, info: DistInfo) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ds, batch_size=max(cfg.batch_size, 256), sampler=ShardSampler(len(ds), info),
                                       generator=torch.Generator().manual_seed(0))


def init_worker(rank_pid: int, worker_id: int) -> None:
    """A DataLoader worker ignores stop signals and dies with its rank (``rank_pid``, its parent).

    PyTorch's own check (the worker polls its parent's pid) starts only after this function
    and the worker's setup: a rank killed in between would leave the worker waiting forever,
    holding the run lock it inherited (see pimm_core.lock).
    """
    from .lock import die_with_parent

    ignore_stop_signals(worker_id)
    die_with_parent(rank_pid)


def ignore_stop_signals(_worker_id: int) -> None:
    """DataLoader workers ignore SIGINT/SIGTERM: the main process decides when to stop."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
