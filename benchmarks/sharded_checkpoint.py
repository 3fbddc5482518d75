"""Standard checkpoint of a sharded (FSDP2) model vs a DDP one: save, load, and resume at another world size.

Every rank builds what pimm's trainer builds (``benchmarks/_dist_common.py``: the ``Block``
stack, ``parallelize``, ``build_optimizer``), takes one optimizer step (so AdamW's
``exp_avg``/``exp_avg_sq`` exist) and then saves and loads through pimm's format API
(``make_format("standard", info)``, i.e. ``save_standard``/``load_standard``), as
``Trainer.save_checkpoint`` and a resume do:

- ``save``: ``--repeats`` saves in a row into one model directory (one warm-up dropped),
  each timed from a barrier to the last rank returning (the published ``last/``);
  ``--pause`` seconds of ``os.sync()`` + sleep before each, standing for the training
  between two saves. FSDP also with ``checkpoint.gather_weights = false`` (no
  ``weights.pth``) when this pimm has it (``SaveItem.gather_weights``).
- ``async``: with ``--async-stall``, the same save through ``make_format(..., background=True)``
  (``checkpoint.async``): the stall is the time until ``save`` returns plus the wait in
  ``wait_staged`` (what the trainer waits before its next optimizer step), max over ranks;
  compared with the synchronous save.
- ``load``: a fresh model and optimizer (built outside the timer), then ``format.load``
  of that ``last/``, timed the same way; the files were just written, so the reads come
  from the page cache (the disk's read speed is not measured).
- ``reshard``: the FSDP checkpoint of N ranks loaded by ``--reshard`` other world sizes
  (default 1 and 3): DCP reshards optimizer state (and, with the sharded checkpoint
  layer, the weights) to the new layout. Compared with the same-size FSDP load.

Every load is checked: the full parameters and optimizer state after it (gathered with
``DTensor.full_tensor``) sum to what they summed to when saved (relative 1e-6), and the
JSON says ``restored_ok``. A launch that fails is reported in the JSON as ``error``; the
exit status is then 1 (after the JSON), as when any ``restored_ok`` is false. Strategies
run as separate torchrun launches. CPU with more ranks than cores oversubscribes (this VM
has 2): the 3-rank figure includes that.

Prints one JSON object; ratios are FSDP / DDP and reshard / same-size. Usage::

    uv run python benchmarks/sharded_checkpoint.py [--nproc 2] [--width 1024] [--depth 4] [--repeats 3]
        [--pause 1] [--reshard 1 3] [--async-stall] [--device cpu|cuda|auto] [--dir /tmp] [-- overrides ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine, median, r, tree_bytes  # noqa: E402
from _dist_common import MiB, build, config, param_count, setup_rank, torchrun, train_step, write_rank  # noqa: E402
from pimm_core.process import dist  # noqa: E402
from pimm_core.checkpoint.formats.choose import make_format  # noqa: E402
from pimm_core.checkpoint.formats.protocol import SaveItem  # noqa: E402

HAS_GATHER_FLAG = "gather_weights" in {f.name for f in dataclasses.fields(SaveItem)}


def fingerprint(model, opt) -> list[float]:
    """[sum, sum of squares] of the full parameters and of the full optimizer state (collective)."""
    out = []
    for tensors in ([p.detach() for p in model.parameters()],
                    [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]):
        a = b = 0.0
        for t in tensors:
            full = (t.full_tensor() if hasattr(t, "full_tensor") else t).double()
            a += float(full.sum())
            b += float(full.pow(2).sum())
        out += [a, b]
    return out


def same(x: list[float], y: list[float]) -> bool:
    return all(abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b)) for a, b in zip(x, y))


def max_over_ranks(seconds: float) -> float:
    return max(dist.all_gather_object(seconds))


def timed(fn) -> tuple[float, object]:
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return max_over_ranks(time.perf_counter() - t0), out


def pause(seconds: float, info) -> None:
    if info.local_rank == 0:
        os.sync()
    time.sleep(seconds)


def item(model, opt, info, step: int, **extra) -> SaveItem:
    meta = {"trainer": {"global_step": step, "epoch": 0, "iter": step}, "scheduler": {}, "scaler": {},
            "world_size": info.world_size, "workers_per_rank": 0}
    manifest = {"kind": "last", "step": step, "epoch": 0, "iter": step, "world_size": info.world_size}
    return SaveItem(model=model, optimizer=opt, meta=meta, rank_state={"rng": torch.get_rng_state()},
                    manifest=manifest, step=step, **extra)


def worker(args) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("pimm").setLevel(logging.WARNING)
    cfg = config(args.strategy, args.device, args.overrides)
    info, device = setup_rank(cfg)
    fmt = make_format("standard", info)
    model_dir = args.ckpt_dir
    rec: dict = {"rank": info.rank, "world_size": info.world_size}

    def fresh():
        m, o = build(cfg, info, device, args.width, args.depth, seed=123)  # other weights than the saved ones
        return m, o

    def load_all(tag: str, expect: list[float]) -> None:
        times, ok = [], True
        for i in range(args.repeats + 1):
            m, o = fresh()
            pause(args.pause, info)
            t, _ = timed(lambda: fmt.load(model_dir / "last", model=m, optimizer=o))
            ok = ok and same(fingerprint(m, o), expect)
            if i:
                times.append(t)
            del m, o
        rec[f"{tag}_s"], rec[f"{tag}_ok"] = times, ok

    if args.role == "save":
        model, opt = build(cfg, info, device, args.width, args.depth)
        x = torch.randn(8, args.width, device=device)
        train_step(model, opt, x, cfg.train.amp)
        expect = fingerprint(model, opt)
        variants = [("save", {})]
        if args.strategy == "fsdp" and HAS_GATHER_FLAG:
            variants.append(("save_no_gather", {"gather_weights": False}))
        for tag, extra in variants:
            times = []
            for i in range(args.repeats + 1):
                pause(args.pause, info)
                t, _ = timed(lambda: fmt.save(model_dir, item(model, opt, info, 1, **extra)))
                if i:
                    times.append(t)
            rec[f"{tag}_s"] = times
            rec[f"{tag}_bytes"] = tree_bytes(model_dir / "last") if info.is_main else None
        if args.async_stall:
            saver = make_format("standard", info, background=True)
            stalls, waits, backgrounds = [], [], []
            for i in range(args.repeats + 1):
                pause(args.pause, info)
                dist.barrier()
                t0 = time.perf_counter()
                saver.save(model_dir, item(model, opt, info, 1), background=True)
                t1 = time.perf_counter()
                saver.wait_staged()
                t2 = time.perf_counter()
                saver.wait()
                t3 = time.perf_counter()
                stall = max_over_ranks(t2 - t0)
                if i:
                    stalls.append(stall)
                    waits.append(max_over_ranks(t2 - t1))
                    backgrounds.append(max_over_ranks(t3 - t1))
            rec.update(async_stall_s=stalls, async_staging_wait_s=waits, async_background_s=backgrounds)
        # the last save above was a full one (gathered weights): what the loads read
        fmt.save(model_dir, item(model, opt, info, 1))
        rec["expect"] = expect
        del model, opt
        load_all("load", expect)
    else:  # "load": another world size reads the checkpoint saved above
        load_all("load", json.loads(args.expect))
    write_rank(args.out, info, rec)
    dist.barrier()


def launch(args, strategy: str, nproc: int, role: str, ckpt_dir: Path, out: Path, expect=None) -> dict:
    common = ["--strategy", strategy, "--role", role, "--ckpt-dir", str(ckpt_dir), "--width", str(args.width),
              "--depth", str(args.depth), "--repeats", str(args.repeats), "--pause", str(args.pause),
              "--device", args.device]
    if expect is not None:
        common += ["--expect", json.dumps(expect)]
    if args.async_stall and role == "save":
        common.append("--async-stall")
    return torchrun(Path(__file__), nproc, [*common, "--", *args.overrides], out, args.timeout)[0]


def med(rec: dict, key: str):
    return r(median(rec[key])) if rec.get(key) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pause", type=float, default=1.0, help="seconds (os.sync + sleep) before each timed save/load")
    ap.add_argument("--reshard", type=int, nargs="*", default=[1, 3], help="world sizes loading the FSDP checkpoint")
    ap.add_argument("--async-stall", action="store_true", help="also time checkpoint.async saves (stall)")
    ap.add_argument("--strategies", nargs="*", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    ap.add_argument("--device", default="cpu", help="train.device: cpu, cuda or auto")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", help=argparse.SUPPRESS)
    ap.add_argument("--role", choices=["save", "load"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--expect", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every rank")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    load_start = load_average()
    work = Path(tempfile.mkdtemp(prefix="pimm-sharded-ckpt-", dir=args.dir))
    result: dict = {}
    try:
        for s in args.strategies:
            try:
                rec = launch(args, s, args.nproc, "save", work / s, work / f"out-{s}")
            except SystemExit as e:  # reported in the JSON; the other strategy still runs
                result[s] = {"error": str(e)}
                continue
            result[s] = {k: v for k, v in {
                "save_s": med(rec, "save_s"), "load_s": med(rec, "load_s"),
                "save_no_gather_s": med(rec, "save_no_gather_s"),
                "async_stall_s": med(rec, "async_stall_s"), "async_staging_wait_s": med(rec, "async_staging_wait_s"),
                "async_background_s": med(rec, "async_background_s"),
                "checkpoint_mib": r(rec["save_bytes"] / MiB, 1),
                "checkpoint_no_gather_mib": r(rec["save_no_gather_bytes"] / MiB, 1) if rec.get("save_no_gather_bytes") else None,
                "restored_ok": rec["load_ok"], "launch_s": rec["launch_s"],
                "seconds_all": {k: [r(x) for x in rec[k]] for k in rec if k.endswith("_s") and isinstance(rec[k], list)},
            }.items() if v is not None}
            if s == "fsdp":
                for n in args.reshard:
                    try:
                        rr = launch(args, s, n, "load", work / s, work / f"out-fsdp-{n}", expect=rec["expect"])
                    except SystemExit as e:
                        result[f"fsdp_{args.nproc}_to_{n}"] = {"error": str(e)}
                        continue
                    result[f"fsdp_{args.nproc}_to_{n}"] = {"load_s": med(rr, "load_s"), "restored_ok": rr["load_ok"],
                                                         "seconds_all": [r(x) for x in rr["load_s"]],
                                                         "launch_s": rr["launch_s"]}
            shutil.rmtree(work / s, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ok = {k: v for k, v in result.items() if "error" not in v}
    ratios: dict = {}
    if "ddp" in ok and "fsdp" in ok:
        d, f = ok["ddp"], ok["fsdp"]
        ratios["save_fsdp_over_ddp"] = r(f["save_s"] / d["save_s"])
        ratios["load_fsdp_over_ddp"] = r(f["load_s"] / d["load_s"])
    for s in ("ddp", "fsdp"):
        if "async_stall_s" in ok.get(s, {}):
            ratios[f"async_stall_over_sync_save_{s}"] = r(ok[s]["async_stall_s"] / ok[s]["save_s"])
    for n in args.reshard:
        if "fsdp" in ok and f"fsdp_{args.nproc}_to_{n}" in ok:
            ratios[f"reshard_load_{args.nproc}_to_{n}_over_same"] = r(
                ok[f"fsdp_{args.nproc}_to_{n}"]["load_s"] / ok["fsdp"]["load_s"])
    print(json.dumps({
        "nproc": args.nproc,
        "model": {"params": param_count(args.width, args.depth), "width": args.width, "depth": args.depth,
                  "optimizer": "AdamW (pimm default)", "state_mib": r(3 * 4 * param_count(args.width, args.depth) / MiB, 1)},
        "device": args.device, "overrides": args.overrides, "sharded_weights_flag": HAS_GATHER_FLAG,
        "ratios": ratios, **result,
        "repeats": args.repeats, "pause_s": args.pause,
        "machine": machine(args.dir, load_start),
    }, indent=2))
    failed = [k for k, v in result.items() if "error" in v]
    bad = [k for k, v in result.items() if not v.get("restored_ok", True)]
    if failed or bad:
        raise SystemExit("sharded_checkpoint: " + "; ".join(
            ([f"failed: {', '.join(failed)}"] if failed else []) +
            ([f"the loaded state differs from the saved one in {', '.join(bad)}"] if bad else [])))


if __name__ == "__main__":
    main()
