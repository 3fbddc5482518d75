"""The memory tier (``checkpoint.memory_every_steps``): its stall, its recovery, the steps it saves, its memory.

Four figures, each against a baseline measured in the same run (alternated, medians):

- ``stall``: the training thread's stall per memory snapshot against one synchronous disk save of
  the same state, in process (one rank, no process group): the snapshot's staging is what
  :meth:`pimm_core.train.memory.MemorySnapshots._stage` does (every tensor of the model's and the
  optimizer's state dicts copied to CPU into the buffers of the previous snapshot,
  :class:`pimm_core.checkpoint.tensors.staging.StagingBuffers`; ``fresh_copy_*``: into new CPU
  tensors, as before those buffers were kept, measured alternately for the comparison; its
  serialization, shared-memory write and buddy swap run on a background thread); the disk save is
  :func:`pimm_core.checkpoint.formats.standard.save_standard` (what ``model/last`` costs the training
  thread without ``checkpoint.async``). The state is the digits MLP of ``--hidden`` and AdamW
  after one step. The trainer's own figure (its log line ``memory tier: K snapshots, training stall
  median ...``) is reported from the recovery runs below.
- ``recovery``: real ``pimm launch --nproc-per-node 2 --max-restarts 1`` runs of ``configs/digits.toml``
  (``train.log_every_steps=1``), rank 1 ``kill -9``ed at a step after ``--kill-after`` steps;
  the time from the kill to the next optimizer step the restarted ranks complete (its train record
  in ``metrics.jsonl``), with the memory tier (``memory_every_steps = N``, disk ``last`` every M
  steps) against disk only (``every_steps = M``, memory off); alternated. ``timeline_s``: when, after
  the kill, the surviving rank 0 exited, the restarted ranks' processes started, ``status.json`` said
  ``restarting`` (or ``failed``) and the recovery was recorded.
- ``steps_lost``: per failure, the newest step logged before the kill minus the step the recovery
  resumed from (``status.json``'s ``recovery``), memory vs disk only (goal: <= N with the tier).
- ``--strategy fsdp``: the recovery runs shard the model (``train.strategy = "fsdp"``): each rank's
  copy is its own shards (``own_copy_bytes_median``, against the DDP row's whole state), the trainer's
  stall line is the FSDP snapshot's.
- ``memory_per_rank``: the bytes under each rank's shared-memory directory (its own copy and the
  buddy's it holds, read while the run is live) over the bytes of its state (the own copy's size
  in ``memory/<rank>.json``); goal <= 2.

Usage::

    uv run python benchmarks/memory_tier.py [--hidden 128 3200] [--repeats 3] [--every-memory 5]
        [--every-disk 20] [--kill-after 33] [--stall-repeats 7] [--strategy ddp fsdp] [--no-stall]

Prints one JSON object, with ``uptime``'s load average at the start and end of each part.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import json_dict, load_average, machine, median, r, remove, settle, train_records  # noqa: E402

CONFIG = REPO / "configs" / "digits.toml"


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# ----------------------------------------------------------------------------- stall (in process)
def stall(hidden: int, repeats: int, work: Path, strategy: str = "ddp") -> dict[str, Any]:
    import torch

    from pimm_core.checkpoint.tensors.local_shards import to_local

    from pimm_core.checkpoint.formats.standard import save_standard
    from pimm_core.models import mlp
    from pimm_core.process.dist import DistInfo
    from pimm_core.checkpoint.tensors.staging import StagingBuffers

    def fresh(obj: Any) -> Any:  # the staging before the buffers were kept: new CPU tensors each time
        if isinstance(obj, torch.Tensor):
            return obj.detach().to("cpu", copy=True)
        if isinstance(obj, dict):
            return {k: fresh(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(fresh(v) for v in obj)
        return obj

    torch.manual_seed(0)
    model = mlp(64, 10, hidden, 0.1)
    if strategy == "fsdp":  # one rank (a one-rank gloo group): DTensor shards, staged as the trainer stages them
        import torch.distributed as tdist
        from torch.distributed.fsdp import fully_shard

        if not tdist.is_initialized():
            tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
        for layer in model.modules():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(32, 64)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    def nbytes(obj: Any) -> int:  # (local shards: the bytes a snapshot stages)
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        if isinstance(obj, dict):
            return sum(nbytes(v) for v in obj.values())
        return sum(nbytes(v) for v in obj) if isinstance(obj, (list, tuple)) else 0

    state = nbytes(to_local(model.state_dict())) + nbytes(to_local(opt.state_dict()["state"]))
    info = DistInfo()
    meta = {"trainer": {"global_step": 1}}
    manifest = {"kind": "last", "step": 1, "epoch": 0, "iter": 0}
    disk_dir = work / "stall"
    disk_dir.mkdir()
    def live() -> list:
        return [t for t in list(model.state_dict().values()) + [v for st in opt.state.values() for v in st.values()]
                if isinstance(t, torch.Tensor)]

    staging = StagingBuffers()
    mem_s, disk_s, fresh_s = [], [], []
    for i in range(repeats + 1):  # alternated; the first round is a warm-up
        settle()
        t0 = time.perf_counter()
        staged = {"model": staging.copy_tree("model", to_local(model.state_dict())),
                  "optimizer": staging.copy_tree("optimizer", to_local(opt.state_dict()))}
        t_mem = time.perf_counter() - t0
        del staged
        t0 = time.perf_counter()
        staged = {"model": fresh(to_local(model.state_dict())), "optimizer": fresh(to_local(opt.state_dict()))}
        t_fresh = time.perf_counter() - t0
        del staged
        settle()
        t0 = time.perf_counter()
        save_standard(disk_dir, model=model, optimizer=opt, meta=meta, rank_state={"rng": torch.get_rng_state()},
                      manifest=manifest, info=info)
        t_disk = time.perf_counter() - t0
        if i:
            fresh_s.append(t_fresh)
            mem_s.append(t_mem)
            disk_s.append(t_disk)
    remove(disk_dir)
    params = sum(p.numel() for p in model.parameters())
    return {"hidden": hidden, "strategy": strategy, "params": params, "state_bytes": state,
            "memory_snapshot_stall_s_median": r(median(mem_s), 5), "disk_save_s_median": r(median(disk_s)),
            "ratio_memory_to_disk": r(median(mem_s) / median(disk_s)),
            "fresh_copy_stall_s_median": r(median(fresh_s), 5),
            "ratio_memory_to_fresh_copy": r(median(mem_s) / median(fresh_s)),
            "seconds_all": {"memory": [r(x, 5) for x in mem_s], "fresh_copy": [r(x, 5) for x in fresh_s],
                            "disk": [r(x) for x in disk_s]}}


# ----------------------------------------------------------------------------- recovery (torchrun)

def _children(pid: int) -> list[int]:
    """The launcher's child processes (its ranks), from /proc (Linux)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    return out


