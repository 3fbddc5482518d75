"""Memory per rank: the same model trained with ``train.strategy = "ddp"`` and ``"fsdp"`` at N ranks.

Each strategy is one torchrun launch of N ranks (``--nproc-per-node``, default 2; gloo on
CPU, NCCL on CUDA). Every rank builds what pimm's trainer builds, in its order
(``benchmarks/_dist_common.py``): the process group, the model (``Block`` stack, ``--width``
x ``--depth``, ~67M parameters by default) on the device, ``parallelize`` (DDP wrapper, or
FSDP2 ``fully_shard`` of each ``Block`` then the root) and ``build_optimizer`` (AdamW),
then trains ``--steps`` steps on random ``(--batch, width)`` inputs.

Two figures per rank:

- ``state_bytes``: the bytes of parameters + gradients + optimizer state this rank holds,
  taken after the last backward and optimizer step (gradients still present): the
  distinct storages behind ``model.parameters()``, their ``.grad`` and the optimizer's
  state tensors, ``DTensor.to_local()`` under FSDP (padding included). DDP's gradient
  buckets (a second copy of the gradients, inside its reducer) are not visible here;
  the RSS figure includes them.
- memory peak: on CPU the peak RSS (``VmHWM`` of ``/proc/self/status``, reset through
  ``/proc/self/clear_refs`` once the model and optimizer are built) minus the RSS before
  the model was built (``peak_rss_delta``) and minus the RSS once built
  (``training_rss_delta``: what the training steps add: gradients, buckets, optimizer
  state, FSDP's all-gathered blocks, activations); on CUDA ``torch.cuda.max_memory_allocated``
  over the training steps minus the allocation before the model was built.

The model is built whole on every rank before it is sharded (as pimm does), so the RSS
of the set-up includes a full copy under both strategies; glibc may keep the freed copy
mapped under FSDP. So, by default, the ranks run with ``MALLOC_MMAP_THRESHOLD_=1048576``:
every allocation of 1 MiB or more is its own mapping, returned to the system when freed,
and RSS follows the live tensors; ``--glibc-heap`` leaves glibc's dynamic threshold (what
a plain run gets: freed tensors of up to 32 MiB stay in its heap and count in RSS). Ratios are FSDP / DDP of the per-rank maximum over ranks. Target:
``state_ratio <= 0.6`` at 2 ranks. Prints one JSON object. Usage::

    uv run python benchmarks/fsdp_memory.py [--nproc 2] [--width 1024] [--depth 8] [--batch 16] [--steps 3]
        [--device cpu|cuda|auto] [--repeats 1] [--glibc-heap] [-- extra.config=overrides ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine, median, r  # noqa: E402
from _dist_common import (MiB, build, config, param_count, peak_rss, reset_peak_rss, rss, setup_rank,  # noqa: E402
                          state_bytes, torchrun, train_step, write_rank)

STRATEGIES = ("ddp", "fsdp")
MMAP_THRESHOLD = 1 << 20


def worker(args) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("pimm").setLevel(logging.WARNING)
    cfg = config(args.strategy, args.device, args.overrides)
    info, device = setup_rank(cfg)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base_alloc = torch.cuda.memory_allocated(device)
    rss_before = rss()
    model, opt = build(cfg, info, device, args.width, args.depth)
    rss_built = rss()
    reset = reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(1 + info.rank)
    x = torch.randn(args.batch, args.width, device=device)
    for i in range(args.steps):
        train_step(model, opt, x, cfg.train.amp, zero=i < args.steps - 1)
    held = state_bytes(model, opt)  # after the last step, its gradients still held
    opt.zero_grad(set_to_none=True)
    rec = {"rank": info.rank, "state_bytes": held, "rss_before_model": rss_before, "rss_built": rss_built,
           "peak_rss": peak_rss(), "peak_reset": reset}
    rec["peak_rss_delta"] = rec["peak_rss"] - rss_before
    rec["training_rss_delta"] = rec["peak_rss"] - rss_built
    if cuda:
        torch.cuda.synchronize(device)
        rec["cuda_peak_delta"] = torch.cuda.max_memory_allocated(device) - base_alloc
        rec["cuda_device"] = torch.cuda.get_device_name(device)
    write_rank(args.out, info, rec)
    torch.distributed.barrier()


def summarize(runs: dict[str, list[list[dict]]]) -> dict:
    """Per strategy: per-rank figures of the first repeat, and medians over repeats of the max over ranks."""
    out: dict = {}
    for s, repeats in runs.items():
        worst = {k: median([max(_get(rec, k) for rec in ranks) for ranks in repeats])
                 for k in ("state_total", "params", "grads", "optimizer", "peak_rss_delta", "training_rss_delta",
                           "cuda_peak_delta")
                 if all(_get(rec, k) is not None for rec in repeats[0])}
        out[s] = {"per_rank_mib": [{k: r(v / MiB, 1) for k, v in
                                    (("state_total", _get(rec, "state_total")), ("params", _get(rec, "params")),
                                     ("grads", _get(rec, "grads")), ("optimizer", _get(rec, "optimizer")),
                                     ("peak_rss_delta", rec["peak_rss_delta"]),
                                     ("training_rss_delta", rec["training_rss_delta"]),
                                     ("cuda_peak_delta", rec.get("cuda_peak_delta")))
                                    if v is not None} for rec in repeats[0]],
                  "max_over_ranks_mib": {k: r(v / MiB, 1) for k, v in worst.items()},
                  "launch_s": repeats[0][0]["launch_s"]}
    d, f = out["ddp"]["max_over_ranks_mib"], out["fsdp"]["max_over_ranks_mib"]
    out["ratios_fsdp_over_ddp"] = {k: r(f[k] / d[k]) for k in d if k in f and d[k]}
    return out


def _get(rec: dict, key: str):
    if key == "state_total":
        return rec["state_bytes"]["total"]
    if key in ("params", "grads", "optimizer"):
        return rec["state_bytes"][key]
    return rec.get(key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1, help="launches per strategy, alternating (memory barely varies)")
    ap.add_argument("--device", default="cpu", help="train.device: cpu, cuda or auto")
    ap.add_argument("--glibc-heap", action="store_true", help="keep glibc's default mmap threshold in the ranks")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", choices=STRATEGIES, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every rank, e.g. fsdp.param_dtype=\"bfloat16\"")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    load_start = load_average()
    runs: dict[str, list[list[dict]]] = {s: [] for s in STRATEGIES}
    env = {} if args.glibc_heap else {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    with tempfile.TemporaryDirectory(prefix="pimm-fsdp-mem-") as work:
        for _ in range(args.repeats):
            for s in STRATEGIES:
                common = ["--strategy", s, "--width", str(args.width), "--depth", str(args.depth), "--batch",
                          str(args.batch), "--steps", str(args.steps), "--device", args.device, "--", *args.overrides]
                runs[s].append(torchrun(Path(__file__), args.nproc, common, Path(work) / s, args.timeout, env))
    summary = summarize(runs)
    ratios = summary["ratios_fsdp_over_ddp"]
    print(json.dumps({
        "nproc": args.nproc,
        "model": {"params": param_count(args.width, args.depth), "width": args.width, "depth": args.depth,
                  "dtype": "float32", "optimizer": "AdamW (pimm default)", "blocks": "Block"},
        "batch": args.batch, "steps": args.steps, "device": args.device, "overrides": args.overrides,
        "malloc": "glibc default" if args.glibc_heap else f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}",
        "state_ratio": ratios.get("state_total"),
        "target_state_ratio": 0.6,
        "met": ratios.get("state_total") is not None and ratios["state_total"] <= 0.6,
        **summary,
        "repeats": args.repeats,
        "machine": machine(None, load_start),
    }, indent=2))


if __name__ == "__main__":
    main()
