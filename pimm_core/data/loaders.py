"""Datasets and loaders.

Registry of map-style datasets (``data.name``). The bundled example is
scikit-learn's handwritten digits (UCI ML hand-written digits, 1,797 8×8 grey
images, 10 classes), read from the package; no download at run time.

Loaders are torchdata ``StatefulDataLoader`` over a ``DistributedSampler`` whose
shuffle is addressed by epoch (seed + epoch, see PyTorch's ``DistributedSampler``),
so a loader cursor saved mid-epoch resumes at exactly the next batch.

Iterable (streaming) datasets (``torch.utils.data.IterableDataset``) are loaded without a
sampler, and **shard themselves**: each rank's loader iterates the dataset as given, so
its ``__iter__`` must yield only its own share, e.g. every ``count``-th item from
``index`` with ``index, count = stream_shard()`` (pimm's rank and world size combined
with the DataLoader worker of :func:`torch.utils.data.get_worker_info`). A training stream
must also define ``__len__``: the samples it yields per epoch on each rank (every rank the
same), which fixes the epoch's micro-batches and the LR schedule's horizon; with
``data.num_workers > 1`` each worker's share should be a multiple of ``data.batch_size``
(each worker batches its own items). ``set_epoch(epoch)`` is called before each epoch when
the dataset has it.

Resume: a stream with ``state_dict()``/``load_state_dict()`` is restored exactly mid-epoch
through the ``StatefulDataLoader`` (which saves each worker's dataset state). One without
them is not fast-forwarded: a resume inside an epoch replays that epoch from its start
(the ``no_loader_state`` row of :func:`pimm_core.run.topology.plan_resume`), and pimm says so
at start (``train.log`` and ``provenance.json``'s ``data_resume``).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import os
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch.utils.data import DistributedSampler, IterableDataset, Sampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from ..config import DataConfig
from ..errors import ConfigError, TrainingError
from ..process.dist import DistInfo
from ..targets import TargetSpec
from .workers import MAIN_GUARD, check_importable, is_pickling_error, unpicklable, worker_context

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


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as ``(data, target)``: ``data`` float64 of shape (1797, 64),
    pixel values 0..16; ``target`` int of shape (1797,), classes 0..9 — what
    ``sklearn.datasets.load_digits(return_X_y=True)`` returns.

    Read from the package's own file (``sklearn/datasets/data/digits.csv.gz``) with the parsing
    ``load_digits`` uses (``np.loadtxt``, comma-delimited, the last column the target), without
    importing scikit-learn: its import loads SciPy, about 0.9 s of CPU in every rank of every
    run, which the data does not need. Falls back to ``load_digits`` when the file is not where
    this version of scikit-learn keeps it.

    Raises:
        ModuleNotFoundError: scikit-learn is not installed.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("scikit-learn is not installed: the digits dataset is read from its package")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        from sklearn.datasets import load_digits

        return load_digits(return_X_y=True)
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int, copy=False)


def digits(val_fraction: float = 0.2, split_seed: int = 0) -> DatasetSplits:
    """The bundled digits split into train/val: the ``data.name = "digits"`` dataset as a
    target (``data.target = "pimm_core.data:digits"``; the args are ``data.*``'s keys).

    Args:
        val_fraction: share of the 1,797 images held out for validation, in [0, 1].
        split_seed: seed of the split's permutation.
    """
    data, target = digits_arrays()
    x = (data.astype(np.float32) / 16.0)  # pixel values 0..16 -> [0, 1]
    y = target.astype(np.int64)
    perm = np.random.RandomState(split_seed).permutation(len(x))
    n_val = int(round(len(x) * val_fraction))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    h = hashlib.sha256()
    for arr in (x, y, train_idx, val_idx):
        h.update(np.ascontiguousarray(arr).tobytes())

    def make(idx: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(x[idx]), torch.from_numpy(y[idx]), torch.arange(len(idx)))

    return DatasetSplits(make(train_idx), make(val_idx), 64, (1, 8, 8), 10, h.hexdigest()[:16])


DATASETS: dict[str, Callable[..., DatasetSplits]] = {"digits": digits}


def _unknown(cfg: DataConfig) -> ConfigError:
    return ConfigError(f"data.name = {cfg.name!r} is not a known dataset; use one of {sorted(DATASETS)}")


def build_datasets(cfg: DataConfig) -> DatasetSplits:
    """Build the splits of dataset ``cfg.name``.

    Raises:
        ConfigError: unknown dataset name.
    """
    if cfg.name not in DATASETS:
        raise _unknown(cfg)
    return DATASETS[cfg.name](val_fraction=cfg.val_fraction, split_seed=cfg.split_seed)


def data_spec(cfg: DataConfig) -> TargetSpec:
    """The target that builds ``cfg``'s datasets: ``data.target`` with its args, or the
    built-in ``data.name`` as the same kind of target (``"pimm_core.data:digits"`` with
    ``val_fraction`` and ``split_seed``).

    Raises:
        ConfigError: unknown ``data.name``.
    """
    if cfg.target is not None:
        return TargetSpec("data.target", cfg.target, dict(cfg.args or {}), "data.args")
    if cfg.name not in DATASETS:
        raise _unknown(cfg)
    return TargetSpec("data.name", f"pimm_core.data:{cfg.name}",
                      {"val_fraction": cfg.val_fraction, "split_seed": cfg.split_seed}, "data")


@dataclass
class Datasets:
    """What a ``data.target`` gives, normalized by :func:`as_datasets`.

    Attributes:
        train, val: map-style datasets (``__getitem__`` and ``__len__``) or
            ``torch.utils.data.IterableDataset``s; a batch is whatever the loader's collate
            makes of their items (the objective receives it as is).
        collate_fn: the loaders' collate function; ``None``: PyTorch's default.
        fingerprint: a cheap identity of the data for provenance (a resume warns when it
            changed); ``None``: unknown.
    """

    train: Any
    val: Any
    collate_fn: Callable[[list[Any]], Any] | None = None
    fingerprint: str | None = None


def _is_dataset(ds: Any) -> bool:
    return isinstance(ds, IterableDataset) or (hasattr(ds, "__getitem__") and hasattr(ds, "__len__"))


def _own_fingerprint(obj: Any) -> str | None:
    fp = getattr(obj, "fingerprint", None)
    fp = fp() if callable(fp) else fp
    return str(fp) if fp is not None else None


def as_datasets(value: Any, spec: TargetSpec) -> Datasets:
    """Normalize what ``spec``'s target returned.

    A data target may return a :class:`Datasets`; any object with ``train`` and ``val``
    attributes (``collate_fn`` and ``fingerprint`` optional, e.g. :class:`DatasetSplits`);
    a mapping with those keys; or a tuple ``(train, val)`` or ``(train, val, collate_fn)``.
    The fingerprint is the returned object's ``fingerprint`` (a string, or a method
    returning one), else one made of the train and val datasets' own fingerprints when
    both have one, else ``None``.

    Raises:
        ConfigError: any other return value, or a split that is not a dataset.
    """
    if isinstance(value, Datasets):
        out = value
    elif isinstance(value, Mapping) and "train" in value and "val" in value:
        fp = value.get("fingerprint")
        out = Datasets(value["train"], value["val"], value.get("collate_fn"), None if fp is None else str(fp))
    elif hasattr(value, "train") and hasattr(value, "val") and not isinstance(value, (tuple, list)):
        out = Datasets(value.train, value.val, getattr(value, "collate_fn", None), _own_fingerprint(value))
    elif isinstance(value, (tuple, list)) and len(value) in (2, 3):
        out = Datasets(*value)
    else:
        raise ConfigError(f"{spec.label()}: returned {type(value).__name__}; return (train, val), "
                          "(train, val, collate_fn) or a pimm_core.data.Datasets")
    for split in ("train", "val"):
        if not _is_dataset(getattr(out, split)):
            raise ConfigError(f"{spec.label()}: its {split} split is a {type(getattr(out, split)).__name__}, not a "
                              "dataset (map-style: __getitem__ and __len__; or a torch IterableDataset)")
    if out.collate_fn is not None and not callable(out.collate_fn):
        raise ConfigError(f"{spec.label()}: collate_fn is a {type(out.collate_fn).__name__}, not callable")
    if out.fingerprint is None:
        parts = [_own_fingerprint(out.train), _own_fingerprint(out.val)]
        if None not in parts:
            out.fingerprint = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return out


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


def is_stream(ds: Any) -> bool:
    """``ds`` is an iterable (streaming) dataset."""
    return isinstance(ds, IterableDataset)


def is_stateful(ds: Any) -> bool:
    """``ds`` saves and restores its own position (``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(ds, "state_dict", None)) and callable(getattr(ds, "load_state_dict", None))


