"""Per-sample accumulation windows at 2 ranks (torchrun, gloo), DDP and FSDP: 14 samples, each rank's
7 cut into micro-batches of 4 and 3, one window, one optimizer step (SGD at lr 1, no clipping, no
decay) — the weights after it equal those after one full-batch step on all 14 within 1e-6. The
language-modeling case has right-padded rows of different lengths: the step divides by the real
target tokens of the whole window. (The 1-rank cases and the mean-of-means contrast:
tests/unit/test_window_average.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from _helpers import describe, launch, read_jsonl

USERPKG = Path(__file__).resolve().parent / "userpkg"

CLASSIFICATION = """\
objective = "classification"
[data]
target = "userpkg.data:indexed"
[data.args]
train = 14
val = 6
[model]
target = "pimm_core.models:mlp"
[model.args]
hidden = 16
dropout = 0.0
"""

LANGUAGE = """\
objective = "language_modeling"
[data]
target = "userpkg.window:padded"
[data.args]
train = 14
val = 4
[model]
target = "userpkg.window:tiny_lm"
"""

COMMON = """\
[train]
epochs = 1
max_steps = 1
lr = 1.0
weight_decay = 0.0
warmup_steps = 0
scheduler = "constant"
grad_clip = 1000000.0
grad_accum = 2
seed = 3
log_every_steps = 1
[optimizer]
name = "SGD"
[eval]
every_epochs = 0
metric = "val/loss"
mode = "min"
"""


def _run(tmp_path: Path, task: str, strategy: str) -> tuple[Path, dict]:
    (tmp_path / "userpkg").symlink_to(USERPKG)  # beside the config: found through its directory
    text = (CLASSIFICATION if task == "classification" else LANGUAGE) + COMMON
    config = tmp_path / "window.toml"
    # [data] batch_size: 7 samples per rank as micro-batches of 4 and 3
    config.write_text(text.replace("[data]\n", "[data]\nbatch_size = 4\nnum_workers = 0\n", 1))
    overrides = [f"train.strategy={strategy}"] + (['train.blocks=["Linear"]'] if strategy == "fsdp" else [])
    r = launch(tmp_path / "exp", "w", *overrides, nproc=2, config=config, timeout=400)
    assert r.returncode == 0, describe(r)
    run = next((tmp_path / "exp").glob("*/w"))
    weights = torch.load(run / "model" / "last" / "weights.pth", map_location="cpu", weights_only=True)["state_dict"]
    return run, weights


def _full_batch_step(task: str) -> tuple[dict, float]:
    """The reference: the same initial weights, one SGD step at lr 1 on the mean loss of all 14 samples."""
    import sys

    sys.path.insert(0, str(USERPKG.parent))
    torch.manual_seed(3)  # the trainer seeds train.seed before building the model
    if task == "classification":
        from pimm_core.models import mlp
        from userpkg.data import indexed

        model = mlp(hidden=16, dropout=0.0)
        train, _ = indexed(14, 6)
        x, y = train.x, train.y
        loss = F.cross_entropy(model(x), y)
    else:
        from userpkg.window import padded, tiny_lm

        model = tiny_lm()
        train, _ = padded(14, 4)
        targets = train.ids[:, 1:].masked_fill(train.mask[:, 1:] == 0, -100)
        assert 0 < int((targets != -100).sum()) < targets.numel()  # padding in the window
        loss = F.cross_entropy(model(train.ids[:, :-1]).flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    with torch.no_grad():
        return {k: (p - p.grad).detach() for k, p in model.named_parameters()}, loss.item()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("task", ["classification", "language_modeling"])
def test_one_window_over_two_ranks_steps_as_the_full_batch(tmp_path, task, strategy):
    run, weights = _run(tmp_path, task, strategy)
    expected, expected_loss = _full_batch_step(task)
    assert set(expected) <= set(weights)
    for name, value in expected.items():
        assert (weights[name] - value).abs().max().item() < 1e-6, name
    step, = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("split") == "train"]
    assert step["step"] == 1 and step["loss"] == pytest.approx(expected_loss, abs=1e-6)  # per counted item, all ranks
