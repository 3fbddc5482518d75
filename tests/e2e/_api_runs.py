"""In-process pimm runs through the public Python API, for the weights tests.

``Trainer(load_config(configs/digits.toml, overrides), run_dir=...).train(checkpoint_dir=run_dir/"model",
resume_from=...)``, with a stop requested from ``trainer.callbacks`` for interruptions, plus an
evaluator replica to check recorded metrics against saved weights. Used by
``test_formats.py`` and ``test_ema_best.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from _helpers import DIGITS


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Intra-op threads = 1 while the module's runs train.

    The MLP is tiny: with 2 threads on a shared 2-core machine torch spends ~20x longer
    spinning than computing. Restored afterwards (other test files keep their setting).
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


@contextlib.contextmanager
def pimm_logging() -> Iterator[list[tuple[str, str]]]:
    """The ``pimm`` logger at INFO, as under the CLI; yields the ``(level, message)`` lines logged meanwhile
    (what ``pimm launch`` prints). Handlers added meanwhile (the trainer's ``train.log``) are removed after."""
    logger = logging.getLogger("pimm")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    records = _Records()
    logger.addHandler(records)
    try:
        yield records.lines
    finally:
        for h in list(logger.handlers):
            if h not in handlers:
                logger.removeHandler(h)
                h.close()
        logger.setLevel(level)
        logger.propagate = propagate


def make_config(overrides: tuple[str, ...] | list[str] = (), extra: dict[str, Any] | None = None):
    from pimm_core import load_config

    return load_config(DIGITS, list(overrides), extra)


def train(run_dir: Path, overrides: tuple[str, ...] | list[str] = (), *, stop_at: int | None = None,
          resume_from: Path | None = None, callbacks: tuple[Callable[[Any], None], ...] = (),
          extra: dict[str, Any] | None = None):
    """Train configs/digits.toml + ``overrides`` into ``run_dir`` (checkpoints in ``run_dir/model``).

    ``stop_at``: request a stop after that global step (an interruption). Returns the trainer, with
    the ``(level, message)`` lines it logged (the CLI's console output) as ``trainer.test_log``.
    """
    from pimm_core import Trainer

    run_dir = Path(run_dir)
    with pimm_logging() as lines:
        trainer = Trainer(make_config(overrides, extra), run_dir=run_dir)
        trainer.test_log = lines
        trainer.callbacks.extend(callbacks)
        if stop_at is not None:
            trainer.callbacks.append(lambda tr: tr.stop.request("test") if tr.state.global_step == stop_at else None)
        trainer.train(checkpoint_dir=run_dir / "model", resume_from=resume_from)
    return trainer


def listing(model_dir: Path) -> dict[str, str]:
    """Entries of a model directory: pointer name -> its link text, file name -> "file"."""
    out = {}
    for p in sorted(Path(model_dir).iterdir()):
        out[p.name] = os.readlink(p) if p.is_symlink() else ("dir" if p.is_dir() else "file")
    return out


def run_config(run_dir: Path):
    from pimm_core.config import config_from_dict

    return config_from_dict(tomllib.loads((Path(run_dir) / "config.toml").read_text()))


def fresh_model(run_dir: Path) -> torch.nn.Module:
    """An untrained model of the run's resolved config (``build_model``)."""
    from pimm_core.data.loaders import build_datasets
    from pimm_core.models import build_model

    cfg = run_config(run_dir)
    data = build_datasets(cfg.data)
    return build_model(cfg.model, data.in_features, data.in_shape, data.num_classes)


@torch.no_grad()
def evaluate(run_dir: Path, state_dict: dict[str, torch.Tensor]) -> dict[str, float]:
    """``{"val/acc", "val/loss"}`` of ``state_dict`` in a fresh model, computed like the evaluator.

    Same validation split (``build_datasets``), same loader (``eval_loader``), same float64
    sums in the same order, so the result equals what the trainer recorded for these weights.
    """
    from pimm_core.data.loaders import build_datasets, eval_loader
    from pimm_core.process.dist import env_world
    from pimm_core.models import build_model

    cfg = run_config(run_dir)
    data = build_datasets(cfg.data)
    model = build_model(cfg.model, data.in_features, data.in_shape, data.num_classes)
    model.load_state_dict(state_dict, strict=True)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    for x, y, _ in eval_loader(data.val, cfg.data, env_world()):
        logits = model(x)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum").item()
        totals[1] += (logits.argmax(1) == y).sum().item()
        totals[2] += len(y)
    return {"val/acc": float(totals[1] / totals[2]), "val/loss": float(totals[0] / totals[2])}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same keys and bitwise-equal tensors (dtype included)."""
    assert sorted(a) == sorted(b)
    different = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different}"
