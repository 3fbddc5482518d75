"""Elastic exactness under the global data order (``data.order = "global"``, docs/elastic.md):
a run stopped mid-epoch at 2 ranks and resumed at 1, one stopped at 1 and resumed at 2, and one
stopped at 2 ranks, resumed at 3, stopped again in the next epoch and resumed at 1, continue the
uninterrupted 2-rank run — every sample of every epoch trained exactly once across the stops (the
objective records the indices), the same LR at every step, the loss at every step and the final
weights and EMA within 1e-5 (relative) — with dropout on, EMA, a random augmentation drawn from
``pimm_core.data_rng`` (seed, epoch, index), the per-sample window average, DDP (gloo, torchrun);
an FSDP run stopped at 2 ranks and resumed at 1, and a 2 -> 1 run whose loaders have 2 workers,
against the same DDP run (whose loaders have none); a 2-rank run stopped and resumed at 2 ranks
matches it bit for bit. The resume names its policy row (``global_order``) in provenance.json and ``pimm checkpoints diff``
names it before the resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from pimm_core.topology import ROWS

from _helpers import REPO, clean_env, pimm, read_json, read_jsonl
from _resume_driver import run_job

DRIVER = Path(__file__).with_name("_resume_driver.py")
TRAIN = 144
# 24 samples a step in micro-batches of 4: 6 micro-batches, a window of 6, 3 or 2 at 1, 2 or 3 ranks
OVERRIDES = ["data.target=userpkg.data:indexed", f"data.args.train={TRAIN}", "data.args.val=32",
             "data.args.augment=true", "objective=userpkg.objective:seen_sum_ce", "model.hidden=32",
             "data.order=global", "train.global_batch=24", "data.batch_size=4", "train.epochs=2",
             "ema.enabled=true", "train.warmup_steps=3", "eval.metric=val/loss", "eval.mode=min"]
STEPS = 12  # 6 steps an epoch (144 samples, 24 a step), 2 epochs
STOP = 4  # mid-epoch 0
STOP_AGAIN = 8  # mid-epoch 1 (2 -> 3 -> 1)


def _torchrun(jobs: list[dict], jobs_file: Path, env: dict | None = None, nproc: int = 2) -> None:
    jobs_file.write_text(json.dumps(jobs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(DRIVER), str(jobs_file)]
    r = subprocess.run(cmd, cwd=REPO, env={**clean_env(), **(env or {})}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"


def _here(seen: Path, *args, **kwargs) -> None:
    """A one-rank job in this process, recording the samples it trains to ``seen``."""
    from pimm_core import dist

    os.environ["USERPKG_SEEN"] = str(seen)
    try:
        run_job(*args, **kwargs)
    finally:
        del os.environ["USERPKG_SEEN"]
        dist.shutdown()  # (FSDP makes a one-rank process group: leave none behind)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("elastic")
    sys.path.insert(0, str(Path(__file__).parent))  # userpkg, for the in-process jobs
    _torchrun([{"run_dir": str(root / "whole"), "overrides": OVERRIDES, "full_dump": str(root / "whole")}],
              root / "whole.json")
    # 2 -> 1: stopped by a callback after step 5 at 2 ranks, resumed here at 1
    _torchrun([{"run_dir": str(root / "two_one"), "overrides": OVERRIDES, "stop_at": STOP}], root / "a.json",
              env={"USERPKG_SEEN": str(root / "two_one.seen")})
    diff = pimm("checkpoints", "diff", str(root / "two_one"), "--nproc-per-node", "1")  # what the resume will do
    (root / "two_one.diff").write_text(diff.stdout + diff.stderr)
    _here(root / "two_one.seen", root / "two_one", OVERRIDES, resume_from=root / "two_one" / "model" / "last",
          full_dump=root / "two_one")
    # 1 -> 2
    _here(root / "one_two.seen", root / "one_two", OVERRIDES, stop_at=STOP)
    _torchrun([{"run_dir": str(root / "one_two"), "overrides": OVERRIDES,
                "resume_from": str(root / "one_two" / "model" / "last"), "full_dump": str(root / "one_two")}],
              root / "b.json", env={"USERPKG_SEEN": str(root / "one_two.seen")})
    # 2 -> 1 under FSDP (gradients reduce-scattered, state resharded through DCP), against the same DDP run
    fsdp = [*OVERRIDES, "train.strategy=fsdp", 'train.blocks=["Linear"]']
    _torchrun([{"run_dir": str(root / "fsdp_two_one"), "overrides": fsdp, "stop_at": STOP}], root / "c.json",
              env={"USERPKG_SEEN": str(root / "fsdp_two_one.seen")})
    _here(root / "fsdp_two_one.seen", root / "fsdp_two_one", fsdp,
          resume_from=root / "fsdp_two_one" / "model" / "last", full_dump=root / "fsdp_two_one")
    # 2 -> 3 -> 1: stopped after step 4 at 2 ranks, resumed at 3 and stopped after step 8 (epoch 1), resumed at 1
    seen = {"USERPKG_SEEN": str(root / "two_three_one.seen")}
    _torchrun([{"run_dir": str(root / "two_three_one"), "overrides": OVERRIDES, "stop_at": STOP}], root / "d.json",
              env=seen)
    _torchrun([{"run_dir": str(root / "two_three_one"), "overrides": OVERRIDES, "stop_at": STOP_AGAIN,
                "resume_from": str(root / "two_three_one" / "model" / "last")}], root / "e.json", env=seen, nproc=3)
    _here(root / "two_three_one.seen", root / "two_three_one", OVERRIDES,
          resume_from=root / "two_three_one" / "model" / "last", full_dump=root / "two_three_one")
    # 2 -> 2 in one launch: the world size does not change (the `same` row, bitwise)
    _torchrun([{"run_dir": str(root / "two_two"), "overrides": OVERRIDES, "stop_at": STOP},
               {"run_dir": str(root / "two_two"), "overrides": OVERRIDES,
                "resume_from": str(root / "two_two" / "model" / "last"), "full_dump": str(root / "two_two")}],
              root / "g.json", env={"USERPKG_SEEN": str(root / "two_two.seen")})
    # 2 -> 1 with 2 loader workers at each leg (the augmentation drawn in the workers)
    workers = [*OVERRIDES, "data.num_workers=2"]
    _torchrun([{"run_dir": str(root / "workers_two_one"), "overrides": workers, "stop_at": STOP}], root / "f.json",
              env={"USERPKG_SEEN": str(root / "workers_two_one.seen")})
    _here(root / "workers_two_one.seen", root / "workers_two_one", workers,
          resume_from=root / "workers_two_one" / "model" / "last", full_dump=root / "workers_two_one")
    return root


def _seen(root: Path, name: str) -> list[int]:
    out: list[int] = []
    for rank_file in sorted(root.glob(f"{name}.seen.rank*")):
        out += [int(i) for line in rank_file.read_text().splitlines() for i in line.split()]
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


RESUMES = {"two_one": [STOP], "one_two": [STOP], "fsdp_two_one": [STOP], "two_three_one": [STOP, STOP_AGAIN],
           "workers_two_one": [STOP], "two_two": [STOP]}


@pytest.mark.parametrize("name", list(RESUMES))
def test_a_world_size_change_trains_every_sample_once_and_stays_on_the_trajectory(runs, name):
    counts = Counter(_seen(runs, name))
    assert set(counts) == set(range(TRAIN)) and set(counts.values()) == {2}  # 2 epochs, each sample once a epoch
    whole, resumed = torch.load(runs / "whole.pt", weights_only=False), torch.load(runs / f"{name}.pt",
                                                                                  weights_only=False)
    assert resumed["state"]["global_step"] == whole["state"]["global_step"] == STEPS
    for key, value in whole["model"].items():
        assert _relative(resumed["model"][key], value) < 1e-5, key
    for key, value in whole["ema"].items():
        assert _relative(resumed["ema"][key], value) < 1e-5, key
    trace = {r["step"]: r for r in read_jsonl(runs / "whole" / "metrics.jsonl") if r.get("split") == "train"}
    got = {r["step"]: r for r in read_jsonl(runs / name / "metrics.jsonl") if r.get("split") == "train"}
    assert sorted(got) == sorted(trace) == list(range(1, STEPS + 1))
    assert [got[s]["lr"] for s in trace] == [trace[s]["lr"] for s in trace]  # the LR trace, exactly
    for s in trace:
        assert got[s]["loss"] == pytest.approx(trace[s]["loss"], rel=1e-5), s
    resumes = [e for e in read_json(runs / name / "provenance.json")["starts"] if e.get("kind") == "resume"]
    assert [e["step"] for e in resumes] == RESUMES[name]
    for resume in resumes:
        assert resume["policy"] == ("same" if name == "two_two" else "global_order")
        assert resume["replay_boundary"] is None
        assert resume["topology"]["data_order"] == "global"


def test_a_resume_at_the_same_world_size_is_bitwise(runs):
    whole, resumed = (torch.load(runs / f"{n}.pt", weights_only=False) for n in ("whole", "two_two"))
    for part in ("model", "ema"):
        for key, value in whole[part].items():
            assert torch.equal(resumed[part][key], value), (part, key)
    trace = [(r["step"], r["loss"], r["lr"]) for r in read_jsonl(runs / "whole" / "metrics.jsonl")
             if r.get("split") == "train"]
    assert [(r["step"], r["loss"], r["lr"]) for r in read_jsonl(runs / "two_two" / "metrics.jsonl")
            if r.get("split") == "train"] == trace


def test_checkpoints_diff_names_the_global_order_row_before_the_resume(runs):
    text = (runs / "two_one.diff").read_text()
    assert f"policy: {ROWS['global_order']}" in text, text
    assert "replay boundary: none" in text and "at step 4, epoch 0, iter 24" in text, text
