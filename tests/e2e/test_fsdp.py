"""Sharded training (``train.strategy = "fsdp"``, FSDP2) on real runs: gloo on CPU.

- FSDP at 2 ranks reaches DDP's accuracy on digits.
- An FSDP run stopped mid-epoch and resumed in fresh ranks ends bitwise equal to the
  uninterrupted run (weights, EMA, loss/LR trace); so does one whose rank was killed
  during a save (resumed with ``pimm resume`` from the last intact checkpoint).
- Resharding: the 2-rank FSDP checkpoint loads at 1 and 3 ranks, a 1-rank FSDP
  checkpoint at 2, a DDP checkpoint under FSDP and an FSDP one under DDP, each with the
  model, optimizer state and EMA exactly as saved.
- Export and warm start from an FSDP run, also one that keeps its weights only in the
  DCP shards (``checkpoint.gather_weights = false``), in this process (``pimm_here``).
- ``train.compile = true``: resumed exactly; no ``_orig_mod.`` in any file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from _helpers import REPO, TORCHRUN, clean_env, describe, hang_s, launch, pimm, pimm_here, read_json, read_jsonl
from _resume_driver import BASE, run_job

DRIVER = Path(__file__).with_name("_resume_driver.py")
STOP = 30  # epoch 1, iter 7 at 2 ranks (23 steps per epoch)
COMMON = ["train.epochs=2", "checkpoint.every_steps=10", "ema.enabled=true"]
FSDP = [*COMMON, "train.strategy=fsdp", 'train.blocks=["Linear"]', "train.activation_checkpointing=true"]
DDP = [*COMMON, "train.strategy=ddp"]


def _torchrun(jobs: list[dict], jobs_file: Path, nproc: int = 2, background: bool = False):
    jobs_file.write_text(json.dumps(jobs))
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc),
           str(DRIVER), str(jobs_file)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc if background else _wait(proc)


def _wait(proc: subprocess.Popen, timeout: float = 300) -> None:
    try:
        out, err = proc.communicate(timeout=hang_s(timeout))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-5000:]}"


def _in_process(*args, **kwargs):
    """A one-rank job here; FSDP made a one-rank process group: leave none behind."""
    from pimm_core.process import dist

    try:
        return run_job(*args, **kwargs)
    finally:
        dist.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fsdp")
    first = [
        {"run_dir": str(root / "full"), "overrides": [*FSDP, "checkpoint.keep_best=2"],
         "full_dump": str(root / "dump-full")},
        {"run_dir": str(root / "cut"), "overrides": FSDP, "stop_at": STOP, "full_dump": str(root / "dump-cut")},
        {"run_dir": str(root / "ddp-cut"), "overrides": DDP, "stop_at": STOP, "full_dump": str(root / "dump-ddp-cut")},
        {"run_dir": str(root / "ddp-full"), "overrides": DDP},
        {"run_dir": str(root / "sharded"), "overrides": [*FSDP, "train.epochs=1", "checkpoint.gather_weights=false"],
         "full_dump": str(root / "dump-sharded")},
    ]
    job = _torchrun(first, root / "first.json", background=True)
    try:  # meanwhile, here: a one-rank FSDP run stopped mid-epoch (for 1 -> 2)
        _in_process(root / "one", FSDP, stop_at=50, full_dump=root / "dump-one")
    except BaseException:
        job.kill()
        job.communicate()
        raise
    _wait(job)
    for src, dst in (("cut", "to1"), ("cut", "to3"), ("cut", "to-ddp"), ("ddp-cut", "to-fsdp"), ("one", "to2")):
        shutil.copytree(root / src, root / dst)
    only_load = {"max_steps": 1, "checkpoint": False}
    second = [
        {"run_dir": str(root / "cut"), "overrides": FSDP, "resume_from": str(root / "cut" / "model" / "last")},
        {"run_dir": str(root / "to-ddp"), "overrides": DDP, "resume_from": str(root / "to-ddp" / "model" / "last"),
         "full_dump": str(root / "dump-to-ddp"), **only_load},
        {"run_dir": str(root / "to-fsdp"), "overrides": FSDP, "resume_from": str(root / "to-fsdp" / "model" / "last"),
         "full_dump": str(root / "dump-to-fsdp"), **only_load},
        {"run_dir": str(root / "to2"), "overrides": FSDP, "resume_from": str(root / "to2" / "model" / "last"),
         "full_dump": str(root / "dump-to2"), **only_load},
    ]
    job = _torchrun(second, root / "second.json", background=True)
    try:
        _in_process(root / "to1", FSDP, resume_from=root / "to1" / "model" / "last", full_dump=root / "dump-to1",
                    max_steps=1, checkpoint=False)
    except BaseException:
        job.kill()
        job.communicate()
        raise
    _wait(job)
    _torchrun([{"run_dir": str(root / "to3"), "overrides": FSDP, "resume_from": str(root / "to3" / "model" / "last"),
                "full_dump": str(root / "dump-to3"), **only_load}], root / "third.json", nproc=3)
    return root


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model" / "last" / "weights.pth", map_location="cpu", weights_only=True)


def _dump(root: Path, name: str) -> dict:
    return torch.load(root / f"dump-{name}.pt", map_location="cpu", weights_only=True)


def _differ(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Names of the tensors (nested dicts/lists) that are not bitwise equal, or missing on one side."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if ok else [prefix or "<root>"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{prefix}: keys {sorted(map(str, a.keys() ^ b.keys()))[:4]}"]
        return [d for k in a for d in _differ(a[k], b[k], f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{prefix}: lengths {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differ(x, y, f"{prefix}[{i}]")]
    return [] if a == b else [f"{prefix}: {a!r} != {b!r}"]


def _train_trace(run: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"]) for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "train"]


def _best(run: Path) -> float:
    return max(r["acc"] for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "val")


def test_fsdp_reaches_the_accuracy_of_ddp(runs):
    fsdp, ddp = _best(runs / "full"), _best(runs / "ddp-full")
    assert fsdp > 0.75 and abs(fsdp - ddp) <= 0.02, (fsdp, ddp)  # 2 epochs; chance is 0.1
    weights = _weights(runs / "full")
    assert not [k for k in weights["state_dict"] if "_orig_mod" in k or "_checkpoint_wrapped" in k or
                k.startswith("module.")]
    assert read_json(runs / "full" / "model" / "last" / "manifest.json")["strategy"] == "fsdp"


def test_stopped_fsdp_run_resumes_bitwise(runs):
    full, cut = _weights(runs / "full"), _weights(runs / "cut")
    assert _differ(full["state_dict"], cut["state_dict"]) == []
    assert _differ(full["ema_state_dict"], cut["ema_state_dict"]) == []
    trace = {}
    for step, loss, lr in _train_trace(runs / "cut"):
        trace.setdefault(step, (loss, lr))  # the interrupted session's steps up to STOP, then the resumed ones
    assert sorted(trace.items()) == [(s, (loss, lr)) for s, loss, lr in _train_trace(runs / "full")]
    start = read_json(runs / "cut" / "provenance.json")["starts"][-1]
    assert (start["kind"], start["step"], start["policy"], start["exact"]) == ("resume", STOP, "same", True)


@pytest.mark.parametrize("loaded,saved", [("to1", "cut"), ("to3", "cut"), ("to2", "one"),
                                          ("to-ddp", "cut"), ("to-fsdp", "ddp-cut")])
def test_resharded_state_is_exact(runs, loaded, saved):
    """Model, optimizer state (by parameter name) and EMA as the saving run held them, at
    another world size or under the other strategy."""
    got, want = _dump(runs, loaded), _dump(runs, saved)
    if loaded in ("to1", "to3", "to2"):  # another world size: another number of steps per epoch, so
        for group in (*got["optim"]["param_groups"], *want["optim"]["param_groups"]):  # the LR follows the
            group.pop("lr")  # new horizon (README, "The LR schedule after a resume")
    for part in ("model", "optim", "ema"):
        assert _differ(got[part], want[part]) == [], part
    if loaded in ("to1", "to3", "to2"):  # the world-size policy row: the saved epoch restarts
        assert got["state"]["epoch"] == want["state"]["epoch"] and got["state"]["iter"] == 0
    else:  # a strategy change alone continues from the saved iteration
        assert (got["state"]["global_step"], got["state"]["iter"]) == (want["state"]["global_step"],
                                                                      want["state"]["iter"])


def test_fsdp_run_killed_during_a_save_resumes_bitwise(runs, tmp_path):
    """Rank 1 is SIGKILLed inside the third save (its DCP shard written, nothing published);
    ``pimm resume`` continues from the last intact checkpoint and ends where the
    uninterrupted run ended."""
    env = {**clean_env(), "PIMM_FAILPOINT": "standard.dcp_written@3", "PIMM_FAILPOINT_RANK": "1"}
    killed = launch(tmp_path, "killed", *BASE, *FSDP, nproc=2, env=env)
    assert killed.returncode != 0, describe(killed)
    run = next(tmp_path.glob("*/killed"))
    assert read_json(run / "model" / "last" / "manifest.json")["step"] == 20
    resumed = pimm("resume", str(run), timeout=300)
    assert resumed.returncode == 0, describe(resumed)
    assert _differ(_weights(runs / "full"), _weights(run)) == []


def test_export_and_warm_start_from_fsdp_runs(runs, tmp_path):
    """From gathered weights.pth, and from a run that keeps its weights only in trainer.dcp/."""
    from safetensors.torch import load_file

    done = pimm_here("export", "last", str(tmp_path / "full"), "--run-dir", str(runs / "full"))
    assert done.returncode == 0, describe(done)
    assert _differ(load_file(tmp_path / "full" / "model.safetensors"), _dump(runs, "full")["model"]) == []

    sharded = runs / "sharded"
    assert not (sharded / "model" / "last" / "weights.pth").exists()
    done = pimm_here("export", "last", str(tmp_path / "out"), "--run-dir", str(sharded), "--weights", "ema")
    assert done.returncode == 0, describe(done)
    want = _dump(runs, "sharded")
    assert _differ(load_file(tmp_path / "out" / "model.safetensors"), want["ema"]) == []
    warm = launch(tmp_path, "warm", "train.epochs=1", "train.max_steps=1", f"train.weight={sharded}", here=True)
    assert warm.returncode == 0, describe(warm)
    report = read_json(next(tmp_path.glob("*/warm")) / "provenance.json")["starts"][-1]["warm_start"]
    assert report["loaded_params"] == report["model_params"] > 0 and report["missing"] == report["mismatched"] == 0, \
        report


def test_fsdp_keeps_the_best_evaluations_with_gathered_weights(runs, tmp_path):
    """checkpoint.keep_best = 2 at 2 ranks, sharded: both evaluations kept (the gather every rank
    joins); the one at the last step holds the run's final weights."""
    from safetensors.torch import load_file

    model = runs / "full" / "model"
    evals = [r["step"] for r in read_jsonl(runs / "full" / "metrics.jsonl") if r["split"] == "val"]
    assert sorted(p.name for p in model.glob("best_*.pth")) == sorted(f"best_{s}.pth" for s in evals), evals
    last = max(evals)
    done = pimm_here("export", f"best_{last}", str(tmp_path / "best"), "--run-dir", str(runs / "full"))
    assert done.returncode == 0, describe(done)
    assert _differ(load_file(tmp_path / "best" / "model.safetensors"), _dump(runs, "full")["model"]) == []


def test_compiled_run_resumes_exactly(tmp_path):
    compiled = ["train.compile=true", "train.epochs=2", "train.max_steps=60"]
    _in_process(tmp_path / "full", compiled)
    _in_process(tmp_path / "cut", compiled, stop_at=50)
    _in_process(tmp_path / "cut", compiled, resume_from=tmp_path / "cut" / "model" / "last")
    full, cut = _weights(tmp_path / "full"), _weights(tmp_path / "cut")
    assert not [k for k in full["state_dict"] if "_orig_mod" in k]
    assert _differ(full, cut) == []
