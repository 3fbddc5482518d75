"""Single-format retention runs after the pointers move: no ``step_*.pth`` is left that neither a
pointer nor ``checkpoint.keep_last`` keeps."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from _helpers import describe, launch
from pimm_core.checkpoint.formats.files import move_pointers, pointer_targets, prune_single, set_pointer

STEP_FILE = re.compile(r"^step_(\d+)\.pth$")


def _steps(model_dir: Path, *steps: int) -> None:
    for s in steps:
        (model_dir / f"step_{s}.pth").write_bytes(b"x")
        (model_dir / f"step_{s}.pth.json").write_text("{}")


def test_moving_best_off_an_old_file_prunes_it(tmp_path):
    _steps(tmp_path, 45, 90, 135)
    set_pointer(tmp_path, "best", "step_90.pth")
    set_pointer(tmp_path, "last", "step_135.pth")
    assert prune_single(tmp_path, 1, current="step_135.pth") == ["step_45.pth"]  # best keeps step_90
    move_pointers(tmp_path, ("best", "final"), "step_135.pth", keep_last=1)  # the end: best and final move
    assert sorted(os.listdir(tmp_path)) == ["best", "final", "last", "step_135.pth", "step_135.pth.json"]


def test_keep_last_zero_keeps_everything(tmp_path):
    _steps(tmp_path, 1, 2, 3)
    move_pointers(tmp_path, ("last",), "step_3.pth", keep_last=0)
    assert len([n for n in os.listdir(tmp_path) if STEP_FILE.match(n)]) == 3


def test_keep_last_1_run_leaves_no_file_that_nothing_keeps(tmp_path):
    """3 epochs with a save every 20 steps: at the end ``best`` (a new file at step 135) and then
    ``last``/``final`` (moved to it) leave step_120 unreferenced; it must be gone."""
    result = launch(tmp_path, "s", "train.epochs=3", "checkpoint_format=single", "checkpoint.keep_last=1",
                    "checkpoint.every_steps=20", "checkpoint.keep_iter=0", here=True)  # in this process
    assert result.returncode == 0, describe(result)
    model_dir = tmp_path / "digits" / "s" / "model"
    files = {n for n in os.listdir(model_dir) if STEP_FILE.match(n)}
    targets = pointer_targets(model_dir)
    newest = max(files, key=lambda n: int(STEP_FILE.match(n).group(1)))
    assert files == targets | {newest}, (sorted(files), sorted(targets))
    assert files == {"step_135.pth"}
