"""The global data order (``data.order = "global"``, docs/elastic.md): its step-time cost, and
how far a run resumed on another number of ranks drifts from the uninterrupted one.

Two figures, printed as one JSON object:

- ``step``: pimm's step time at ``--nproc`` ranks (DDP, gloo on CPU) under the global order
  (``train.global_batch = batch x nproc``: a window of 1, as the default) against the default
  order, in one torchrun launch of ``--repeats`` pairs of runs, one of each order back to back,
  the pair's first run alternating (default first, then global first, ...; one warm-up pair
  dropped). Intervals between consecutive optimizer steps, the first ``--skip`` of each run
  dropped; rank 0's. ``ratio`` = the median over the pairs of (global median / default median)
  (target <= 1.02): the two runs of a pair see nearly the same load, so a machine whose load
  drifts (other jobs) still gives a usable figure; ``pair_ratios`` shows the spread, and
  ``ratio_pooled`` the ratio of the medians of all intervals. ``cpu_ratio``: the same median over
  the pairs of the CPU seconds per step (process time, both ranks summed): the work itself, which
  the CPU other jobs take from a loaded machine barely moves. The global order's extra work is one
  reseed of the torch, numpy and ``random`` generators per micro-batch, also timed alone
  (``reseed_per_micro_batch_us``).
- ``drift``: the whole model after every optimizer step of three runs of the global order on
  the same data and seed: uninterrupted at 2 ranks (the reference), uninterrupted at 1 rank,
  and stopped at 2 ranks after ``--stop`` steps and resumed at 1; ``train.global_batch`` = 4
  micro-batches (a window of 4 at 1 rank, 2 at 2 ranks: the additions happen in another order). Per step, the max over
  parameters of ``max|w - w_ref| / max|w_ref|``. ``resumed_2_to_1`` (steps after the stop)
  beside ``uninterrupted_1_vs_2`` (every step): the drift a resume adds against the drift that
  the order of floating-point additions alone makes.

The model (``benchmarks/_dist_common.py``'s ``Block`` stack behind an input dropout of 0.1) trains
on random regression data (``(n, width)`` inputs and targets, MSE; the built-in ``regression``
objective, a per-sample window average).

    uv run python benchmarks/elastic.py [--width 256] [--depth 4] [--batch 16] [--steps 20] [--repeats 16]
        [--drift-steps 24] [--stop 8] [--no-drift]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine, r  # noqa: E402
from _dist_common import Net, config, param_count, setup_rank, torchrun, write_rank  # noqa: E402
from pimm_core.process import dist  # noqa: E402
from pimm_core.checkpoint.tensors.state import unwrap  # noqa: E402
from pimm_core.trainer import Trainer  # noqa: E402

QUIET = ["train.grad_clip=0", "eval.every_epochs=0", "checkpoint.every_epochs=0", "checkpoint.every_steps=0",
         "data.num_workers=0", "train.warmup_steps=0"]


def model(args) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights in every run
    return nn.Sequential(nn.Dropout(0.1), Net(args.width, args.depth))


def data(args, n: int):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, args.width, generator=g), torch.randn(n, args.width, generator=g)
    return torch.utils.data.TensorDataset(x, y), torch.utils.data.TensorDataset(x[:32], y[:32])


def stamps_of(opt: torch.optim.Optimizer) -> list[tuple[float, float]]:
    """``(wall, process CPU)`` seconds after each optimizer step."""
    stamps: list[tuple[float, float]] = []
    opt.register_step_post_hook(lambda *_: stamps.append((time.perf_counter(), time.process_time())))
    return stamps


def speed(args) -> None:
    """One rank of the step-time launch: alternate the default and the global order."""
    ranks = dist.env_world().world_size
    n = args.batch * ranks * (args.steps + 2)
    common = [f"train.max_steps={args.steps}", "train.epochs=1000", 'train.scheduler="constant"',
              f"data.batch_size={args.batch}", *QUIET]
    cfgs = {"default": config("ddp", "cpu", common),
            "global": config("ddp", "cpu", [*common, 'data.order="global"',
                                            f"train.global_batch={args.batch * ranks}"])}
    info, _ = setup_rank(cfgs["default"])
    out: dict[str, list] = {"default": [], "global": [], "pairs": []}
    for repeat in range(args.repeats + 1):
        pair = {}
        for kind in ("default", "global") if repeat % 2 == 0 else ("global", "default"):
            torch.distributed.barrier()
            trainer = Trainer(cfgs[kind], model=model(args), datasets=data(args, n), objective="regression")
            stamps = stamps_of(trainer.optimizer)
            assert trainer.train().global_step == args.steps
            del trainer
            gc.collect()
            kept = stamps[args.skip:]
            intervals = [b[0] - a[0] for a, b in zip(kept, kept[1:])]
            cpu = (kept[-1][1] - kept[0][1]) / (len(kept) - 1)  # this rank's CPU seconds per step
            pair[kind] = (statistics.median(intervals), cpu)
            if repeat:
                out[kind] += intervals
        if repeat:
            out["pairs"].append([*pair["default"], *pair["global"]])
    write_rank(args.out, info, {"rank": info.rank, **out})
    torch.distributed.barrier()


def trajectory(args) -> None:
    """One rank of a drift launch: ``--job whole`` (every step's weights), ``stop`` (stopped
    after ``--stop`` steps, checkpoint in ``--run``) or ``resume`` (from that checkpoint)."""
    # global_batch = 4 micro-batches (2 would add in the same order at 1 and 2 ranks): an epoch of drift_steps steps
    n = args.batch * 4 * args.drift_steps
    cfg = config("ddp", "cpu", ["train.epochs=1", "train.warmup_steps=2", f"data.batch_size={args.batch}",
                                'data.order="global"', f"train.global_batch={args.batch * 4}", *QUIET[:-1]])
    info, _ = setup_rank(cfg)
    run = Path(args.run_dir)
    trainer = Trainer(cfg, run_dir=run, model=model(args), datasets=data(args, n), objective="regression")
    weights: dict[int, torch.Tensor] = {}

    def record(tr) -> None:
        weights[tr.state.global_step] = nn.utils.parameters_to_vector(unwrap(tr.model).parameters()).detach().clone()
        if args.job == "stop" and tr.state.global_step == args.stop:
            tr.stop.request("benchmark")

    trainer.callbacks.append(record)
    trainer.train(checkpoint_dir=run / "model", resume_from=run / "model" / "last" if args.job == "resume" else None)
    if info.is_main:
        torch.save(weights, args.out / f"{args.job}.pt")
    write_rank(args.out, info, {"rank": info.rank})


def drift(a: dict[int, torch.Tensor], ref: dict[int, torch.Tensor]) -> dict[int, float]:
    return {s: ((w - ref[s]).abs().max() / ref[s].abs().max()).item() for s, w in sorted(a.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="data.batch_size (per rank)")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per timed run")
    ap.add_argument("--skip", type=int, default=3, help="first step stamps of each run dropped")
    ap.add_argument("--repeats", type=int, default=16, help="pairs of timed runs (one of each order)")
    ap.add_argument("--drift-steps", type=int, default=24, help="steps of the drift runs")
    ap.add_argument("--stop", type=int, default=8, help="the 2-rank drift run stops after this step")
    ap.add_argument("--no-drift", action="store_true", help="the step-time figure only")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = ["--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    if args.worker:
        warnings.filterwarnings("ignore")
        logging.getLogger("pimm").setLevel(logging.WARNING)
        return speed(args) if args.job == "speed" else trajectory(args)

    load_start = load_average()
    from timeit import timeit

    from pimm_core.data.global_order import seed_micro_batch

    reseed_us = timeit(lambda: seed_micro_batch(0, 5, 3), number=1000) * 1e3  # the global order's extra work
    with tempfile.TemporaryDirectory(prefix="pimm-elastic-") as work:
        w = Path(work)
        recs = torchrun(Path(__file__), args.nproc, [*shape, "--job", "speed", "--steps",
                                                     str(args.steps), "--skip", str(args.skip), "--repeats",
                                                     str(args.repeats)], w / "speed", args.timeout)
        rec = recs[0]
        d, g = statistics.median(rec["default"]) * 1e3, statistics.median(rec["global"]) * 1e3
        ratios = sorted(pg / pd for pd, _, pg, _ in recs[0]["pairs"])
        # CPU per step, both ranks: nearly blind to the CPU time other jobs take from a loaded machine
        cpu_ratios = sorted(sum(rk["pairs"][i][3] for rk in recs) / sum(rk["pairs"][i][1] for rk in recs)
                            for i in range(args.repeats))
        load_mid = load_average()
        if not args.no_drift:
            steps = ["--drift-steps", str(args.drift_steps), "--stop", str(args.stop)]
            for nproc, job, run in ((2, "whole", "two"), (1, "whole1", "one"), (2, "stop", "resumed"),
                                    (1, "resume", "resumed")):
                torchrun(Path(__file__), nproc, [*shape, *steps, "--job", job, "--run-dir", str(w / run)],
                         w / "drift", args.timeout)
            t = {k: torch.load(w / "drift" / f"{k}.pt") for k in ("whole", "whole1", "stop", "resume")}
    report = {
        "nproc": args.nproc, "model": {"params": param_count(args.width, args.depth), "width": args.width,
                                       "depth": args.depth, "input_dropout": 0.1},
        "step": {"batch_per_rank": args.batch, "steps_per_run": args.steps, "pairs": args.repeats,
                 "ratio": r(statistics.median(ratios)), "target_ratio": 1.02,
                 "pair_ratios": [r(x) for x in ratios],
                 "pair_ratio_quartiles": [r(q) for q in statistics.quantiles(ratios, n=4)] if len(ratios) > 1 else None,
                 "cpu_ratio": r(statistics.median(cpu_ratios)), "cpu_pair_ratios": [r(x) for x in cpu_ratios],
                 "cpu_pair_ratio_quartiles": [r(q) for q in statistics.quantiles(cpu_ratios, n=4)]
                 if len(cpu_ratios) > 1 else None,
                 "cpu_ms_per_step_per_rank": {k: r(statistics.median(sum(rk["pairs"][i][j] for rk in recs) / len(recs)
                                                                    for i in range(args.repeats)) * 1e3, 3)
                                              for k, j in (("default", 1), ("global", 3))},
                 "default_ms": r(d, 3), "global_ms": r(g, 3), "ratio_pooled": r(g / d),
                 "reseed_per_micro_batch_us": r(reseed_us, 1), "intervals_per_order": len(rec["default"]),
                 "load_average_after": load_mid},
        "machine": machine(None, load_start),
    }
    if not args.no_drift:
        resumed = drift(t["resume"], t["whole"])
        plain = drift(t["whole1"], t["whole"])
        report["drift"] = {"steps": args.drift_steps, "stop": args.stop, "global_batch": 4 * args.batch,
                           "stopped_2_rank_run_at_stop_vs_reference": drift({args.stop: t["stop"][args.stop]},
                                                                            t["whole"])[args.stop],
                           "resumed_2_to_1_max": max(resumed.values()), "uninterrupted_1_vs_2_max": max(plain.values()),
                           "resumed_2_to_1_per_step": {s: float(f"{v:.3g}") for s, v in resumed.items()},
                           "uninterrupted_1_vs_2_per_step": {s: float(f"{v:.3g}") for s, v in plain.items()}}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
