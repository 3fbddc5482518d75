"""The quickstart as a user times it: ``pimm launch --train.config configs/digits.toml`` (5 epochs)
against a plain PyTorch script doing the same work (``benchmarks/quickstart_plain.py``), both
as whole processes (interpreter start, imports, data, training, evaluation each epoch, the
saves, exit).

Runs alternate (pimm, plain, then plain, pimm, ...) and the figures are medians. Both get
the same torch intra-op thread count, set explicitly (``OMP_NUM_THREADS`` and, in the plain
script, ``torch.set_num_threads``; ``--threads``, default 1 per rank). At ``--nproc 2`` pimm
runs ``pimm launch --nproc-per-node 2`` and the plain script ``torchrun --nproc-per-node 2``
with DDP (gloo). ``--busy 2`` starts two CPU-bound processes (``python3 -c "while True: pass"``)
for the length of the benchmark and stops them at its end.

The breakdown (``breakdown``), from one extra pimm run at 1 rank with timers on its parts
(not one of the timed runs; ``--no-breakdown`` skips it) and from the plain script's own
timers: per epoch, the seconds of training, evaluation, the ``model_best.pth`` write,
the periodic save, the metrics records, the ``status.json`` writes and the first batch of
the epoch (where DataLoader workers start; none with ``data.num_workers = 0``); then the
final save and the time from process start to the first epoch.

Prints one JSON object::

    {"pimm_s": ..., "plain_s": ..., "ratio": pimm/plain, "pimm_cpu_s": ..., "plain_cpu_s": ...,
     "per_epoch": {...}, "breakdown": {...}, "machine": {...}, "uptime": [...]}

Usage: ``uv run python benchmarks/quickstart.py [--nproc 1] [--busy 0] [--repeats 3] [--epochs 5] [--threads 1]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Run ``cmd`` to its end; its wall and CPU seconds (every descendant) and stdout."""
    cpu, start = cpu_children(), time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if p.returncode:
        sys.exit(f"error: {' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return wall, cpu_children() - cpu, p.stdout


def pimm_cmd(root: Path, args) -> list[str]:
    cmd = [str(BIN / "pimm"), "launch", "--train.config", "configs/digits.toml"]
    if args.nproc > 1:
        cmd += ["--nproc-per-node", str(args.nproc)]
    return cmd + ["--", f"train.epochs={args.epochs}", f"run.root={root}"]


def plain_cmd(out: Path, args) -> list[str]:
    script = str(REPO / "benchmarks" / "quickstart_plain.py")
    tail = [script, str(out), "--epochs", str(args.epochs), "--threads", str(args.threads)]
    if args.nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), *tail]
    return [sys.executable, *tail]


def pimm_epochs(root: Path) -> list[float]:
    """Seconds between the ends of consecutive evaluations (metrics.jsonl's ``val`` records)."""
    metrics = next(root.rglob("metrics.jsonl"))
    times = [r["time"] for r in map(json.loads, metrics.read_text().splitlines()) if r.get("split") == "val"]
    return [round(b - a, 4) for a, b in zip(times, times[1:])]


