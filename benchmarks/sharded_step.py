"""Step time at N ranks: pimm's Trainer vs a hand-written DDP or FSDP2 loop, same launch, same model.

``trainer_overhead.py`` for several ranks and both strategies. One torchrun launch of N
ranks per strategy; inside it repeats alternate pimm / hand loop (one warm-up pair
dropped), each training ``--steps`` optimizer steps of the ``Block`` stack
(``benchmarks/_dist_common.py``) on random regression data (``(n, width)`` inputs and
targets; MSE):

- ``pimm``: ``Trainer(cfg, model=Net(...), datasets=(train, val), objective="regression")``
  with ``train.strategy``, ``train.blocks = ["Block"]``, ``train.max_steps``, no
  evaluation, no checkpoint, constant LR, no clipping; ``train.amp``,
  ``train.compile`` and ``[fsdp]`` from the overrides.
- ``hand``: the same model and initial weights, ``DistributedDataParallel`` or
  ``fully_shard`` of each ``Block`` then the root (the root not resharded after
  forward, as pimm), ``MixedPrecisionPolicy`` from the same ``fsdp.param_dtype`` /
  ``fsdp.reduce_dtype``, ``model.compile()`` when ``train.compile``,
  ``torch.optim.AdamW`` with the same lr and weight decay, ``DistributedSampler`` +
  ``DataLoader`` of the same batch size, ``torch.autocast`` bf16 when ``train.amp =
  "bf16"``; forward, ``F.mse_loss``, backward, step, ``zero_grad``. pimm's extras (the
  non-finite gradient check with its all-reduce, the stop agreement, counters, periodic
  loss logging, the stateful loader) are the overhead measured.

Step time: intervals between consecutive optimizer steps (``register_step_post_hook``),
the first ``--skip`` of each repeat dropped (loader start-up, compilation); on CUDA the
hook fires when the step is queued, so ``*_mean_ms`` (the measured span / intervals) is
the throughput figure there. Rank 0's figures. Prints one JSON object per launch set::

    uv run python benchmarks/sharded_step.py [--nproc 2] [--strategies ddp fsdp] [--steps 20] [--repeats 2]
        [--width 512] [--depth 4] [--batch 16] [--device cpu|cuda|auto] [-- train.amp="bf16" train.compile=true ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine, r  # noqa: E402
from _dist_common import Net, config, param_count, setup_rank, torchrun, write_rank  # noqa: E402
from pimm_core.train.parallel import _DTYPES  # noqa: E402
from pimm_core.trainer import Trainer  # noqa: E402


def stamps_of(opt: torch.optim.Optimizer) -> list[float]:
    stamps: list[float] = []
    opt.register_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    return stamps


def data(args, info):
    g = torch.Generator().manual_seed(0)
    n = args.batch * info.world_size * (args.steps + 2)
    x, y = torch.randn(n, args.width, generator=g), torch.randn(n, args.width, generator=g)
    return torch.utils.data.TensorDataset(x, y), torch.utils.data.TensorDataset(x[:64], y[:64])


def run_pimm(cfg, args, info) -> list[float]:
    train, val = data(args, info)
    trainer = Trainer(cfg, model=Net(args.width, args.depth), datasets=(train, val), objective="regression")
    stamps = stamps_of(trainer.optimizer)
    state = trainer.train()
    assert state.global_step == args.steps, state
    del trainer
    return stamps


def run_hand(cfg, args, info, device) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    t = cfg.train
    torch.manual_seed(t.seed)
    model = Net(args.width, args.depth).to(device)
    if t.strategy == "fsdp":
        mesh = init_device_mesh(device.type, (info.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=_DTYPES.get(cfg.fsdp.param_dtype or ""),
                                  reduce_dtype=_DTYPES.get(cfg.fsdp.reduce_dtype or ""))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.fsdp.reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    if t.compile:
        model.compile()
    if t.strategy == "ddp" and info.distributed:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    train, _ = data(args, info)
    sampler = torch.utils.data.DistributedSampler(train, num_replicas=info.world_size, rank=info.rank, seed=t.seed)
    loader = torch.utils.data.DataLoader(train, batch_size=cfg.data.batch_size, sampler=sampler)
    stamps = stamps_of(opt)
    steps = 0
    model.train()
    while steps < args.steps:
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.amp == "bf16"):
                loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps += 1
            if steps % t.log_every_steps == 0:
                loss.item()  # the host sync pimm's logging does
            if steps == args.steps:
                break
    del model, opt
    return stamps


def worker(args) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("pimm").setLevel(logging.WARNING)
    cfg = config(args.strategy, args.device, [
        f"train.max_steps={args.steps}", "train.epochs=1000", "train.grad_clip=0", 'train.scheduler="constant"',
        "train.warmup_steps=0", "eval.every_epochs=0", "checkpoint.every_epochs=0", "checkpoint.every_steps=0",
        f"data.batch_size={args.batch}", "data.num_workers=0", *args.overrides])
    info, device = setup_rank(cfg)
    out: dict[str, list[float]] = {"pimm": [], "hand": [], "pimm_span": [], "hand_span": []}
    for repeat in range(args.repeats + 1):
        for kind in ("pimm", "hand"):
            torch.distributed.barrier()
            stamps = run_pimm(cfg, args, info) if kind == "pimm" else run_hand(cfg, args, info, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            gc.collect()
            kept = stamps[args.skip:]
            if repeat and len(kept) > 1:
                out[kind] += [b - a for a, b in zip(kept, kept[1:])]
                out[f"{kind}_span"].append((kept[-1] - kept[0]) / (len(kept) - 1))
    write_rank(args.out, info, {"rank": info.rank, **out})
    torch.distributed.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--strategies", nargs="*", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=3, help="first step stamps of each repeat dropped")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="train.device: cpu, cuda or auto")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help='config overrides for both loops, e.g. train.amp="bf16"')
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    import tempfile

    load_start = load_average()
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="pimm-sharded-step-") as work:
        for s in args.strategies:
            common = ["--strategy", s, "--steps", str(args.steps), "--skip", str(args.skip), "--repeats",
                      str(args.repeats), "--width", str(args.width), "--depth", str(args.depth), "--batch",
                      str(args.batch), "--device", args.device, "--", *args.overrides]
            rec = torchrun(Path(__file__), args.nproc, common, Path(work) / s, args.timeout)[0]
            p, h = statistics.median(rec["pimm"]) * 1e3, statistics.median(rec["hand"]) * 1e3
            pm, hm = statistics.mean(rec["pimm_span"]) * 1e3, statistics.mean(rec["hand_span"]) * 1e3
            result[s] = {"pimm_step_ms": r(p, 3), "hand_step_ms": r(h, 3), "ratio": r(p / h),
                         "pimm_mean_ms": r(pm, 3), "hand_mean_ms": r(hm, 3), "mean_ratio": r(pm / hm),
                         "intervals_per_loop": len(rec["pimm"]), "launch_s": rec["launch_s"]}
    print(json.dumps({
        "nproc": args.nproc, "device": args.device, "overrides": args.overrides,
        "model": {"params": param_count(args.width, args.depth), "width": args.width, "depth": args.depth},
        "batch_per_rank": args.batch, "steps_per_repeat": args.steps, "repeats": args.repeats,
        "target_ratio": 1.05, **result,
        "machine": machine(None, load_start),
    }, indent=2))


if __name__ == "__main__":
    main()
