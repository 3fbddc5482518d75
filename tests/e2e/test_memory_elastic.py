"""The memory tier across a world-size change (issue 35): a node lost for good, recovered from the
memory the surviving node holds, at the smaller world size.

Two torchrun agents on this machine play two nodes of one elastic launch (``pimm launch --nnodes 1:2
--nproc-per-node 1 --max-restarts 1``, c10d rendezvous on 127.0.0.1, one shared run directory), each
with its own shared memory (``$PIMM_SHM_ROOT``: its own ``/dev/shm``). The run uses the global data
order (``data.order = "global"``, ``train.global_batch = 64``) and takes a memory snapshot every 3
steps; its only disk checkpoint is the final one. Node A's agent hosts the rendezvous; node B's runs
rank 0 (its agent started first: torch numbers the nodes by their agents' pids). Node B's rank pauses
at step 8 (a fail point); once both ranks hold their copies of step 6, node B's agent and rank are
``kill -9``ed (its process group). Node A's rank fails in its next collective, its agent restarts it
alone (world size 2 -> 1), and it recovers step 6 from node A's shared memory: the copy of rank 0's
state it held as rank 0's buddy, read back there, checked, and applied with the global data order's
resume policy. It trains to the end. Against an uninterrupted one-rank run of the same global batch (in
this process): the weights within 1e-5. On the old code the restart found no memory step at the new
world size and, with no disk checkpoint, trained from step 0 (the test fails: no recovery in status.json).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _helpers import DIGITS, REPO, clean_env, free_port, hang_s, memory_index

# 1,438 training images, 64 a step in micro-batches of 32: 22 steps, a window of 1 at 2 ranks, 2 at 1
OVERRIDES = ("train.epochs=1", "model.hidden=16", "train.log_every_steps=5", "checkpoint.memory_every_steps=3",
             "checkpoint.every_epochs=1", "data.num_workers=0", "data.order=global", "train.global_batch=64",
             "data.batch_size=32")
NAME = "lost"
TIMEOUT = hang_s(180)



# Started before node A's agent, so that its process id is the lower one (torch's c10d rendezvous numbers the
# nodes by their agents' (host, pid)), it imports what the launcher needs, waits for node A to host the
# rendezvous, then runs `pimm launch` in this process: it joins within a second or two of node A, well inside
# the last call (RDZV_CONF) that decides the first world size.
_AFTER_A = """
import socket, sys, time
port, argv = int(sys.argv[1]), sys.argv[2:]
import torch.distributed.run, pimm_core.cli, pimm_core.launch
while True:
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            break
    time.sleep(0.05)
