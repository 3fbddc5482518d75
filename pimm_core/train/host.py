"""What the trainer's session and resume functions use of the trainer that calls them.

:mod:`.session` and :mod:`.resume` are functions of the :class:`~pimm_core.trainer.Trainer` (its
``train()`` session and its resume), kept apart so that ``trainer.py`` stays one job. They take the
trainer as :class:`TrainerHost`, the attributes they read and set, declared here below them, so they do
not import :mod:`pimm_core.trainer` back (not even for annotations). ``Trainer`` has each of these.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..config import Config, TrainConfig
    from ..data.loaders import Datasets
    from ..objectives import Objective
    from ..process.dist import DistInfo
    from ..process.stop import StopRequest
    from ..process.time_limit import TimeLimit
    from .best import BestTracker
    from .callbacks import Callbacks
    from .checkpointer import Checkpointer
    from .ema import EMA
    from .recorder import Recorder
    from .state import TrainState
    from .stop_agreement import StopAgreement


class TrainerHost(Protocol):
    """The trainer as its session and resume functions see it (see :class:`~pimm_core.trainer.Trainer`
    for what each attribute is)."""

    config: Config
    config_path: str | Path | None
    run_dir: Path | None
    info: DistInfo
    stop: StopRequest
    stopped_before_start: bool
    data: Datasets
    data_resume: str  # "exact" or "replay_from_boundary"
    objective: Objective
    model: nn.Module
    ema: EMA | None
    loader: Any
    sampler: Any
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    scheduler: Any
    state: TrainState
    recorder: Recorder | None
    checkpointer: Checkpointer
    stop_agreement: StopAgreement
    best: BestTracker
    time_limit: TimeLimit
    _t: TrainConfig
    _pending_loader_state: dict[str, Any] | None
    _code_version: str | None
    _user_code: list[dict[str, Any]]
    _model_library: dict[str, Any] | None

    @property
    def callbacks(self) -> Callbacks: ...
    def end_step(self, t: TrainConfig) -> int: ...
    def evaluate(self) -> dict[str, float]: ...
