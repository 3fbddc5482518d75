"""The global data order (``data.order = "global"``): batching and randomness that do not
depend on the number of ranks, so a resume on another world size continues the same run.

- One permutation of the training set per epoch, from ``(train.seed, epoch)`` alone (in
  order with ``data.shuffle = false``).
- Optimizer step ``k`` of an epoch trains the permutation's positions ``[k*G, (k+1)*G)``,
  ``G = train.global_batch``, cut into ``M = G / data.batch_size`` micro-batches in that
  order; micro-batch ``j`` of the step goes to rank ``j % W`` as its ``j // W``-th micro-batch
  of the window, so the window is ``M / W`` micro-batches (``train.grad_accum`` is derived).
  The epoch's last ``len % G`` positions (a different set each epoch when shuffled) are not
  trained: every step holds ``G`` samples.
- The loader cursor is the number of the epoch's samples consumed: ``steps done * G``, known
  from the counters, so :class:`GlobalOrderSampler` starts mid-epoch at any world size.
- Before each micro-batch's forward, the torch (CPU and CUDA), numpy and ``random``
  generators are seeded from ``(train.seed, global step, micro-batch index in the step)``
  (:func:`seed_micro_batch`): dropout draws the same masks for the same samples whichever
  rank computes them. Augmentation keeps ``pimm_core.data.rng`` (seed, epoch, index).

With the per-sample window average (:mod:`pimm_core.train.window_average`) a step's gradient
is then the same sum at any world size; only the order of floating-point additions differs.
Torch-light: the sampler imports torch lazily (the resume policy reads :func:`window_of`).
"""

from __future__ import annotations

import functools
import random
from typing import Iterator

from ..errors import ConfigError


def window_of(global_batch: int, batch_size: int, world_size: int) -> int:
    """Micro-batches per rank per optimizer step under the global order.

    Raises:
        ConfigError: ``global_batch`` is not a multiple of ``batch_size``, or its micro-batches
            do not divide among ``world_size`` ranks (names the world sizes that do).
    """
    if global_batch % batch_size:
        raise ConfigError(f"train.global_batch = {global_batch} is not a multiple of data.batch_size = {batch_size}; "
                          "make it one (samples per optimizer step = micro-batch size x micro-batches)")
    micro = global_batch // batch_size
    if micro % world_size:
        sizes = [d for d in range(1, micro + 1) if micro % d == 0]
        raise ConfigError(f"train.global_batch = {global_batch} is {micro} micro-batches of {batch_size}, which do "
                          f"not divide among {world_size} ranks; run on {', '.join(map(str, sizes))} ranks, or "
                          "change train.global_batch")
    return micro // world_size


class GlobalOrderSampler:
    """A batch sampler (lists of indices) of one rank under the global order.

    Args:
        length: samples in the training set.
        batch_size: ``data.batch_size`` (the micro-batch).
        global_batch: ``train.global_batch`` (samples per optimizer step).
        rank, world_size: this rank and the number of ranks.
        seed: ``train.seed``; the permutation of epoch ``e`` comes from ``seed + e``.
        shuffle: ``data.shuffle`` (false: the identity order).
    """

    def __init__(self, length: int, batch_size: int, global_batch: int, rank: int, world_size: int, seed: int,
                 shuffle: bool = True):
        self.length, self.batch_size, self.global_batch = length, batch_size, global_batch
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.window = window_of(global_batch, batch_size, world_size)
        self.steps = length // global_batch  # optimizer steps per epoch
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_start(self, micro_batches_done: int) -> None:
        """Start the next iteration after this rank's ``micro_batches_done`` of the epoch (a
        multiple of the window: the resumed position, ``steps done * window``)."""
        self.start_step = micro_batches_done // self.window

    def __len__(self) -> int:
        """This rank's micro-batches in a whole epoch."""
        return self.steps * self.window

    def __iter__(self) -> Iterator[list[int]]:
        import torch

        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)  # as DistributedSampler draws its order
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        b, start, self.start_step = self.batch_size, self.start_step, 0  # (the start applies once)
        for k in range(start, self.steps):
            base = k * self.global_batch
            for a in range(self.window):
                j = a * self.world_size + self.rank  # the micro-batch's index in the step
                yield order[base + j * b: base + (j + 1) * b]


def seed_micro_batch(seed: int, step: int, index: int) -> None:
    """Seed torch (CPU and every CUDA device), numpy's global generator and ``random`` for
    micro-batch ``index`` of optimizer step ``step`` (0-based: the step being computed), from
    ``(seed, step, index)`` through numpy's ``SeedSequence`` (independent streams)."""
    import numpy as np
    import torch

    state = np.random.SeedSequence([seed, step, index]).generate_state(2, dtype=np.uint64)
    s = int(state[0]) & (2**63 - 1)
    if _cpu_and_cuda_only():
        # what torch.manual_seed does here, without its ~0.4 ms of checks for other accelerators
        torch.default_generator.manual_seed(s)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(s)
    else:
        torch.manual_seed(s)
    np.random.seed(int(state[1]) % 2**32)
    random.seed(int(state[1]))


@functools.cache
def _cpu_and_cuda_only() -> bool:
    """No MPS or XPU device (torch.manual_seed would seed theirs too)."""
    import torch

    mps, xpu = getattr(torch.backends, "mps", None), getattr(torch, "xpu", None)
    return not ((mps is not None and mps.is_available()) or (xpu is not None and xpu.is_available()))


def ordered(train, data, world_size: int):
    """``train`` (a :class:`~pimm_core.config.TrainConfig`) with the window the global order
    derives (``grad_accum``); unchanged under the default order.

    Raises:
        ConfigError: the global order without ``train.global_batch``, or one that the ranks
            cannot share (:func:`window_of`).
    """
    from dataclasses import replace

    if data.order != "global":
        return train
    if not train.global_batch:
        raise ConfigError('data.order = "global" needs train.global_batch (samples per optimizer step, '
                          "e.g. train.global_batch=64)")
    return replace(train, grad_accum=window_of(train.global_batch, data.batch_size, world_size))


def micro_batch_seeder(seed: int, state, info):
    """``before_forward`` of the global order's :class:`~pimm_core.train.step.WindowStep`: the
    window's ``position``-th micro-batch on rank ``info.rank`` is micro-batch ``position * world
    size + rank`` of step ``state.global_step``, and draws from that stream whichever rank runs it."""
    return lambda position: seed_micro_batch(seed, state.global_step, position * info.world_size + info.rank)


def running_stats_warning(model) -> list[str]:
    """The warning of a world-size change under the global order for a model with BatchNorm
    running statistics (empty without): DDP broadcasts rank 0's buffers at each forward, so the
    running mean and variance depend on which micro-batches rank 0 computed, and a SyncBatchNorm
    normalizes over every rank's micro-batch at once (its batch statistics, hence the trajectory,
    depend on the world size)."""
    from torch import nn
    from torch.nn.modules.batchnorm import _BatchNorm

    names = [n or "(root)" for n, m in model.named_modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    if not names:
        return []
    where = names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")
    if any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
        return [f"the model has SyncBatchNorm ({where}): its batch statistics span the ranks, so the global data "
                "order does not keep the trajectory across a world-size change"]
    return [f"the model has BatchNorm running statistics ({where}): they follow the micro-batches rank 0 computed "
            "(DDP broadcasts its buffers), so after a world-size change they are not the interrupted run's; the "
            "weights are (up to the order of floating-point additions)"]
