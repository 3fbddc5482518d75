"""Tensor parallel vs DDP on the bundled char LM at N ranks: memory per rank and step time.

Each layout is one torchrun launch of N ranks (default 2; gloo on CPU) running pimm's own
``Trainer`` on ``configs/charlm.toml`` (dropout off, no checkpoints, no evaluation until the
end) for ``--steps`` optimizer steps:

- ``ddp``: ``train.strategy = "ddp"``, N data-parallel ranks (each holds the whole model);
- ``tp``: ``parallel.tp = N`` (the built-in char-LM plan: q/k/v and the MLP's first layer
  colwise, the attention output and the MLP's second layer rowwise; embeddings, norms and
  the tied head whole on every rank).

Figures per rank: ``params`` and ``optimizer`` bytes (the local shards of DTensors:
:func:`pimm_core.train.tensor_parallel.memory_bytes`, AdamW's ``exp_avg``/``exp_avg_sq``),
taken after training; ``step_s``: the median time between consecutive optimizer steps
(``on_step_end``), the first ``--warmup`` steps left out. Both layouts use the same per-rank
micro-batch, so DDP's step trains N times the samples of TP's (``samples_per_s`` says so).
Ratios are TP / DDP of the per-rank maximum; the launches alternate, medians over
``--repeats``. Target: ``memory_ratio`` (parameters + optimizer) <= 0.6 at 2 ranks.

    uv run python benchmarks/tp_memory.py [--nproc 2] [--d-model 128] [--layers 4] [--heads 4]
        [--steps 30] [--warmup 5] [--repeats 3] [-- extra.config=overrides ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine, median, r  # noqa: E402
from _dist_common import MiB, torchrun, write_rank  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = ("ddp", "tp")


def worker(args) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("pimm").setLevel(logging.WARNING)
    from dataclasses import replace

    from pimm_core import Trainer, load_config
    from pimm_core.process import dist
    from pimm_core.checkpoint.tensors.state import unwrap
    from pimm_core.train.tensor_parallel import memory_bytes

    overrides = [f"model.args.d_model={args.d_model}", f"model.args.n_layers={args.layers}",
                 f"model.args.n_heads={args.heads}", "model.args.dropout=0.0", "train.log_every_steps=1000",
                 "ema.enabled=false", "eval.weights=raw", *args.overrides]
    if args.layout == "tp":
        overrides.append(f"parallel.tp={os.environ['WORLD_SIZE']}")  # (all ranks of the launch)
    cfg = load_config(REPO / "configs" / "charlm.toml", overrides)
    trainer = Trainer(cfg)
    stamps: list[float] = []
    trainer.callbacks.append(lambda tr: stamps.append(time.perf_counter()))
    trainer.train(replace(cfg.train, max_steps=args.steps))
    gaps = [b - a for a, b in zip(stamps, stamps[1:])][args.warmup:]
    mem = memory_bytes(unwrap(trainer.model), trainer.optimizer)
    samples = cfg.data.batch_size * trainer._t.grad_accum * trainer.data_info.world_size
    write_rank(args.out, trainer.info, {"rank": trainer.info.rank, **mem, "step_s": median(gaps),
                                         "samples_per_step": samples})
    del trainer
    dist.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", choices=LAYOUTS, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every rank")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    load_start = load_average()
    runs: dict[str, list[list[dict]]] = {k: [] for k in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="pimm-tp-") as work:
        for _ in range(args.repeats):
            for layout in LAYOUTS:
                common = ["--layout", layout, "--d-model", str(args.d_model), "--layers",
                          str(args.layers), "--heads", str(args.heads), "--steps", str(args.steps), "--warmup",
                          str(args.warmup), "--", *args.overrides]
                runs[layout].append(torchrun(Path(__file__), args.nproc, common, Path(work) / layout, args.timeout))
    out: dict = {}
    for layout, repeats in runs.items():
        worst = {k: median([max(rec[k] for rec in ranks) for ranks in repeats])
                 for k in ("params", "optimizer", "total", "step_s")}
        out[layout] = {"per_rank_mib": [{k: r(rec[k] / MiB, 3) for k in ("params", "optimizer", "total")}
                                        for rec in repeats[0]],
                       "max_over_ranks_mib": {k: r(worst[k] / MiB, 3) for k in ("params", "optimizer", "total")},
                       "step_s": r(worst["step_s"], 4), "samples_per_step": repeats[0][0]["samples_per_step"],
                       "samples_per_s": r(repeats[0][0]["samples_per_step"] / worst["step_s"], 1)}
    ratio = out["tp"]["max_over_ranks_mib"]["total"] / out["ddp"]["max_over_ranks_mib"]["total"]
    print(json.dumps({
        "nproc": args.nproc, "model": {"d_model": args.d_model, "layers": args.layers, "heads": args.heads,
                                       "config": "configs/charlm.toml", "optimizer": "AdamW"},
        "steps": args.steps, "overrides": args.overrides,
        "memory_ratio": r(ratio, 3), "target_memory_ratio": 0.6, "met": ratio <= 0.6,
        "step_time_ratio": r(out["tp"]["step_s"] / out["ddp"]["step_s"], 3),
        **out, "repeats": args.repeats, "machine": machine(None, load_start),
    }, indent=2))


if __name__ == "__main__":
    main()
