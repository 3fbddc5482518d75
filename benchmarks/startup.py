"""Start-up: ``pimm launch`` to its first optimizer step vs ``python -c "import torch"``.

Three whole processes, alternated, on the project's interpreter:

- ``import_torch``: ``python -c "import torch"``, timed to its exit (the baseline);
- ``pimm``: the ``pimm`` console script, ``pimm launch --train.config configs/digits.toml``
  (``train.log_every_steps=1``, so step 1 writes a train record), timed from its start until
  ``metrics.jsonl`` holds that record; then it is killed (nothing after the first step is
  timed) and its run directory removed;
- ``plain``: a plain PyTorch script doing the same work up to its first step (the digits
  data, the MLP, AdamW, one forward/backward/step; it prints a line after the step), timed to
  that line: what any PyTorch program pays before its first step (``torch.optim``'s first
  ``step()`` imports ``torch._dynamo`` itself).

``ratio`` = median(pimm) / median(import_torch) (goal <= 1.5); ``plain_ratio`` the same for
the plain script. The CPU seconds each took (user + system, of the process and its descendants,
read from ``/proc`` at the event) are reported beside the wall times, with ``cpu_ratio``: on a
busy machine the wall times mostly measure the wait for a core, the CPU times the work. The children
run without ``PYTHONDONTWRITEBYTECODE`` (the warm-up round writes pimm's bytecode, as a user's first
run does). Conditions: ``alone`` (the machine as it is; its load is in the output)
and ``busy`` (beside ``--busy`` processes running ``while True: pass``). One warm-up round
per condition is discarded. ``--nproc N`` launches N ranks (``--nproc-per-node``).
``--compare-exec`` (with ``--nproc`` >= 2) also times ``pimm_exec``, the same launch with each rank
started as a fresh ``python -m pimm_core.cli`` (``PIMM_RANK_START=exec``) instead of forked from the
launcher's fork server (pimm_core/launch/rank_start.py), and ``pimm_server``, the ranks forked from a
fork server that is a fresh interpreter (``PIMM_RANK_START=server``) instead of a fork of the
launcher: ``forked_over_exec`` is pimm / pimm_exec, ``forked_over_server`` pimm / pimm_server.

Usage::

    uv run python benchmarks/startup.py [--repeats 5] [--busy 2] [--nproc 1] [-- overrides]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine, median, r, remove  # noqa: E402
from resume_time import first_step_after  # noqa: E402

CONFIG = REPO / "configs" / "digits.toml"

PLAIN = """
import torch
from torch import nn
from pimm_core.data import digits_arrays
x, y = digits_arrays()
x, y = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.ReLU(),
                      nn.Dropout(0.1), nn.Linear(128, 10))
opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
loss = nn.functional.cross_entropy(model(x[:32]), y[:32])
loss.backward()
nn.utils.clip_grad_norm_(model.parameters(), 1.0)
opt.step()
print("step 1", flush=True)
"""


def pimm_command() -> list[str]:
    script = Path(sys.executable).parent / "pimm"  # the console script `uv run pimm` starts
    return [str(script)] if script.exists() else [sys.executable, "-m", "pimm_core.cli"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (and the children they waited for)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (ppid, cpu seconds)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / tick)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0.0))[1]
        todo += [c for c, (ppid, _) in stats.items() if ppid == p]
    return total


def time_import_torch(env: dict[str, str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", "import torch"], env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit("import torch failed")
    return time.perf_counter() - t0, usage.ru_utime + usage.ru_stime


def time_plain(env: dict[str, str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", PLAIN], stdout=subprocess.PIPE, env=env, cwd=REPO, text=True)
    line = proc.stdout.readline()
    t, cpu = time.perf_counter() - t0, cpu_seconds(proc.pid)
    proc.wait()
    if not line.startswith("step 1"):
        raise SystemExit("the plain script failed")
    return t, cpu


def time_pimm(work: Path, name: str, nproc: int, overrides: list[str], env: dict[str, str]) -> tuple[float, float]:
    cmd = [*pimm_command(), "launch", "--train.config", str(CONFIG), "--run.root", str(work), "--run.name", name,
           "--run.no-timestamp", *(["--nproc-per-node", str(nproc)] if nproc > 1 else []),
           "--", "train.log_every_steps=1", *overrides]
    t0 = time.perf_counter()
    # its own session: the kill reaches torchrun's ranks too
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        seen = first_step_after(work / "digits" / name / "metrics.jsonl", 0, proc)
        cpu = cpu_seconds(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    if seen is None:
        raise SystemExit(f"pimm launch reached no step: {err.decode()[-800:]}")
    return seen - t0, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--busy", type=int, default=2, help="busy processes beside the 'busy' condition (0: skip it)")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--compare-exec", action="store_true", help="also time ranks started as python -m (PIMM_RANK_START=exec)")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("overrides", nargs="*", help="config overrides for pimm, e.g. model.hidden=1024")
    args = ap.parse_args()

    load_start = load_average()
    # PYTHONDONTWRITEBYTECODE is dropped: with it, every pimm process compiles pimm's own modules
    # (~150; the installed packages' bytecode is compiled at install) where a user's first run
    # writes their bytecode once (here: the warm-up round); measured +0.17 s CPU a process.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                            "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS",
                                                            "PYTHONDONTWRITEBYTECODE")}
    env["PYTHONPATH"] = str(REPO)
    work = Path(tempfile.mkdtemp(prefix="pimm-startup-bench-", dir=args.dir))
    results = {}
    try:
        for condition in ("alone", "busy") if args.busy else ("alone",):
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)] \
                if condition == "busy" else []
            kinds = ["import_torch", "pimm", "plain", *(["pimm_server", "pimm_exec"] if args.compare_exec else [])]
            got: dict[str, list[float]] = {k: [] for k in kinds}
            cpu: dict[str, list[float]] = {k: [] for k in kinds}
            loads = [load_average()]
            try:
                for repeat in range(args.repeats + 1):
                    t_torch = time_import_torch(env)
                    name = f"{condition}{repeat}"
                    t_pimm = time_pimm(work, name, args.nproc, args.overrides, env)
                    remove(work / "digits" / name)
                    t_plain = time_plain(env)
                    timed = {"import_torch": t_torch, "pimm": t_pimm, "plain": t_plain}
                    if args.compare_exec:
                        for kind, how in (("pimm_server", "server"), ("pimm_exec", "exec")):
                            timed[kind] = time_pimm(work, name + how, args.nproc, args.overrides,
                                                    {**env, "PIMM_RANK_START": how})
                            remove(work / "digits" / (name + how))
                    if repeat:  # the first round warms the page cache
                        for k, (wall, used) in timed.items():
                            got[k].append(wall)
                            cpu[k].append(used)
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
            loads.append(load_average())
            med = {k: median(v) for k, v in got.items()}
            med_cpu = {k: median(v) for k, v in cpu.items()}
            results[condition] = {
                "import_torch_s": r(med["import_torch"]), "pimm_first_step_s": r(med["pimm"]),
                "plain_first_step_s": r(med["plain"]), "ratio": r(med["pimm"] / med["import_torch"], 3),
                "plain_ratio": r(med["plain"] / med["import_torch"], 3),
                "pimm_over_plain": r(med["pimm"] / med["plain"], 3),
                "cpu_s": {k: r(v, 3) for k, v in med_cpu.items()},
                "cpu_ratio": r(med_cpu["pimm"] / med_cpu["import_torch"], 3),
                "plain_cpu_ratio": r(med_cpu["plain"] / med_cpu["import_torch"], 3),
                "seconds_all": {k: [r(x, 3) for x in v] for k, v in got.items()},
                "cpu_seconds_all": {k: [r(x, 3) for x in v] for k, v in cpu.items()}, "load": loads}
            if args.compare_exec:
                results[condition]["forked_over_exec"] = {"wall": r(med["pimm"] / med["pimm_exec"], 3),
                                                          "cpu": r(med_cpu["pimm"] / med_cpu["pimm_exec"], 3)}
                results[condition]["forked_over_server"] = {"wall": r(med["pimm"] / med["pimm_server"], 3),
                                                            "cpu": r(med_cpu["pimm"] / med_cpu["pimm_server"], 3)}
            print(json.dumps({condition: results[condition]}), file=sys.stderr, flush=True)
    finally:
        remove(work)
    print(json.dumps({**results, "nproc": args.nproc, "overrides": args.overrides, "repeats": args.repeats,
                      "busy_processes": args.busy, "command": pimm_command()[0],
                      "machine": machine(work.parent, load_start)}, indent=2))


if __name__ == "__main__":
    main()
