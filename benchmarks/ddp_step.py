"""A 2-rank DDP step of the quickstart's MLP, one code tree against another: what a change to
the step's collectives buys where the ranks are not always scheduled at once.

Each job is one ``torchrun --nproc-per-node N`` whose ranks import ``pimm_core`` from the
tree given (``PYTHONPATH``: ``--trees BEFORE AFTER``, e.g. a ``git archive`` of the parent
commit and this checkout) and run ``Trainer.train()`` ``--trainings`` times in the one
process group, so start-up is paid once per job and the figure is the step: configs/digits.toml
with ``train.epochs`` (an evaluation each epoch), one torch thread per rank. Jobs alternate
between the trees (A, B, then B, A, ...); ``--busy N`` runs N CPU-bound processes beside them.

Prints one JSON object::

    {"trees": [...], "wall_per_step_ms": {tree: median}, "cpu_per_step_ms": {tree: median (rank 0)},
     "ratio_wall": after/before, "ratio_cpu": ..., "runs": {...}, "uptime": [...]}

Usage: ``uv run python benchmarks/ddp_step.py --trees /tmp/before . [--jobs 3] [--trainings 2]
[--epochs 6] [--nproc 2] [--busy 2]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(out: Path, trainings: int, epochs: int) -> None:
    """One rank: ``trainings`` trainings of the digits config; rank 0 writes the per-step figures."""
    from pimm_core import Trainer, load_config
    from pimm_core.launch import setup_logging
    from pimm_core.process import dist

    info = dist.env_world()
    setup_logging(False)
    res = []
    try:
        for _ in range(trainings):
            cfg = load_config(REPO / "configs" / "digits.toml",
                              [f"train.epochs={epochs}", "data.num_workers=0", "eval.every_epochs=1"])
            run_dir = Path(tempfile.mkdtemp(prefix="pimm-ddp-step-")) if info.is_main else None
            tr = Trainer(cfg, run_dir=run_dir)
            t0, c0 = time.perf_counter(), time.process_time()
            tr.train()
            steps = tr.state.global_step
            res.append({"wall_per_step_ms": (time.perf_counter() - t0) / steps * 1e3,
                        "cpu_per_step_ms": (time.process_time() - c0) / steps * 1e3, "steps": steps})
    finally:
        dist.shutdown()
    if info.is_main:
        out.write_text(json.dumps(res))


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs=2, required=True, help="two source trees: before, after")
    ap.add_argument("--jobs", type=int, default=3, help="torchrun jobs per tree (alternated)")
    ap.add_argument("--trainings", type=int, default=2, help="trainings per job")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--busy", type=int, default=2, help="CPU-bound processes beside the jobs")
    args = ap.parse_args()
    trees = [str(Path(t).resolve()) for t in args.trees]
    busy = [subprocess.Popen(["python3", "-c", "while True: pass"]) for _ in range(args.busy)]
    runs: dict[str, list] = {t: [] for t in trees}
    uptimes = [uptime()]
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for j in range(args.jobs):
                for tree in (trees if j % 2 == 0 else trees[::-1]):
                    out = Path(scratch) / "rank0.json"
                    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
                    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                    str(args.nproc), __file__, "--worker", str(out), str(args.trainings),
                                    str(args.epochs)], env=env, cwd=REPO, check=True, capture_output=True)
                    runs[tree] += json.loads(out.read_text())
                    out.unlink()
                uptimes.append(uptime())
    finally:
        for p in busy:
            p.kill()
            p.wait()

    def med(tree: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[tree]), 3)

    before, after = trees
    print(json.dumps({
        "trees": trees, "nproc": args.nproc, "busy_processes": args.busy,
        "wall_per_step_ms": {t: med(t, "wall_per_step_ms") for t in trees},
        "cpu_per_step_ms": {t: med(t, "cpu_per_step_ms") for t in trees},
        "ratio_wall": round(med(after, "wall_per_step_ms") / med(before, "wall_per_step_ms"), 3),
        "ratio_cpu": round(med(after, "cpu_per_step_ms") / med(before, "cpu_per_step_ms"), 3),
        "runs": runs, "uptime": uptimes}, indent=2))


if __name__ == "__main__":
    main()
