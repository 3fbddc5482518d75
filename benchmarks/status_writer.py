"""status.json at a logged step: on the writer thread (now) vs on the training thread (before), same process.

The small-model row of ``trainer_overhead.py`` (configs/digits.toml's 64-128-10 MLP, batch 32, EMA,
metrics.jsonl and status.json every ``--log-every`` steps, the stop agreement) trained alternately
with the logged step's ``status.json`` handed to the writer thread (:class:`pimm_core.run.StatusWriter`,
``async``) and written on the training thread as before (``sync``: ``Recorder.heartbeat`` calls
``Recorder.status("running")``), ``--repeats`` runs each after a warm-up pair, in one process, so
both see the same load. Per step: the process's CPU time (every thread) and the interval between
optimizer steps, medians and means over all intervals; wall time per step, median of runs.

Usage: ``uv run python benchmarks/status_writer.py [--repeats 8] [--steps 300] [--log-every 10]``
(one intra-op thread). Prints one JSON object with ``async``, ``sync`` and ``async / sync`` ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import warnings
from pathlib import Path

import torch

from trainer_overhead import CPU, REPO, intervals, run_pimm

from pimm_core.config import load_config  # noqa: E402
from pimm_core.train.recorder import Recorder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("pimm").setLevel(logging.WARNING)
    cfg = load_config(REPO / "configs" / "digits.toml", [
        "data.num_workers=0", "train.epochs=1000", f"train.max_steps={args.steps}", "train.grad_clip=0",
        "train.scheduler=constant", "train.warmup_steps=0", "train.amp=none", "train.device=cpu",
        "eval.every_epochs=0", "checkpoint.every_epochs=0", "checkpoint.every_steps=0",
        "ema.enabled=true", f"train.log_every_steps={args.log_every}"])
    handed_over = Recorder.heartbeat
    modes = {"async": handed_over, "sync": lambda rec: rec.status("running")}
    load_start = [round(x, 2) for x in os.getloadavg()]
    scratch = Path(tempfile.mkdtemp(prefix="pimm-status-writer-"))
    got: dict[str, dict[str, list[float]]] = {m: {"cpu": [], "interval": [], "wall": []} for m in modes}
    try:
        for repeat in range(args.repeats + 1):
            for mode in ("async", "sync") if repeat % 2 else ("sync", "async"):  # (alternated, each first in turn)
                Recorder.heartbeat = modes[mode]
                steps, wall = run_pimm(cfg, scratch / f"{mode}{repeat}")
                shutil.rmtree(scratch / f"{mode}{repeat}", ignore_errors=True)
                if repeat == 0:
                    continue  # warm-up
                got[mode]["cpu"] += intervals(CPU[-1])
                got[mode]["interval"] += steps
                got[mode]["wall"].append(wall / args.steps)
    finally:
        Recorder.heartbeat = handed_over
        shutil.rmtree(scratch, ignore_errors=True)
    out: dict = {}
    for mode, g in got.items():
        out[mode] = {"cpu_step_ms_median": statistics.median(g["cpu"]) * 1e3, "cpu_step_ms_mean": statistics.mean(g["cpu"]) * 1e3,
                     "interval_ms_median": statistics.median(g["interval"]) * 1e3,
                     "interval_ms_mean": statistics.mean(g["interval"]) * 1e3,
                     "wall_per_step_ms": statistics.median(g["wall"]) * 1e3}
        out[mode] = {k: round(v, 3) for k, v in out[mode].items()}
    out["async / sync"] = {k: round(out["async"][k] / out["sync"][k], 4) for k in out["async"]}
    out.update(repeats=args.repeats, steps=args.steps, log_every_steps=args.log_every,
               load_average_start=load_start, load_average_end=[round(x, 2) for x in os.getloadavg()])
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
