"""Session fixtures: one tiny real training run, shared by several test files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from _helpers import REPO, clean_env, launch_args

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


@pytest.fixture(scope="session", autouse=True)
def _trained_run_started(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Start ``trained_run``'s launch as the session starts, when a collected test uses it: it
    trains in the background, on the core that the one-process tests before it leave idle."""
    if not any("trained_run" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None
        return
    root, logs = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("single-output")
    with open(logs / "stdout", "w") as out, open(logs / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "pimm_core.cli", *launch_args(root, "t", *SINGLE_OVERRIDES)],
                                cwd=REPO, env=clean_env(), stdout=out, stderr=err)
    try:
        yield root, proc, logs
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def trained_run(_trained_run_started) -> TrainedRun:
    """``pimm launch`` of configs/digits.toml with SINGLE_OVERRIDES, in a subprocess. Do not modify it."""
    root, proc, logs = _trained_run_started
    try:
        proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    result = subprocess.CompletedProcess(proc.args, proc.returncode, (logs / "stdout").read_text(),
                                         (logs / "stderr").read_text())
    return TrainedRun(root, root / "digits" / "t", result)
