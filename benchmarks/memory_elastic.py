"""A node lost for good: recovery at the smaller world size from the memory tier against disk only.

Two ``pimm launch --nnodes 1:2 --nproc-per-node 1 --max-restarts 1`` agents on this machine play two
nodes (c10d rendezvous on 127.0.0.1, each node its own ``$PIMM_SHM_ROOT``) training
``configs/digits.toml`` under the global data order (``train.global_batch = 64`` of micro-batches of
32, ``train.log_every_steps=1``). Node A's agent hosts the rendezvous; node B's runs rank 0 (started
first: torch numbers the nodes by their agents' pids). Once rank 0 logged ``--kill-after`` steps,
node B's process group is SIGKILLed; node A's agent restarts its rank alone (world size 2 -> 1).

Per run: the step logged last before the kill, the recovery's tier and step (``status.json``), the
steps lost, the seconds from the kill to the ``recovered from`` line and to the first step record
after the restart (``metrics.jsonl``'s ``time``), and how the restart's time splits: from the kill to
the restarted rank's process start (/proc; torch's rendezvous: the lost node's heartbeats expire, then
the last call for more nodes) and from there to the ``recovered from`` line (the rank's start-up, the
same for both, and the recovery). The memory tier
(``memory_every_steps = N``, disk ``last`` every M steps) against disk only (``every_steps = M``,
memory off), alternated, medians. With ``--rdzv-compare``: the memory tier with torch's rendezvous
defaults against ``pimm launch --rdzv-conf`` (:data:`FAST_RDZV` unless ``--rdzv-conf`` says otherwise), the
waits for the lost node (its keep-alive beats, then the last call). Prints one JSON object with ``uptime``'s
load at each run's end.

Usage::

    uv run python benchmarks/memory_elastic.py [--hidden 1024] [--repeats 1] [--every-memory 5]
        [--every-disk 20] [--kill-after 33] [--rdzv-conf C] [--rdzv-compare]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import json_dict, load_average, machine, median, r, remove, train_records  # noqa: E402

CONFIG = REPO / "configs" / "digits.toml"
# Node B: its imports done before it waits for node A's rendezvous store, so that it joins within a second of
# node A (whose last call for more nodes is then never the wait that decides the first world size).
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
#: Rendezvous waits for a lost node: its keep-alive beats missed for 3 s (not 15), then a 10 s last call (not 30).
FAST_RDZV = "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




def _recovered_at(log: Path, after: float) -> float | None:
    """The time of train.log's ``recovered from`` line after ``after`` (UNIX s)."""
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            m = _STAMP.match(line)
            if m and "recovered from" in line:
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                if t > after:
                    return t
    return None