def stream_shard() -> tuple[int, int]:
    """The share of an iterable dataset this process should yield: ``(index, count)``.

    ``count`` is the world size times the DataLoader workers per rank; ``index`` is this
    rank's and worker's place among them (``rank * workers + worker_id``). Call it inside
    ``__iter__`` (in the worker) and yield every ``count``-th item from ``index``.
    """
    from torch.utils.data import get_worker_info

    from ..process.dist import env_world

    info, worker = env_world(), get_worker_info()
    workers, wid = (worker.num_workers, worker.id) if worker is not None else (1, 0)
    return info.rank * workers + wid, info.world_size * workers


def train_loader(ds: Any, cfg: DataConfig, info: DistInfo, seed: int,
                 collate_fn: Callable[[list[Any]], Any] | None = None, global_batch: int | None = None
                 ) -> tuple[StatefulDataLoader, Any]:
    """Epoch-addressed training loader for this rank over a map-style ``ds``: a
    ``DistributedSampler`` shuffled by ``seed + epoch`` (``data.shuffle``), and with
    ``data.drop_last`` the sampler drops the tail that does not divide among the ranks
    (instead of repeating samples to pad the shards) and the loader its short last batch
    (``collate_fn`` None: PyTorch's default); over an iterable ``ds`` no sampler (None; the
    stream shards itself, see the module docstring; ``drop_last`` still drops a short batch).

    With ``data.order = "global"`` the batches come from a
    :class:`~pimm_core.data.global_order.GlobalOrderSampler` over ``global_batch`` samples per step
    (returned as the sampler).

    Raises:
        ConfigError: an iterable ``ds`` without ``__len__``; the global order over a stream
            or without ``global_batch``, or a ``global_batch`` the ranks cannot share.
    """
    if cfg.order == "global":
        if is_stream(ds) or not global_batch:
            raise ConfigError('data.order = "global" needs ' + (
                "a map-style train split (a stream shards itself by rank); use data.order = \"rank\""
                if is_stream(ds) else "train.global_batch (samples per optimizer step, e.g. train.global_batch=64)"))
        from .global_order import GlobalOrderSampler

        sampler = GlobalOrderSampler(len(ds), cfg.batch_size, global_batch, info.rank, info.world_size, seed,
                                     cfg.shuffle)
        return _loader(ds, cfg, info, seed, collate_fn, batch_sampler=sampler), sampler
    if is_stream(ds):
        try:
            len(ds)
        except TypeError:
            raise ConfigError(f"data: the train split {type(ds).__name__} is an IterableDataset without __len__; "
                              "define it as the samples it yields per epoch on each rank") from None
    sampler = None if is_stream(ds) else \
        DistributedSampler(ds, num_replicas=info.world_size, rank=info.rank, shuffle=cfg.shuffle, seed=seed,
                           drop_last=cfg.drop_last)
    return _loader(ds, cfg, info, seed, collate_fn, sampler=sampler, batch_size=cfg.batch_size,
                   drop_last=cfg.drop_last), sampler


