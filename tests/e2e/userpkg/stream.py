"""The user data as a stream: digits in an epoch-seeded order, each rank and worker yielding its
own share (:func:`pimm_core.data.stream_shard`). ``DigitStream`` keeps no position;
``StatefulDigitStream`` saves and restores it (``state_dict``/``load_state_dict``)."""

from __future__ import annotations

import enum

import torch
from torch.utils.data import IterableDataset

from pimm_core.data.loaders import stream_shard
from pimm_core.process.dist import env_world


class DigitStream(IterableDataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, *, seed: int = 0):
        self.x, self.y, self.seed = x, y, seed
        self.epoch, self.pos = 0, 0

    def fingerprint(self) -> str:  # cheap: what pimm records as the data's identity
        return f"digits-stream:{len(self.x)}:{self.seed}"

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.pos = epoch, 0

    def __len__(self) -> int:  # samples per epoch on each rank
        return len(self.x) // env_world().world_size

    def __iter__(self):
        index, count = stream_shard()
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        mine = order.tolist()[index::count]
        for k in range(self.pos, len(mine)):
            self.pos = k + 1
            yield self.x[mine[k]], self.y[mine[k]]
        self.pos = 0  # the next pass starts from the beginning


class StatefulDigitStream(DigitStream):
    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]


def digits_stream(train: int = 192, val: int = 61, stateful: bool = True):
    """``(train, val)`` streams of ``train`` and ``val`` digits (the val stream in a fixed order)."""
    from pimm_core.data.loaders import digits_arrays

    data, target = digits_arrays()
    x = torch.tensor(data, dtype=torch.float32) / 16.0
    y = torch.tensor(target, dtype=torch.int64)
    kind = StatefulDigitStream if stateful else DigitStream
    return kind(x[:train], y[:train]), DigitStream(x[train:train + val], y[train:train + val])


class Phase(enum.Enum):
    """A value of a user class in a stream's state: what ``torch.load(weights_only=True)`` refuses."""

    WARMUP = "warmup"
    MAIN = "main"


class SafePhase(enum.Enum):
    """The same, registered with ``torch.serialization.add_safe_globals`` (below): a resume loads it."""

    WARMUP = "warmup"
    MAIN = "main"


torch.serialization.add_safe_globals([SafePhase])


class PhasedDigitStream(StatefulDigitStream):
    """A stateful stream whose state holds an enum (``phase_cls``)."""

    phase_cls: type[enum.Enum] = Phase

    def state_dict(self) -> dict:
        return {**super().state_dict(), "phase": self.phase_cls.MAIN if self.pos else self.phase_cls.WARMUP}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        assert isinstance(state["phase"], self.phase_cls)


class SafePhasedDigitStream(PhasedDigitStream):
    phase_cls = SafePhase


def phased_stream(train: int = 192, val: int = 61, registered: bool = False):
    """``(train, val)`` streams whose train state holds an enum (``registered``: one a resume may load)."""
    from pimm_core.data.loaders import digits_arrays

    data, target = digits_arrays()
    x = torch.tensor(data, dtype=torch.float32) / 16.0
    y = torch.tensor(target, dtype=torch.int64)
    kind = SafePhasedDigitStream if registered else PhasedDigitStream
    return kind(x[:train], y[:train]), DigitStream(x[train:train + val], y[train:train + val])
