"""Session fixtures: one tiny real training run, shared by several test files."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
import subprocess

import pytest

from _helpers import launch

# Tiny single-process run: 3 epochs of digits (45 steps/epoch at batch 32), step-based
# saves every 20 steps keeping the newest 2 iter_<step>.pth snapshots.
SINGLE_OVERRIDES = ("train.epochs=3", "checkpoint.every_steps=20", "checkpoint.keep_iter=2")


@dataclass
class TrainedRun:
    root: Path  # --run.root
    run_dir: Path  # <root>/digits/t
    result: subprocess.CompletedProcess

    def copy_to(self, dest_root: Path) -> Path:
        """A private copy of the run directory (for tests that damage it); returns the copy."""
        dest = dest_root / self.run_dir.relative_to(self.root)
        shutil.copytree(self.run_dir, dest, symlinks=True)
        return dest


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """One intra-op thread for the runs trained in this process, as ``clean_env`` gives the
    subprocesses: the digits MLP gains nothing from a second, and on a busy 2-core machine
    the extra thread spins (several times the compute)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# A run interrupted mid-epoch through the Python API (in this process): configs/digits.toml with
# _resume_driver.BASE (dropout 0.3, a training record per step) and STOPPED_OVERRIDES, a stop
# requested after step STOPPED_AT = 50 (epoch 1, iter 5: model/last holds a loader cursor).
STOPPED_OVERRIDES = ("train.epochs=2", "data.num_workers=0")
STOPPED_AT = 50


@pytest.fixture(scope="session")
def stopped_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory ``<tmp>/digits/base`` of that run, trained once for the resume test files,
    which copy it (``shutil.copytree``). Do not modify it."""
    from _resume_driver import run_job

    run = tmp_path_factory.mktemp("stopped") / "digits" / "base"
    run_job(run, STOPPED_OVERRIDES, stop_at=STOPPED_AT)
    return run


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """``pimm launch`` of configs/digits.toml with SINGLE_OVERRIDES, in a subprocess. Do not modify it."""
    root = tmp_path_factory.mktemp("single")
    result = launch(root, "t", *SINGLE_OVERRIDES)
    return TrainedRun(root, root / "digits" / "t", result)
