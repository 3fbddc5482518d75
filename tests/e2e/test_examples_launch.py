"""The shipped examples (``examples/``, ``configs/charlm.toml``, ``configs/digits_aug.toml``)
train and evaluate through ``pimm launch``, for a few optimizer steps each.

Their full runs (the numbers the README states) take minutes; these check that the
configs, the targets they name and the objectives still fit together: the run ends,
evaluates the whole validation split with finite metrics and publishes a checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from _helpers import REPO, describe, launch, read_json, read_jsonl

STEPS = 3

# config, extra overrides, the validation metrics its objective reports; charlm's config
# trains in float32 (bf16 is slow on AVX2-only CPUs), so its bf16 autocast path runs here
# (over a small validation split, to keep it quick)
EXAMPLES = {
    "charlm": ("charlm.toml", ['train.amp="bf16"', "data.args.val_fraction=0.02"], {"loss", "perplexity"}),
    "digits_aug": ("digits_aug.toml", [], {"loss", "acc"}),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_trains_and_evaluates(tmp_path: Path, name: str) -> None:
    config, overrides, metrics = EXAMPLES[name]
    r = launch(tmp_path, "smoke", f"train.max_steps={STEPS}", "train.log_every_steps=1", *overrides,
               config=REPO / "configs" / config, timeout=120)
    assert r.returncode == 0, describe(r)
    run = tmp_path / name / "smoke"
    rows = read_jsonl(run / "metrics.jsonl")
    train = [row for row in rows if row["split"] == "train"]
    val = [row for row in rows if row["split"] == "val"]
    assert [row["step"] for row in train] == list(range(1, STEPS + 1))
    assert all(math.isfinite(row["loss"]) for row in train)
    assert len(val) == 1 and val[0]["step"] == STEPS, val
    assert metrics <= set(val[0]), val[0]
    assert all(math.isfinite(val[0][m]) for m in metrics), val[0]
    if name == "charlm":  # perplexity is exp of the mean token loss, not a mean of per-batch exps
        assert val[0]["perplexity"] == pytest.approx(math.exp(val[0]["loss"]), rel=1e-6)
    assert read_json(run / "status.json")["state"] == "finished"
    assert (run / "model" / "last").exists()
