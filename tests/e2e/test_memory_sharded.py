"""The memory tier with sharded state (issue 35): FSDP2 and tensor parallel, 2 ranks, gloo on CPU.

Each rank keeps its own ``DTensor`` shards (and its buddy's) in shared memory; a restart at the same
world size loads rank r's copy into rank r's shards. Four real ``pimm launch --max-restarts 1`` runs,
two at a time: an uninterrupted FSDP run of the digits MLP and one whose rank 1 pauses at step 8 (a
fail point), loses its own copy of step 6 (this test removes it) and is ``kill -9``ed by this test
(its shards come back from the copy its buddy rank 0 kept); the same pair for the char LM under
``parallel.tp = 2`` (rank 1 paused at step 6, killed after both ranks hold their copies of step 4,
every rank reading its own copy). Each recovered run ends with weights bitwise equal to its
uninterrupted run's. On the old code both configs were refused (one ``error:`` line).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _helpers import DIGITS, REPO, clean_env, hang_s, memory_holds_only, memory_index, wait_while_running

CHARLM = REPO / "configs" / "charlm.toml"
FSDP = ("train.epochs=1", "model.hidden=16", "train.log_every_steps=5", "checkpoint.memory_every_steps=3",
        "checkpoint.every_epochs=1", "data.num_workers=0", "train.strategy=fsdp", "ema.enabled=true")
# the tiny char LM of test_tensor_parallel.py, 8 steps of 2 micro-batches; EMA on (charlm.toml)
TP = ("model.args.d_model=32", "model.args.n_layers=2", "model.args.n_heads=2", "model.args.dropout=0.0",
      "model.args.block_size=16", "data.args.block_size=16", "data.batch_size=8", "train.log_every_steps=1",
      "train.warmup_steps=2", "train.max_steps=8", "eval.batch_size=512", "data.num_workers=0",
      "checkpoint.memory_every_steps=2", "parallel.tp=2")
CASES = {"fsdp": (DIGITS, FSDP, 8, 6, "digits"), "tp": (CHARLM, TP, 6, 4, "charlm")}


def _start(root: Path, name: str, case: str, env: dict[str, str]) -> subprocess.Popen:
    config, overrides = CASES[case][:2]
    args = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(config), "--run.root", str(root),
            "--run.name", name, "--run.no-timestamp", "--nproc-per-node", "2", "--max-restarts", "1", "--", *overrides]
    return subprocess.Popen(args, cwd=REPO, env={**clean_env(), "PIMM_SHM_ROOT": str(root / "shm"), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _killed(root: Path, case: str, *remove: str) -> subprocess.Popen:
    """Rank 1 pauses at step ``pause``; once both ranks hold their copies of step ``copied``, the copies
    matching ``remove`` (globs under the run's shared memory) are deleted and rank 1 gets SIGKILL."""
    pause, copied, config_name = CASES[case][2:]
    name = f"{case}-killed"
    gate = root / f"gate-{name}"
    gate.mkdir()
    proc = _start(root, name, case, {"PIMM_FAILPOINT_RANK": "1", "PIMM_FAILPOINT_RESTART": "0",
                                     "PIMM_FAILPOINT": f"memory.step@{pause}=pause", "PIMM_FAILPOINT_DIR": str(gate)})
    run = root / config_name / name
    wait_while_running(lambda: (gate / f"memory.step.reached.{pause}").exists(), "rank 1 paused", proc, timeout=240)
    wait_while_running(lambda: memory_holds_only(run, root / "shm", name, copied, remove),
                       f"both ranks' copies of step {copied}, and no older one", proc)
    shm = next((root / "shm").glob(f"pimm-{name}-*"))
    (root / f"{case}-copy.pt").write_bytes((shm / "0" / f"step_{copied}" / "rank_0.pt").read_bytes())
    doomed = [p for pattern in remove for p in shm.glob(pattern)]
    assert len(doomed) == 2 * len(remove), doomed  # each copy with its sidecar
    for path in doomed:
        path.unlink()
    os.kill(memory_index(run, 1)["pid"], signal.SIGKILL)
    return proc


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=hang_s(400))
    assert proc.returncode == 0, out[-5000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("memsharded")
    (root / "shm").mkdir()
    out = {"root": root}
    for case, remove in (("fsdp", ("1/step_*/rank_1.*",)), ("tp", ())):
        ref = _start(root, f"{case}-ref", case, {})
        killed = _killed(root, case, *remove)
        out[f"{case}-ref"], out[f"{case}-killed"] = _finish(ref), _finish(killed)
    return out


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model" / "last" / "weights.pth", weights_only=True)["state_dict"]


@pytest.mark.parametrize("case, how", [("fsdp", "rank 1 from its buddy rank 0; nothing on disk"),
                                       ("tp", "every rank from its own copy; nothing on disk")])
def test_a_killed_rank_of_a_sharded_run_is_recovered_from_memory_bitwise(runs, case, how):
    step, config_name = CASES[case][3:]
    run = runs["root"] / config_name / f"{case}-killed"
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "finished"
    assert status["recovery"]["tier"] == "memory" and status["recovery"]["step"] == step
    line = f"recovered from memory at step {step} (restart 1; {how})"
    log = (run / "train.log").read_text()
    assert log.count(line) == 1, log[-4000:]
    prov = json.loads((run / "provenance.json").read_text())
    (entry,) = [e for e in prov["starts"] if e.get("kind") == "recovery"]
    assert entry["tier"] == "memory" and entry["checkpoint_step"] == step
    assert entry["from_buddy"] == ({"1": 0} if case == "fsdp" else {})
    # rank 0's copy holds its own shards of the sharded parameters (half of dim 0 here), not whole tensors
    copy = torch.load(runs["root"] / f"{case}-copy.pt", weights_only=True)
    shards = {k: v for k, v in copy["model"].items() if isinstance(v, dict) and "Shard" in v["placements"]}
    assert shards and all(list(v["__dtensor_local__"].shape) != v["shape"] for v in shards.values())
    assert sum(v["__dtensor_local__"].numel() for v in shards.values()) * 2 == \
        sum(torch.Size(v["shape"]).numel() for v in shards.values())
    ref = runs["root"] / config_name / f"{case}-ref"
    a, b = _weights(ref), _weights(run)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "the recovered run left the uninterrupted trajectory"
    assert list((runs["root"] / "shm").iterdir()) == []  # (both launches of the case ended: nothing left)
