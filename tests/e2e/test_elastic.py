"""Elastic exactness under the global data order (``data.order = "global"``, docs/elastic.md):
a run stopped mid-epoch at 2 ranks and resumed at 1, one stopped at 1 and resumed at 2, and one
stopped at 2 ranks, resumed at 3, stopped again in the next epoch and resumed at 1, continue the
uninterrupted 2-rank run — every sample of every epoch trained exactly once across the stops (the
objective records the indices), the same LR at every step, the loss at every step and the final
weights and EMA within 1e-5 (relative) — with dropout on, EMA, a random augmentation drawn from
``pimm_core.data.rng`` (seed, epoch, index), the per-sample window average, DDP (gloo, torchrun);
the same three under FSDP, and a 2 -> 1 run whose loaders have 2 workers, against the same DDP
run (whose loaders have none); a 2-rank run stopped and resumed at 2 ranks matches it bit for bit
(after other runs in the same processes). The resume names its policy row (``global_order``) in
provenance.json and ``pimm checkpoints diff`` names it before the resume. A model with BatchNorm
resumed 2 -> 1 warns (train.log, provenance.json) that its running statistics are not the run's,
and they are not, while its weights stay on the trajectory.

The legs share launches: one 2-rank torchrun for every 2-rank leg, one 3-rank torchrun, the
one-rank legs in this process (``_resume_driver.py`` runs a list of jobs, each its own
``USERPKG_SEEN``)"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from pimm_core.run.topology import ROWS

from _helpers import REPO, TORCHRUN, clean_env, pimm, pimm_here, read_json, read_jsonl
from _resume_driver import run_job, set_env

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


FSDP = [*OVERRIDES, "train.strategy=fsdp", 'train.blocks=["Linear"]']
WORKERS = [*OVERRIDES, "data.num_workers=2"]  # 2 loader workers at each leg (the augmentation drawn in them)
# userpkg.nets:tied_bn: Linear -> BatchNorm1d -> ReLU -> Dropout, a head tied to an embedding
BN = [*OVERRIDES, "model.target=userpkg.nets:tied_bn", "model.args.width=32", "model.args.dropout=0.3"]


def _torchrun(jobs: list[dict], jobs_file: Path, nproc: int) -> None:
    """One launch at ``nproc`` ranks running ``jobs`` one after the other (each its own USERPKG_SEEN)."""
    jobs_file.write_text(json.dumps(jobs))
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc),
           str(DRIVER), str(jobs_file)]
    r = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"


def _here(jobs: list[dict]) -> None:
    """One-rank jobs in this process, each with its own USERPKG_SEEN."""
    from pimm_core.process import dist

    for job in jobs:
        restore = set_env(job.pop("env"))
        try:
            run_job(**job)
        finally:
            restore()
            dist.shutdown()  # (FSDP makes a one-rank process group: leave none behind)


def _leg(root: Path, name: str, overrides: list[str], stop_at: int | None = None, resume: bool = False) -> dict:
    """A leg of run ``name``: stopped after ``stop_at`` (a checkpoint in model/last) or, without it,
    trained to the end and dumped whole to ``<name>.pt``; ``resume``: from that run's model/last."""
    job = {"run_dir": str(root / name), "overrides": overrides, "env": {"USERPKG_SEEN": str(root / f"{name}.seen")}}
    if stop_at is not None:
        job["stop_at"] = stop_at
    else:
        job["full_dump"] = str(root / name)
    if resume:
        job["resume_from"] = str(root / name / "model" / "last")
    return job


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every leg at one world size that can run then, in one launch: the one-rank legs in this
    process, one 2-rank launch, one 3-rank launch, the last one-rank legs in this process."""
    root = tmp_path_factory.mktemp("elastic")
    sys.path.insert(0, str(Path(__file__).parent))  # userpkg, for the in-process jobs
    _here([_leg(root, "one_two", OVERRIDES, STOP), _leg(root, "fsdp_one_two", FSDP, STOP)])
    _torchrun([
        _leg(root, "whole", OVERRIDES),  # the reference: uninterrupted, 2 ranks, DDP, no loader workers
        *(_leg(root, n, o, STOP) for n, o in (("two_one", OVERRIDES), ("two_three_one", OVERRIDES),
                                               ("workers_two_one", WORKERS), ("fsdp_two_one", FSDP),
                                               ("fsdp_two_three_one", FSDP), ("bn_two_one", BN))),
        _leg(root, "one_two", OVERRIDES, resume=True), _leg(root, "fsdp_one_two", FSDP, resume=True),
        _leg(root, "bn_whole", BN),  # the BatchNorm model's reference
        # 2 -> 2 after every other job of the launch ran in these processes (each run seeds itself): bitwise
        _leg(root, "two_two", OVERRIDES, STOP), _leg(root, "two_two", OVERRIDES, resume=True),
    ], root / "two.json", nproc=2)
    diff = pimm("checkpoints", "diff", str(root / "two_one"), "--nproc-per-node", "1")  # what the resume will do
    (root / "two_one.diff").write_text(diff.stdout + diff.stderr)
    dry = pimm_here("resume", str(root / "bn_two_one"), "--dry-run", "--nproc-per-node", "1")  # says it before
    (root / "bn_two_one.dry").write_text(f"exit {dry.returncode}\n{dry.stdout}{dry.stderr}")
    # 2 -> 3 -> 1: resumed at 3 and stopped again after step 8 (epoch 1), then resumed at 1
    _torchrun([_leg(root, "two_three_one", OVERRIDES, STOP_AGAIN, resume=True),
               _leg(root, "fsdp_two_three_one", FSDP, STOP_AGAIN, resume=True)], root / "three.json", nproc=3)
    _here([_leg(root, n, o, resume=True) for n, o in (
        ("two_one", OVERRIDES), ("workers_two_one", WORKERS), ("fsdp_two_one", FSDP), ("bn_two_one", BN),
        ("two_three_one", OVERRIDES), ("fsdp_two_three_one", FSDP))])
    return root


def _seen(root: Path, name: str) -> list[int]:
    out: list[int] = []
    for rank_file in sorted(root.glob(f"{name}.seen.rank*")):
        out += [int(i) for line in rank_file.read_text().splitlines() for i in line.split()]
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


# each run's resumes: (step, saved world size -> world size)
RESUMES = {"two_one": [(STOP, 2, 1)], "one_two": [(STOP, 1, 2)], "two_three_one": [(STOP, 2, 3), (STOP_AGAIN, 3, 1)],
           "workers_two_one": [(STOP, 2, 1)], "fsdp_two_one": [(STOP, 2, 1)], "fsdp_one_two": [(STOP, 1, 2)],
           "fsdp_two_three_one": [(STOP, 2, 3), (STOP_AGAIN, 3, 1)], "two_two": [(STOP, 2, 2)]}


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
    assert [(e["step"], e["topology"]["saved_world_size"], e["topology"]["world_size"]) for e in resumes] \
        == RESUMES[name]
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


def test_a_batchnorm_model_resumed_at_another_world_size_says_its_running_statistics_are_not_the_runs(runs):
    """The warning is true: the weights stay on the uninterrupted 2-rank run's trajectory, the
    BatchNorm running statistics (rank 0's under DDP) do not."""
    counts = Counter(_seen(runs, "bn_two_one"))
    assert set(counts) == set(range(TRAIN)) and set(counts.values()) == {2}
    resume, = [e for e in read_json(runs / "bn_two_one" / "provenance.json")["starts"] if e.get("kind") == "resume"]
    assert resume["policy"] == "global_order" and resume["topology"]["saved_world_size"] == 2
    warning = "the model has BatchNorm running statistics (body.1): they follow the micro-batches rank 0 computed"
    bn = [w for w in resume["warnings"] if "BatchNorm" in w]
    assert len(bn) == 1 and bn[0].startswith(warning), resume["warnings"]
    assert f"warning: {warning}" in (runs / "bn_two_one" / "train.log").read_text()  # the log the user sees
    dry = (runs / "bn_two_one.dry").read_text()  # and `pimm resume --dry-run` said it before the resume
    assert dry.startswith("exit 0") and f"warning: {warning}" in dry, dry
    others = read_json(runs / "two_one" / "provenance.json")["starts"]  # (no BatchNorm: no such warning)
    assert not [w for e in others for w in e.get("warnings", []) if "BatchNorm" in w]
    whole, resumed = (torch.load(runs / f"{n}.pt", weights_only=False)["model"] for n in ("bn_whole", "bn_two_one"))
    stats = {k for k in whole if k.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")}
    assert stats == {f"body.1.{b}" for b in ("running_mean", "running_var", "num_batches_tracked")}
    # (body.0.bias feeds the BatchNorm, which subtracts the batch mean: its gradient is zero but for
    # rounding, which AdamW scales up to steps of lr; it differs ~5e-3 between any two orders of additions)
    for key in whole.keys() - stats - {"body.0.bias"}:
        assert _relative(resumed[key], whole[key]) < 1e-5, key
    # the statistics are rank 0's: 3 of each step's 6 micro-batches at 2 ranks, all 6 at 1
    assert int(whole["body.1.num_batches_tracked"]) == 3 * STEPS
    assert int(resumed["body.1.num_batches_tracked"]) == 3 * STOP + 6 * (STEPS - STOP)
    assert _relative(resumed["body.1.running_mean"], whole["body.1.running_mean"]) > 1e-3