def _alive(pid: int) -> bool:
    """Process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False



def _du(path: Path) -> int:
    return sum((Path(d) / f).stat().st_size for d, _, fs in os.walk(path) for f in fs) if path.is_dir() else 0


def one_failure(root: Path, name: str, hidden: int, memory_every: int, disk_every: int, kill_after: int,
                timeout: float, strategy: str = "ddp") -> dict[str, Any]:
    """One run killed once: rank 1 gets SIGKILL once it logged ``kill_after`` steps; figures of its recovery."""
    overrides = [f"train.strategy={strategy}", f"model.hidden={hidden}", "train.log_every_steps=1", "train.epochs=100", "train.max_steps=100000",
                 "checkpoint.every_epochs=0", f"checkpoint.every_steps={disk_every}",
                 f"checkpoint.memory_every_steps={memory_every}", "eval.every_epochs=1000"]
    cmd = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(CONFIG), "--run.root", str(root),
           "--run.name", name, "--run.no-timestamp", "--nproc-per-node", "2", "--max-restarts", "1", "--", *overrides]
    rd = root / "digits" / name
    log = open(root / f"{name}.out", "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out: dict[str, Any] = {"memory_every_steps": memory_every, "disk_every_steps": disk_every}
    deadline = time.monotonic() + timeout
    try:
        # rank 1's pid once the run has logged kill_after steps
        while time.monotonic() < deadline:
            recs = train_records(rd / "metrics.jsonl")
            pids = json_dict(rd / "status.json").get("pids") or []
            if recs and recs[-1]["step"] >= kill_after and len(pids) == 2:
                break
            if proc.poll() is not None:
                raise TimeoutError(f"{name}: the launch exited ({proc.returncode}) before step {kill_after}")
            time.sleep(0.01)
        else:
            raise TimeoutError(f"{name}: {kill_after} steps not reached")
        shm = {}
        for rank in (0, 1):  # memory per rank, measured while the run is live
            idx = json_dict(rd / "memory" / f"{rank}.json")
            if idx.get("shm") and idx.get("own"):
                shm[rank] = {"shm_bytes": _du(Path(idx["shm"])), "state_bytes": idx["own"]["bytes"]}
        old_ranks = set(_children(proc.pid))
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.time()
        before = [x for x in train_records(rd / "metrics.jsonl") if x.get("time", 0) <= killed_at]
        killed_step = max(x["step"] for x in before)
        recovery = None
        timeline: dict[str, float] = {}  # seconds after the kill (polled every 5 ms)

        def mark(what: str) -> None:
            timeline.setdefault(what, round(time.time() - killed_at, 3))

        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise TimeoutError(f"{name}: the launch exited ({proc.returncode}) without a step after the restart")
            if not _alive(pids[0]):
                mark("survivor_exited")
            if set(_children(proc.pid)) - old_ranks:
                mark("new_ranks_started")
            if json_dict(rd / "status.json").get("state") in ("restarting", "failed"):
                mark(f"status_{json_dict(rd / 'status.json').get('state')}")
            recovery = json_dict(rd / "status.json").get("recovery")
            if isinstance(recovery, dict) and recovery.get("restart", 0) >= 1:
                after = [x for x in train_records(rd / "metrics.jsonl")
                         if x.get("time", 0) > killed_at and x["step"] == recovery["step"] + 1]
                mark("recovered")
                if after:
                    seen = time.time()
                    break
            time.sleep(0.005)
        else:
            raise TimeoutError(f"{name}: no step after the recovery")
        out.update(killed_step=killed_step, recovered_tier=recovery["tier"], recovered_step=recovery["step"],
                   steps_lost=killed_step - recovery["step"], recovery_s=round(seen - killed_at, 3),
                   first_step_record_s=round(after[0]["time"] - killed_at, 3), shm=shm, timeline_s=timeline)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # (a stop: the launcher removes the run's shared memory)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    text = (root / f"{name}.out").read_text(errors="replace")
    stall_line = [line for line in text.splitlines() if "memory tier:" in line and "training stall" in line]
    if stall_line:
        out["trainer_stall_line"] = stall_line[-1].split("memory tier:", 1)[1].strip()
    return out


def recovery(hidden: int, repeats: int, every_memory: int, every_disk: int, kill_after: int,
             work: Path, strategy: str = "ddp") -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"memory": [], "disk": []}
    failed: list[dict[str, Any]] = []
    for i in range(repeats):  # alternated: memory, disk, memory, disk ...
        for kind in (("memory", "disk") if i % 2 == 0 else ("disk", "memory")):
            mem = every_memory if kind == "memory" else 0
            try:
                runs[kind].append(one_failure(work, f"{kind}-{hidden}-{i}", hidden, mem, every_disk, kill_after,
                                              timeout=600, strategy=strategy))
                print(json.dumps({"hidden": hidden, **runs[kind][-1], "uptime": uptime()}), file=sys.stderr,
                      flush=True)  # (each run as it ends: a long benchmark interrupted keeps its figures)
            except TimeoutError as e:  # said in the output, with the run's last lines; the others still count
                tail = [line for line in (work / f"{kind}-{hidden}-{i}.out").read_text(errors="replace").splitlines()
                        if "step " not in line][-25:]
                print(json.dumps({"hidden": hidden, "failed": str(e), "log_tail": tail}), file=sys.stderr, flush=True)
                failed.append({"run": f"{kind}-{hidden}-{i}", "error": str(e), "log_tail": tail})
            remove(work / "digits" / f"{kind}-{hidden}-{i}")
    rec = {k: median([x["recovery_s"] for x in v]) for k, v in runs.items() if v}
    lost = {k: median([x["steps_lost"] for x in v]) for k, v in runs.items() if v}
    shm = [s["shm_bytes"] / s["state_bytes"] for x in runs["memory"] for s in x["shm"].values() if s["state_bytes"]]
    own = [s["state_bytes"] for x in runs["memory"] for s in x["shm"].values()]
    return {"hidden": hidden, "strategy": strategy, "every_memory": every_memory, "every_disk": every_disk,
            "own_copy_bytes_median": median(own) if own else None,
            "recovery_s_median": {k: r(v, 3) for k, v in rec.items()},
            "ratio_recovery_memory_to_disk": r(rec["memory"] / rec["disk"]) if len(rec) == 2 else None,
            "steps_lost_median": lost,
            "memory_per_rank_ratio_max": r(max(shm), 3) if shm else None,
            "runs": runs, "failed": failed}


def paper(result: dict[str, Any], *, gpus: int = 1024, mttf_h: float = 8.0, step_s: float = 2.0,
          disk_save_s: float = 60.0, disk_recovery_s: float = 300.0, uncovered: float = 0.1) -> dict[str, Any]:
    """The paper model of docs/scaling.md from a result of this script (its largest model's ratios).

    A failure at a uniformly random moment loses half a checkpoint interval on average, plus the
    recovery; a checkpoint costs its stall. With ``F = 24 / mttf_h`` failures a day and a checkpoint
    every ``tau`` seconds of stall ``C`` and recovery ``R``, a day loses ``F (R + tau / 2) + (86400 /
    tau) C`` seconds, least at Young's interval ``tau* = sqrt(2 C MTTF)`` (J. W. Young, "A first order
    approximation to the optimum checkpoint interval", CACM 17(9), 1974; J. T. Daly, "A higher order
    estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006, refines it to
    ``sqrt(2 C MTTF) - C``). With the memory tier a fraction ``uncovered`` of the failures (both
    copies of a rank's state lost: its node and its buddy's) still goes to the disk ``last``, whose
    interval is Young's for that rarer rate. ``step_s``, ``disk_save_s``, ``disk_recovery_s`` and
    ``uncovered`` are assumptions for a 1,024-GPU job; the memory tier's stall and recovery are the
    disk's times the measured ratios.
    """
    import math

    stall = max(result["stall"], key=lambda x: x["params"])
    recs = [x for x in result["recovery"] if x.get("ratio_recovery_memory_to_disk")]
    rec = max(recs, key=lambda x: x["hidden"]) if recs else None
    c_ratio = stall["ratio_memory_to_disk"]
    r_ratio = rec["ratio_recovery_memory_to_disk"] if rec else 1.0
    mttf = mttf_h * 3600
    failures = 24 / mttf_h

    def interval(c: float, rate_mttf: float) -> int:
        return max(1, round(math.sqrt(2 * c * rate_mttf) / step_s))  # Young, in steps

    def tier(name: str, every: int, c: float, rcv: float, share: float) -> dict[str, Any]:
        tau = every * step_s
        return {"tier": name, "every_steps": every, "stall_s": round(c, 2), "recovery_s": round(rcv, 1),
                "failures_per_day": round(share * failures, 2), "steps_lost_per_failure": every / 2,
                "seconds_lost_per_day": share * failures * (rcv + tau / 2) + 86400 / tau * c}

    def total(name: str, tiers: list[dict[str, Any]]) -> dict[str, Any]:
        lost = sum(t["seconds_lost_per_day"] for t in tiers)
        steps = sum(t["failures_per_day"] * t["steps_lost_per_failure"] for t in tiers)
        return {"plan": name, "tiers": tiers, "steps_lost_per_day": round(steps),
                "hours_lost_per_day": round(lost / 3600, 2), "gpu_hours_lost_per_day": round(lost / 3600 * gpus),
                "fraction_of_the_day": round(lost / 86400, 4)}

    c_mem, r_mem = c_ratio * disk_save_s, r_ratio * disk_recovery_s
    disk_only = total("disk only", [tier("disk", interval(disk_save_s, mttf), disk_save_s, disk_recovery_s, 1.0)])
    with_memory = total("memory + disk", [
        tier("memory", interval(c_mem, mttf / (1 - uncovered)), c_mem, r_mem, 1 - uncovered),
        tier("disk", interval(disk_save_s, mttf / uncovered), disk_save_s, disk_recovery_s, uncovered)])
    return {"assumed": {"gpus": gpus, "mttf_h": mttf_h, "step_s": step_s, "disk_save_s": disk_save_s,
                        "disk_recovery_s": disk_recovery_s, "uncovered": uncovered},
            "measured": {"stall_ratio": c_ratio, "recovery_ratio": r_ratio, "params": stall["params"]},
            "plans": [disk_only, with_memory]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 3200])
    ap.add_argument("--repeats", type=int, default=3, help="failures per tier and model size")
    ap.add_argument("--stall-repeats", type=int, default=7)
    ap.add_argument("--every-memory", type=int, default=5)
    ap.add_argument("--every-disk", type=int, default=20)
    ap.add_argument("--kill-after", type=int, default=33, help="rank 1 is killed once this step is logged")
    ap.add_argument("--no-recovery", action="store_true")
    ap.add_argument("--no-stall", action="store_true", help="skip the in-process stall figures")
    ap.add_argument("--strategy", nargs="+", default=["ddp"], choices=["ddp", "fsdp"],
                    help="train.strategy of the recovery runs (fsdp: each rank's copy is its shards)")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--paper", type=Path, help="print the paper model of docs/scaling.md from this script's JSON")
    args = ap.parse_args()
    if args.paper:
        print(json.dumps(paper(json.loads(args.paper.read_text())), indent=2))
        return

    load_start = load_average()
    work = Path(tempfile.mkdtemp(prefix="pimm-memory-bench-", dir=args.dir))
    out: dict[str, Any] = {"uptime_start": uptime(), "stall": [], "recovery": []}
    try:
        for h, strategy in [] if args.no_stall else [(h, s) for h in args.hidden for s in args.strategy]:
            out["stall"].append({**stall(h, args.stall_repeats, work, strategy), "uptime": uptime()})
            print(json.dumps(out["stall"][-1]), file=sys.stderr, flush=True)
        if not args.no_recovery:
            for h in args.hidden:
                for strategy in args.strategy:
                    out["recovery"].append({**recovery(h, args.repeats, args.every_memory, args.every_disk,
                                                       args.kill_after, work, strategy), "uptime": uptime()})
    finally:
        out["uptime_end"] = uptime()
        out["machine"] = machine(work.parent, load_start)
        remove(work)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
