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


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """``pimm launch`` of configs/digits.toml with SINGLE_OVERRIDES, in a subprocess. Do not modify it."""
    root = tmp_path_factory.mktemp("single")
    result = launch(root, "t", *SINGLE_OVERRIDES)
    return TrainedRun(root, root / "digits" / "t", result)