# ------------------------------------------------------------------------------ breakdown
def profile_child(out: Path, pimm_args: list[str]) -> None:
    """In this process: ``pimm launch`` with timers on the trainer's per-epoch parts; the totals
    per epoch go to ``out`` (JSON) at the end."""
    t0 = time.perf_counter()  # (the interpreter's own start and this script's imports come before)
    import atexit
    import functools

    from pimm_core import cli, trainer
    from pimm_core.data import loaders as data
    from pimm_core.train import checkpointer, recorder
    parts: dict[str, dict[int, float]] = {}
    marks: dict[str, float] = {}
    current = {"epoch": 0, "tr": None}

    def add(name: str, seconds: float) -> None:
        bucket = parts.setdefault(name, {})
        bucket[current["epoch"]] = bucket.get(current["epoch"], 0.0) + seconds

    def wrap(owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed_part(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                add(name, time.perf_counter() - start)
        setattr(owner, attr, timed_part)

    train_epoch = trainer.Trainer._train_epoch

    def epoch_part(self, step, t):
        current["epoch"] = self.state.epoch
        marks.setdefault("first_epoch_start_s", time.perf_counter() - t0)
        start = time.perf_counter()
        try:
            return train_epoch(self, step, t)
        finally:
            add("train (the epoch's steps, records and status writes included)", time.perf_counter() - start)
    trainer.Trainer._train_epoch = epoch_part
    wrap(trainer.Trainer, "evaluate", "evaluation")
    wrap(checkpointer.Checkpointer, "on_evaluated", "model_best.pth write (checkpoint.keep_best)")
    wrap(checkpointer.Checkpointer, "on_epoch_end", "periodic save (checkpoint.every_epochs)")
    wrap(checkpointer.Checkpointer, "on_end", "final save (last/)")
    wrap(recorder.Recorder, "record", "metrics records (metrics.jsonl)")
    wrap(recorder.Recorder, "status", "status.json writes")
    loader_iter = data.TrainLoader.__iter__

    def first_batch(self):  # the loader's iterator creation and first batch: where workers start
        start = time.perf_counter()
        it = loader_iter(self)
        add("iterator start (DataLoader workers start here)", time.perf_counter() - start)
        return it
    data.TrainLoader.__iter__ = first_batch

    def dump() -> None:
        out.write_text(json.dumps({"parts": {k: {str(e): round(s, 4) for e, s in sorted(v.items())}
                                             for k, v in parts.items()},
                                   "process_s": round(time.perf_counter() - t0, 4), **marks}))
    atexit.register(dump)
    sys.argv = ["pimm", *pimm_args]
    cli.run()


def breakdown(args, scratch: Path, env: dict[str, str]) -> dict:
    out = scratch / "parts.json"
    root = scratch / "profiled"
    launch = pimm_cmd(root, argparse.Namespace(**{**vars(args), "nproc": 1}))[1:]
    subprocess.run([sys.executable, __file__, "--profile-child", str(out), "--", *launch], env=env, cwd=REPO,
                   check=True, capture_output=True)
    got = json.loads(out.read_text())
    return {"pimm (one run at 1 rank, timers on)": got}


# ---------------------------------------------------------------------------------- main
def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--profile-child":
        profile_child(Path(sys.argv[2]), sys.argv[4:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=1, help="ranks (pimm --nproc-per-node, torchrun for the plain)")
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound processes to run beside the benchmark")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each (alternated)")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank, both")
    ap.add_argument("--no-breakdown", action="store_true")
    args = ap.parse_args()

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    env.pop("PIMM_RUN_ROOT", None)
    busy = [subprocess.Popen(["python3", "-c", "while True: pass"]) for _ in range(args.busy)]
    scratch = Path(tempfile.mkdtemp(prefix="pimm-quickstart-"))
    runs: dict[str, list] = {"pimm": [], "plain": []}
    uptimes = [uptime()]
    try:
        if busy:
            time.sleep(2)  # (let the busy processes take their share)
        breakdown_out = None if args.no_breakdown else breakdown(args, scratch, env)
        for r in range(args.repeats):
            order = ("pimm", "plain") if r % 2 == 0 else ("plain", "pimm")
            for who in order:
                where = scratch / f"{who}{r}"
                cmd = pimm_cmd(where, args) if who == "pimm" else plain_cmd(where, args)
                wall, cpu, stdout = timed(cmd, env)
                rec = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}
                if who == "pimm":
                    rec["epoch_s"] = pimm_epochs(where)
                else:
                    rec["plain"] = json.loads(stdout.strip().splitlines()[-1])
                runs[who].append(rec)
                shutil.rmtree(where, ignore_errors=True)
            uptimes.append(uptime())
    finally:
        for p in busy:
            p.kill()
            p.wait()
        shutil.rmtree(scratch, ignore_errors=True)

    def med(who: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[who]), 3)

    plain_epochs = [[e["train_s"] + e["eval_s"] for e in r["plain"]["epochs"]] for r in runs["plain"]]
    pimm_s, plain_s = med("pimm", "wall_s"), med("plain", "wall_s")
    import torch

    print(json.dumps({
        "pimm_s": pimm_s, "plain_s": plain_s, "ratio": round(pimm_s / plain_s, 3),
        "pimm_cpu_s": med("pimm", "cpu_s"), "plain_cpu_s": med("plain", "cpu_s"),
        "cpu_ratio": round(med("pimm", "cpu_s") / med("plain", "cpu_s"), 3),
        "per_epoch": {
            "pimm_epoch_s_median (evaluation end to evaluation end, epochs 2..)":
                round(statistics.median(x for r in runs["pimm"] for x in r["epoch_s"]), 4),
            "plain_epoch_s_median (train + eval, every epoch)":
                round(statistics.median(x for r in plain_epochs for x in r), 4),
            "plain_save_s_median": round(statistics.median(r["plain"]["save_s"] for r in runs["plain"]), 4),
            "plain_start_to_first_epoch_s_median":
                round(statistics.median(r["plain"]["start_to_first_epoch_s"] for r in runs["plain"]), 4),
        },
        "breakdown": breakdown_out,
        "runs": runs,
        "nproc": args.nproc, "busy_processes": args.busy, "epochs": args.epochs,
        "torch_threads_per_rank": args.threads,
        "machine": {"cpu": next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                                 if ln.startswith("model name")), None),
                    "cores": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0]},
        "uptime": uptimes,
    }, indent=2))


if __name__ == "__main__":
    main()
