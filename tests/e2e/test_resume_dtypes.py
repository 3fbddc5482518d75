"""Resuming into a model whose dtypes differ from the checkpoint's is a decision, never an accident (issue 13).

A tiny digits run (4 optimizer steps, fp32) is saved in the ``standard`` and the ``single``
format; a new Trainer has its model cast to bf16 after it was built (its AdamW then keeps
bf16 moments) and resumes from it through the Python API:

- by default the resume is refused with one CheckpointError (exit code 2) naming the first
  tensors with their dtypes saved -> now and the fix; nothing is trained;
- with ``resume_strict_state = false`` it loads, casting, and the warning (log and
  provenance) names what was cast; the model and its optimizer state stay bf16.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from _api_runs import make_config, one_thread, pimm_logging, train
from _helpers import read_json
from pimm_core import Trainer
from pimm_core.errors import CheckpointError

FIRST = ("train.epochs=1", "train.max_steps=4", "eval.every_epochs=0", "train.log_every_steps=1")
FORMATS = ("standard", "single")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """format -> a run directory whose ``model/last`` is an fp32 checkpoint at step 4."""
    root = tmp_path_factory.mktemp("dtypes")
    out = {}
    with one_thread():
        for fmt in FORMATS:
            trainer = train(root / fmt, (*FIRST, f"checkpoint_format={fmt}"))
            assert trainer.state.global_step == 4
            out[fmt] = root / fmt
    return out


def resume_in_bf16(run: Path, fmt: str, strict: bool):
    """A new Trainer, model cast to bf16 after building (bf16 autocast so it can train), resumed from last."""
    overrides = [*FIRST, f"checkpoint_format={fmt}", "train.max_steps=6", "train.amp=bf16",
                 f"resume_strict_state={str(strict).lower()}"]
    with one_thread(), pimm_logging() as lines:
        trainer = Trainer(make_config(overrides), run_dir=run)
        trainer.model.to(torch.bfloat16)  # the optimizer holds the same (now bf16) parameters
        trainer.test_log = lines
        trainer.train(checkpoint_dir=run / "model", resume_from=run / "model" / "last")
    return trainer


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_into_other_dtypes_is_refused_naming_them(saved, tmp_path, fmt):
    run = tmp_path / fmt
    shutil.copytree(saved[fmt], run, symlinks=True)
    metrics = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError) as e:
        resume_in_bf16(run, fmt, strict=True)
    message = str(e.value)
    assert e.value.exit_code == 2 and "\n" not in message, message
    assert re.search(r"saved -> now: float32 -> bfloat16: \S+\.(weight|bias), ", message), message
    assert "build the model in the saved dtype" in message and "resume_strict_state = false" in message, message
    assert "model" in message and str(run / "model") in message, message
    assert (run / "metrics.jsonl").read_bytes() == metrics  # nothing trained


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_with_strict_state_off_casts_with_a_warning(saved, tmp_path, fmt):
    run = tmp_path / fmt
    shutil.copytree(saved[fmt], run, symlinks=True)
    trainer = resume_in_bf16(run, fmt, strict=False)
    assert trainer.state.global_step == 6
    warnings = [m for level, m in trainer.test_log if level == "WARNING" and "cast " in m]
    assert len(warnings) == 1 and "float32 -> bfloat16" in warnings[0] and "resume_strict_state=false" in warnings[0], \
        trainer.test_log
    assert "optim/state/" in warnings[0] and "exp_avg" in warnings[0], warnings[0]  # optimizer state is named too
    entry = read_json(run / "provenance.json")["starts"][-1]
    assert entry["kind"] == "resume" and any("float32 -> bfloat16" in w for w in entry["warnings"]), entry
    params = list(trainer.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert all(trainer.optimizer.state[p]["exp_avg"].dtype == torch.bfloat16 for p in params)


def test_same_dtypes_resume_has_no_cast_warning(saved, tmp_path):
    run = tmp_path / "standard"
    shutil.copytree(saved["standard"], run, symlinks=True)
    with one_thread():
        trainer = train(run, (*FIRST, "checkpoint_format=standard", "train.max_steps=5"),
                        resume_from=run / "model" / "last")
    assert trainer.state.global_step == 5
    assert not [m for _, m in trainer.test_log if "cast " in m and "dtype" in m]