def _started_at(pid: int) -> float | None:
    """When process ``pid`` started (UNIX s, to the clock tick), from /proc."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _agent(root: Path, name: str, node: str, port: int, overrides: list[str], *, after_a: bool,
           rdzv_conf: str | None) -> subprocess.Popen:
    args = [sys.executable, *(("-c", _AFTER_A, str(port)) if after_a else ("-m", "pimm_core.cli")), "launch",
            "--train.config", str(CONFIG), "--run.root", str(root), "--run.name", name, "--run.no-timestamp",
            "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "1",
            *(("--rdzv-conf", rdzv_conf) if rdzv_conf else ()), "--", *overrides]
    shm = root / f"{name}-shm{node}"
    shm.mkdir()
    out = open(root / f"{name}-node{node}.out", "wb")
    return subprocess.Popen(args, cwd=REPO, env={**os.environ, "PIMM_SHM_ROOT": str(shm)}, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def one_loss(root: Path, name: str, hidden: int, memory_every: int, disk_every: int, kill_after: int,
             rdzv_conf: str | None = None, timeout: float = 900) -> dict[str, Any]:
    overrides = [f"model.hidden={hidden}", "train.log_every_steps=1", "train.epochs=100", "train.max_steps=100000",
                 "checkpoint.every_epochs=0", f"checkpoint.every_steps={disk_every}",
                 f"checkpoint.memory_every_steps={memory_every}", "eval.every_epochs=1000", "data.order=global",
                 "train.global_batch=64", "data.batch_size=32", "data.num_workers=0"]
    port = _free_port()
    node_b = _agent(root, name, "B", port, overrides, after_a=True, rdzv_conf=rdzv_conf)
    node_a = _agent(root, name, "A", port, overrides, after_a=False, rdzv_conf=rdzv_conf)
    rd = root / "digits" / name
    deadline = time.monotonic() + timeout
    try:
        while True:
            recs = train_records(rd / "metrics.jsonl")
            if recs and recs[-1]["step"] >= kill_after:
                break
            if node_a.poll() is not None or node_b.poll() is not None or time.monotonic() > deadline:
                raise TimeoutError(f"{name}: step {kill_after} not reached")
            time.sleep(0.01)
        os.killpg(node_b.pid, signal.SIGKILL)
        killed_at = time.time()
        node_b.wait()
        killed_step = max(x["step"] for x in train_records(rd / "metrics.jsonl") if x.get("time", 0) <= killed_at)
        while True:
            recovery = json_dict(rd / "status.json").get("recovery")
            if isinstance(recovery, dict) and recovery.get("restart", 0) >= 1:
                after = [x for x in train_records(rd / "metrics.jsonl")
                         if x.get("time", 0) > killed_at and x["step"] == recovery["step"] + 1]
                if after:
                    break
            if node_a.poll() is not None or time.monotonic() > deadline:
                raise TimeoutError(f"{name}: no step after the restart")
            time.sleep(0.01)
        recovered = _recovered_at(rd / "train.log", killed_at)
        pids = json_dict(rd / "status.json").get("pids") or []
        first = _started_at(pids[0]) if pids else None  # the restarted rank (alive until the stop below)
    finally:
        for proc in (node_a, node_b):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # (a stop: the launcher removes its shared memory)
        for proc in (node_a, node_b):
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {"memory_every_steps": memory_every, "disk_every_steps": disk_every, "killed_step": killed_step,
            "tier": recovery["tier"], "recovered_step": recovery["step"],
            "world_size": [recovery.get("saved_world_size"), recovery.get("world_size")],
            "steps_lost": killed_step - recovery["step"],
            "kill_to_recovered_s": r(recovered - killed_at, 3) if recovered else None,
            "kill_to_next_step_s": r(after[0]["time"] - killed_at, 3),
            "kill_to_rank_start_s": r(first - killed_at, 3) if first else None,
            "rank_start_to_recovered_s": r(recovered - first, 3) if first and recovered else None,
            "uptime": _uptime()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--every-memory", type=int, default=5)
    ap.add_argument("--every-disk", type=int, default=20)
    ap.add_argument("--kill-after", type=int, default=33)
    ap.add_argument("--rdzv-conf", default=None,
                    help="pimm launch --rdzv-conf for every run, e.g. " + FAST_RDZV)
    ap.add_argument("--rdzv-compare", action="store_true",
                    help="the memory tier with torch's rendezvous defaults against --rdzv-conf (default: "
                         f"{FAST_RDZV}), instead of memory against disk")
    a = ap.parse_args()
    if a.rdzv_compare:
        kinds = {"memory": (a.every_memory, None), "memory_rdzv_conf": (a.every_memory, a.rdzv_conf or FAST_RDZV)}
    else:
        kinds = {"memory": (a.every_memory, a.rdzv_conf), "disk": (0, a.rdzv_conf)}
    start = load_average()
    work = Path(tempfile.mkdtemp(prefix="pimm-memory-elastic-"))
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    try:
        for i in range(a.repeats):  # alternated: memory, disk, disk, memory ...
            for kind in (list(kinds) if i % 2 == 0 else list(kinds)[::-1]):
                every, conf = kinds[kind]
                res = one_loss(work, f"{kind}-{i}", a.hidden, every, a.every_disk, a.kill_after, conf)
                res["rdzv_conf"] = conf
                runs[kind].append(res)
                print(json.dumps({kind: res}), file=sys.stderr, flush=True)
    finally:
        remove(work)
    keys = ("steps_lost", "kill_to_recovered_s", "kill_to_next_step_s", "kill_to_rank_start_s",
            "rank_start_to_recovered_s")
    med = {k: {kind: median([x[k] for x in v if x[k] is not None]) for kind, v in runs.items() if v} for k in keys}
    other, base = ("memory_rdzv_conf", "memory") if a.rdzv_compare else ("memory", "disk")
    print(json.dumps({"machine": machine(load_at_start=start), "hidden": a.hidden, "medians": med,
                      f"ratio_next_step_{other}_to_{base}": r(med["kill_to_next_step_s"][other] /
                                                              med["kill_to_next_step_s"][base]),
                      f"ratio_rank_start_to_recovered_{other}_to_{base}": r(
                          med["rank_start_to_recovered_s"][other] / med["rank_start_to_recovered_s"][base]),
                      "runs": runs, "load_at_end": load_average()}, indent=1))


if __name__ == "__main__":
    main()
