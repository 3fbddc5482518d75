"""Per-sample accumulation windows at 2 ranks (torchrun, gloo), DDP and FSDP: 14 samples, each rank's
7 cut into micro-batches of 4 and 3, one window, one optimizer step (SGD at lr 1, no clipping, no
decay) — the weights after it equal those after one full-batch step on all 14 within 1e-6. The
language-modeling case has right-padded rows of different lengths: the step divides by the real
target tokens of the whole window. (The 1-rank cases and the mean-of-means contrast:
tests/unit/test_window_average.py.)

The four runs are the jobs of one ``torchrun --nproc-per-node 2`` (this file is its script, see the
end): one start of two ranks for all four instead of a ``pimm launch`` each, ~3 CPU-s per rank start
saved on a 2-core machine; each job is a ``Trainer`` of its own config in the one process group
(``pimm launch`` of 2 ranks runs the same ``Trainer`` in each rank)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from _helpers import REPO, TORCHRUN, clean_env, describe, hang_s, read_jsonl

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


TASKS, STRATEGIES = ("classification", "language_modeling"), ("ddp", "fsdp")


def _job(tmp_path: Path, task: str, strategy: str) -> dict:
    """The config (written to ``tmp_path``), run directory and overrides of one case."""
    (tmp_path / "userpkg").symlink_to(USERPKG)  # beside the config: found through its directory
    text = (CLASSIFICATION if task == "classification" else LANGUAGE) + COMMON
    config = tmp_path / "window.toml"
    # [data] batch_size: 7 samples per rank as micro-batches of 4 and 3
    config.write_text(text.replace("[data]\n", "[data]\nbatch_size = 4\nnum_workers = 0\n", 1))
    overrides = [f"train.strategy={strategy}"] + (['train.blocks=["Linear"]'] if strategy == "fsdp" else [])
    return {"config": str(config), "run_dir": str(tmp_path / "exp" / "w"), "overrides": overrides}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Every case trained at 2 ranks, by one torchrun: ``{(task, strategy): run directory}``."""
    root = tmp_path_factory.mktemp("window")
    jobs = {}
    for task in TASKS:
        for strategy in STRATEGIES:
            (root / f"{task}-{strategy}").mkdir()
            jobs[task, strategy] = _job(root / f"{task}-{strategy}", task, strategy)
    (root / "jobs.json").write_text(json.dumps(list(jobs.values())))
    r = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2",
                        __file__, str(root / "jobs.json")], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                       timeout=hang_s(400))
    assert r.returncode == 0, describe(r)
    return {case: Path(job["run_dir"]) for case, job in jobs.items()}


def _weights(run: Path) -> dict:
    return torch.load(run / "model" / "last" / "weights.pth", map_location="cpu", weights_only=True)["state_dict"]


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
def test_one_window_over_two_ranks_steps_as_the_full_batch(runs, task, strategy):
    run = runs[task, strategy]
    weights = _weights(run)
    expected, expected_loss = _full_batch_step(task)
    assert set(expected) <= set(weights)
    for name, value in expected.items():
        assert (weights[name] - value).abs().max().item() < 1e-6, name
    step, = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("split") == "train"]
    assert step["step"] == 1 and step["loss"] == pytest.approx(expected_loss, abs=1e-6)  # per counted item, all ranks


def _train(jobs_file: str) -> int:
    """Each rank under torchrun: train every job of ``jobs_file`` in turn, in one process group."""
    from pimm_core import Trainer, load_config
    from pimm_core.process import dist
    from pimm_core.launch import setup_logging

    setup_logging(dist.env_world().is_main)
    try:
        for job in json.loads(Path(jobs_file).read_text()):
            config, run_dir = Path(job["config"]), Path(job["run_dir"])
            trainer = Trainer(load_config(config, job["overrides"]), run_dir=run_dir, config_path=config)
            trainer.train(checkpoint_dir=run_dir / "model")
    finally:
        dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(_train(sys.argv[1]))