sys.argv = ["pimm", *argv]
pimm_core.cli.run()
"""
# The restart after node B's loss waits for its keep-alive beats to be missed (3 x 1 s here, 3 x 5 s by
# default), then for the last call for more nodes (10 s here, 30 s by default): about 14 s, not 43 s.
RDZV_CONF = "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"


def _agent(root: Path, node: str, port: int, env: dict[str, str], *, after_a: bool = False,
           overrides: tuple[str, ...] = OVERRIDES) -> subprocess.Popen:
    """One node's ``pimm launch`` in its own process session (a node's processes die together)."""
    args = [sys.executable, *(("-c", _AFTER_A, str(port)) if after_a else ("-m", "pimm_core.cli")), "launch",
            "--train.config", str(DIGITS), "--run.root", str(root), "--run.name", NAME, "--run.no-timestamp",
            "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "1", "--rdzv-conf", RDZV_CONF,
            "--", *overrides]
    (root / f"shm{node}").mkdir()
    out = open(root / f"node{node}.out", "w")
    return subprocess.Popen(args, cwd=REPO, env={**clean_env(), "PIMM_SHM_ROOT": str(root / f"shm{node}"), **env},
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)



def _wait_for(check, what: str, procs: list[subprocess.Popen], root: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not check():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            outs = "".join(f"--- {p.name}\n{p.read_text()[-3000:]}\n" for p in sorted(root.glob("node*.out")))
            pytest.fail(f"{'an agent ended' if time.monotonic() <= deadline else 'timed out'} waiting for {what}:\n"
                        f"{outs}")
        time.sleep(0.1)


def _lose_node_b(root: Path, overrides: tuple[str, ...]) -> tuple[Path, str, int, dict]:
    """The scenario of the module docstring: node B (rank 0) lost for good after both ranks' copies of
    step 6; node A's launch runs to its end. Returns the run, node A's output, node B's old rank and the
    copies each node held before the loss."""
    port, gate = free_port(), root / "gate"
    gate.mkdir()
    node_b = _agent(root, "B", port, {"PIMM_FAILPOINT": "memory.step@8=pause", "PIMM_FAILPOINT_DIR": str(gate),
                                      "PIMM_FAILPOINT_RESTART": "0"}, after_a=True,
                    overrides=overrides)  # rank 0: the lower pid
    node_a = _agent(root, "A", port, {}, overrides=overrides)  # hosts the rendezvous (its store): outlives node B
    run = root / "digits" / NAME
    procs = [node_a, node_b]
    _wait_for(lambda: (gate / "memory.step.reached.8").exists(), "node B's rank paused at step 8", procs, root)
    _wait_for(lambda: all((memory_index(run, r).get("own") or {}).get("step") == 6 and
                          (memory_index(run, r).get("buddy") or {}).get("step") == 6 for r in (0, 1)),
              "both ranks' copies of step 6", procs, root)
    (b_dir,) = [p for p in (root / "shmB").glob("pimm-*/*") if p.is_dir()]
    held_before = {node: sorted(p.relative_to(next((root / f"shm{node}").iterdir())).as_posix()
                                for p in (root / f"shm{node}").glob("pimm-*/*/step_6/rank_*.pt")) for node in "AB"}
    os.killpg(node_b.pid, signal.SIGKILL)  # node B is lost for good: its agent and its rank
    node_b.wait()
    try:
        code = node_a.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(node_a.pid, signal.SIGKILL)
        code = None
    out = (root / "nodeA.out").read_text()
    assert code == 0, out[-5000:]
    return run, out, int(b_dir.name), held_before


@pytest.fixture(scope="module")
def lost(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("memelastic")
    run, out, lost_rank, held_before = _lose_node_b(root, OVERRIDES)

    from pimm_core import Trainer, load_config  # the uninterrupted run: one rank, the same global batch

    reference = root / "reference"
    cfg = load_config(DIGITS, [*OVERRIDES, "checkpoint.memory_every_steps=0"])  # (snapshots change nothing)
    Trainer(cfg, run_dir=reference).train(checkpoint_dir=reference / "model")
    return {"root": root, "run": run, "out": out, "lost_rank": lost_rank, "held_before": held_before}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model" / "last" / "weights.pth", weights_only=True)["state_dict"]


def test_a_node_lost_for_good_is_recovered_from_memory_at_the_smaller_world_size(lost):
    run, lost_rank = lost["run"], lost["lost_rank"]
    kept_rank = 1 - lost_rank
    # before the loss each node held its rank's own copy and its buddy's (the other node's rank)
    assert lost["held_before"]["A"] == [f"{kept_rank}/step_6/rank_0.pt", f"{kept_rank}/step_6/rank_1.pt"]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 22
    recovery = status["recovery"]
    assert recovery.pop("message").startswith("recovered from memory at step 6 (restart 1; ")
    assert recovery == {"tier": "memory", "step": 6, "restart": 1, "saved_world_size": 2, "world_size": 1}
    prov = json.loads((run / "provenance.json").read_text())
    (entry,) = [e for e in prov["starts"] if e.get("kind") == "recovery"]
    assert entry["tier"] == "memory" and entry["checkpoint_step"] == 6 and entry["policy"] == "global_order"
    assert entry["topology"]["saved_world_size"] == 2 and entry["topology"]["world_size"] == 1
    assert entry["saved_world_size"] == 2 and entry["world_size"] == 1
    # the launch's --rdzv-conf is recorded with it (`pimm resume` starts the ranks with it again)
    assert {s["launch"].get("rdzv_conf") for s in prov["starts"] if "launch" in s} == {RDZV_CONF}
    # every rank loads old rank 0's state: node A held it as its own (it ran rank 0) or as rank 0's buddy
    kept = "its own" if kept_rank == 0 else "held by its buddy rank 1"
    line = (f"recovered from memory at step 6 (restart 1; world size 2 -> 1: every rank from rank 0's copy ({kept}); "
            "nothing on disk)")
    log = (run / "train.log").read_text()
    assert log.count(line) == 1, log[-4000:]
    assert entry["from_buddy"] == ({} if kept_rank == 0 else {"0": 1}) and entry["read_from"] == {"0": kept_rank}
    assert "world size changed 2 -> 1 under the global data order" in log
    assert "recovered from disk" not in log and "starts over" not in log
    # the uninterrupted trajectory, up to the order of floating-point additions
    ref, got = _weights(lost["root"] / "reference"), _weights(run)
    assert ref.keys() == got.keys()
    for k in ref:
        scale = ref[k].abs().max().clamp_min(1e-12)
        assert ((got[k] - ref[k]).abs().max() / scale).item() <= 1e-5, k


def test_the_lost_nodes_memory_is_removed_by_the_next_run_there_and_the_survivors_by_its_launcher(lost, monkeypatch):
    from pimm_core.checkpoint.memory.store import remove_stale

    root, run = lost["root"], lost["run"]
    assert list((root / "shmA").iterdir()) == []  # node A's launcher removed its copies when its rank ended
    assert not (run / "memory").exists()  # the index files: the lost rank's at the recovery, the survivor's at the end
    (left,) = list((root / "shmB").iterdir())  # node B's launcher was killed: its copies outlived it
    monkeypatch.setenv("PIMM_SHM_ROOT", str(root / "shmB"))
    assert remove_stale() == [left]  # the next pimm run on node B: its rank locks free, its agent dead
    assert list((root / "shmB").iterdir()) == []


def test_sharded_state_lost_with_a_node_is_resharded_from_memory_at_the_smaller_world_size(lost, tmp_path):
    """FSDP: each copy holds its rank's own shards. The survivor (world size 1) holds both old ranks'
    copies (its own and its buddy's): it reads both, checks them and cuts its new shards from them, though
    the disk ``last`` is at step 6 too, and trains to the end on the uninterrupted one-rank trajectory
    (the reference of the DDP case: FSDP at one rank computes the same). On the old code the config was
    refused."""
    run, out, lost_rank, _ = _lose_node_b(tmp_path, (*OVERRIDES, "train.strategy=fsdp", "checkpoint.every_steps=6"))
    kept_rank = 1 - lost_rank
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 22
    kept = f" (rank {lost_rank}'s held by its buddy rank {kept_rank})"
    line = (f"recovered from memory at step 6 (restart 1; world size 2 -> 1: sharded state resharded from every "
            f"rank's copy{kept}; disk at step 6 too: memory is faster)")
    log = (run / "train.log").read_text()
    assert log.count(line) == 1, log[-4000:]
    assert status["recovery"] | {"message": None} == {"tier": "memory", "step": 6, "restart": 1, "message": None,
                                                      "saved_world_size": 2, "world_size": 1}
    prov = json.loads((run / "provenance.json").read_text())
    (entry,) = [e for e in prov["starts"] if e.get("kind") == "recovery"]
    assert entry["tier"] == "memory" and entry["message"] == line and entry["policy"] == "global_order"
    assert entry["read_from"] == {"0": {"0": kept_rank, "1": kept_rank}}
    assert "starts over" not in log and "recovered from disk" not in log
    ref, got = _weights(lost["root"] / "reference"), _weights(run)
    assert ref.keys() == got.keys()
    for k in ref:
        scale = ref[k].abs().max().clamp_min(1e-12)
        assert ((got[k] - ref[k]).abs().max() / scale).item() <= 1e-5, k