def _loader(ds: Any, cfg: DataConfig, info: DistInfo, seed: int, collate_fn: Callable | None,
            **batching: Any) -> StatefulDataLoader:
    """The training loader over ``ds`` with ``batching`` (a sampler and batch size, or a batch sampler)."""
    # Workers start from a clean process (pimm_core.data.workers), once per epoch: a
    # dataset's set_epoch reaches them, as it would not reach persistent workers.
    workers = {}
    if cfg.num_workers:
        check_importable("train dataset", ds, cfg.multiprocessing_context)
        check_importable("collate_fn", collate_fn, cfg.multiprocessing_context)
        workers = {"multiprocessing_context": worker_context(cfg.multiprocessing_context), "timeout": cfg.timeout}
    # The loader's own generator: creating an iterator must not draw from the global
    # torch RNG, or a resumed run (which creates one mid-epoch) would shift the dropout stream.
    loader = TrainLoader(ds, **batching, num_workers=cfg.num_workers, persistent_workers=False, collate_fn=collate_fn,
                         worker_init_fn=functools.partial(init_worker, os.getpid()),
                         generator=torch.Generator().manual_seed(seed + info.rank), **workers)
    loader.rank, loader.start_method = info.rank, cfg.multiprocessing_context
    if cfg.num_workers:
        _with_workers.add(loader)
    return loader


class DataTimeoutError(TrainingError):
    """No batch from a rank's DataLoader workers within ``data.timeout`` (exit code 1)."""


class TrainLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` whose worker failures are one line: a dataset the workers
    cannot receive is a :class:`ConfigError`, a batch not ready in ``data.timeout`` seconds a
    :class:`TrainingError` naming the rank and the wait (PyTorch's own messages say neither)."""

    rank: int = 0
    start_method: str = "fork"

    def __iter__(self):
        # StatefulDataLoader's __iter__ already waits for the first batches (its _reset)
        try:
            iterator = super().__iter__()
        except Exception as e:
            raise self._one_line(e, getattr(self, "_iterator", None)) from None
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except Exception as e:
                raise self._one_line(e, iterator) from None
            yield batch

    def _one_line(self, error: Exception, iterator: Any) -> Exception:
        """The error to raise for ``error``: one line where pimm can name the cause, else ``error`` itself."""
        if not self.num_workers:
            return error
        if is_pickling_error(error):
            return unpicklable("train dataset (or its collate_fn)", self.start_method, error)
        if isinstance(error, RuntimeError) and self.timeout and "timed out" in str(error):
            if iterator is not None:
                stop_workers(iterator)  # a stuck worker never exits by itself: the rank would hang at exit
            return DataTimeoutError(
                f"rank {self.rank}: no batch from its {self.num_workers} DataLoader workers in {self.timeout:g} s "
                "(data.timeout); a worker is stuck or too slow in the dataset's __getitem__/collate_fn: fix it, "
                "or raise data.timeout (0: wait forever)")
        if isinstance(error, RuntimeError) and "exited unexpectedly" in str(error) and self.start_method != "fork":
            return TrainingError(f"rank {self.rank}: {error} (its error is printed above; when it failed while "
                                 f"starting: {MAIN_GUARD})")
        return error


# The train loaders that may hold worker processes. Their workers ignore SIGTERM
# (ignore_stop_signals), and multiprocessing's exit handler SIGTERMs daemon children and
# then joins them: a loader still alive at interpreter exit (a Trainer kept in a global or a
# reference cycle) would make the program hang there. This exit handler, registered after
# multiprocessing's and so run before it, stops them through the loader's own shutdown
# (as Lightning's _shutdown_workers_and_reset_iterator does at its teardown).
_with_workers: "weakref.WeakSet[StatefulDataLoader]" = weakref.WeakSet()


@atexit.register
def _stop_workers_at_exit() -> None:
    for loader in list(_with_workers):
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None:
            stop_workers(iterator)


def stop_workers(iterator: Any) -> None:
    """End a loader iterator's workers: the loader's own shutdown (which asks each worker to
    exit and waits a few seconds), then SIGKILL for any still alive (a worker stuck in the
    dataset never reads the request, and ignores SIGTERM)."""
    if hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    for w in getattr(iterator, "_workers", ()):
        if w.is_alive():
            w.kill()
            w.join(5)


def eval_loader(ds: Any, cfg: DataConfig, info: DistInfo,
                collate_fn: Callable[[list[Any]], Any] | None = None,
                batch_size: int | None = None) -> torch.utils.data.DataLoader:
    """This rank's unpadded shard of a map-style validation set (:class:`ShardSampler`), in
    batches of ``batch_size`` (``eval.batch_size``; None: ``max(data.batch_size, 256)``): every
    sample is evaluated exactly once. An iterable set is read as it yields (it shards itself:
    :func:`stream_shard`)."""
    sampler = None if is_stream(ds) else ShardSampler(len(ds), info)
    size = batch_size if batch_size is not None else max(cfg.batch_size, 256)
    return torch.utils.data.DataLoader(ds, batch_size=size, sampler=sampler,
                                       generator=torch.Generator().manual_seed(0), collate_fn=collate_fn)


def init_worker(rank_pid: int, worker_id: int) -> None:
    """A DataLoader worker ignores stop signals and dies with its rank (``rank_pid``, its parent).

    PyTorch's own check (the worker polls its parent's pid) starts only after this function
    and the worker's setup: a rank killed in between would leave the worker waiting forever
    (see pimm_core.process.lock). Under the fork server the parent is the server, which exits with
    the rank; :func:`pimm_core.process.lock.die_with_parent` then watches the rank itself.
    """
    from ..process.lock import die_with_parent

    ignore_stop_signals(worker_id)
    die_with_parent(rank_pid)


def ignore_stop_signals(_worker_id: int) -> None:
    """DataLoader workers ignore SIGINT/SIGTERM/SIGHUP: the main process decides when to stop
    (a closed terminal sends SIGHUP to the whole process group)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
