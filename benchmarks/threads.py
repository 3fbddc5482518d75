"""Intra-op threads: a training step at 1 and at 2 threads, alone and beside busy processes.

What pimm's thread choice (:mod:`pimm_core.process.threads`) is based on. Each measurement is a
fresh process (the project's interpreter) that sets ``torch.set_num_threads(T)`` before
its first op and trains the quickstart's model (``configs/digits.toml``: an MLP
64-``W``-10 with dropout, batch 32, AdamW, gradient clipping at 1.0) on random inputs
for ``--steps`` optimizer steps; it reports the median step time over the steps after
the first 10 and the process's CPU time over them. ``W`` is 128 (the quickstart) and the
wider ``--widths``. Two conditions:

- ``alone``: nothing added (the machine's own load is in the output);
- ``busy``: beside ``--busy`` processes running ``while True: pass``, started before and
  killed after the measurement.

Threads 1 and 2 alternate within each (width, condition) pair; ``--repeats`` pairs, the
medians are reported and ``ratio = ms(2 threads) / ms(1 thread)``: below 1, the second
thread pays.

Usage::

    uv run python benchmarks/threads.py [--steps 300] [--repeats 3] [--widths 128 1024 4096] [--busy 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, median, r  # noqa: E402

CHILD = """
import json, resource, statistics, sys, time
import torch
threads, width, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                            torch.nn.Linear(width, 10))
opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
x, y = torch.randn(steps, 32, 64), torch.randint(0, 10, (steps, 32))
times, cpu0 = [], None
for i in range(steps):
    if i == 10:
        cpu0 = time.process_time()
    t = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    times.append(time.perf_counter() - t)
print(json.dumps({"step_ms": statistics.median(times[10:]) * 1e3, "wall_s": sum(times[10:]),
                  "cpu_s": time.process_time() - cpu0}))
"""


def measure(threads: int, width: int, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(width), str(steps)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--widths", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--busy", type=int, default=2, help="busy processes beside the 'busy' condition")
    args = ap.parse_args()

    load_start = load_average()
    rows = []
    for condition in ("alone", "busy"):
        hogs = busy(args.busy) if condition == "busy" else []
        try:
            time.sleep(0.5 if hogs else 0)  # the busy loops are running
            for width in args.widths:
                got: dict[int, list[dict]] = {1: [], 2: []}
                for repeat in range(args.repeats):
                    for threads in ((1, 2) if repeat % 2 == 0 else (2, 1)):
                        got[threads].append(measure(threads, width, args.steps))
                ms = {t: median([g["step_ms"] for g in got[t]]) for t in got}
                cpu = {t: median([g["cpu_s"] / g["wall_s"] for g in got[t]]) for t in got}
                rows.append({"condition": condition, "width": width, "step_ms_1": r(ms[1], 3), "step_ms_2": r(ms[2], 3),
                             "ratio_2_over_1": r(ms[2] / ms[1], 3), "cpu_per_wall_1": r(cpu[1], 2),
                             "cpu_per_wall_2": r(cpu[2], 2), "load": load_average()})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
    import torch

    print(json.dumps({"rows": rows, "steps": args.steps, "repeats": args.repeats, "busy_processes": args.busy,
                      "machine": {"cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                                  "torch": torch.__version__, "load_average_start": load_start,
                                  "load_average_end": load_average()}}, indent=2))


if __name__ == "__main__":
    main()
