"""Trainer overhead: pimm's optimizer-step time vs a hand-written PyTorch loop, same process.

Both loops train the same model (configs/digits.toml's MLP widened to ``model.hidden``)
on the same data (the bundled digits train split), with the same per-rank batch size,
the same AdamW (lr, weight decay), the same DataLoader settings (shuffled, batch_size,
num_workers=0, drop_last=False) and the same initial weights (``train.seed``). Gradient
clipping is off and the LR schedule constant in pimm so that the two do the same
arithmetic; pimm's remaining extras (LambdaLR step, GradScaler no-ops, counters,
periodic loss logging, the stateful loader) are the overhead being measured.

A second comparison (``with_features``) turns on what a real run has: ``ema.enabled``
(pimm's EMA after every step), a ``run_dir`` (``metrics.jsonl`` and ``status.json``
written every ``--log-every`` steps, ``train.log``, provenance) and the per-step stop
agreement (single process: the rank-0 ``control/stop`` poll, at most one stat a second).
Its hand loop does the same arithmetic: the same EMA (``torch._foreach_lerp_`` with the
same warm-up decay) and one flushed JSON line to a file every ``--log-every`` steps.

Step time is the interval between consecutive optimizer steps, taken with an
``optimizer.register_step_post_hook`` on each optimizer, so it includes loading the
batch, forward, backward, the update and all per-step bookkeeping. The first interval
of each repeat (loader start-up) is dropped. Repeats alternate pimm / hand loop; the
first pair is a warm-up and is discarded.

A third comparison (``small_model``) is the quickstart's own size: configs/digits.toml's
64-128-10 MLP at batch 32, with the features on (EMA, metrics.jsonl and status.json every
``--log-every`` steps, the stop agreement, the progress display), where a step is ~1 ms and
a fixed per-step cost shows. It also gives ``parts_us``: each per-step part of pimm's step
and of the hand loop's, timed alone (the best of 5 rounds of ``--part-calls`` calls on the
trained objects; ``logged_step`` is the extra of a step that writes its records, once per
``log_every_steps``, on the training thread; the ``status.json`` write, on a writer thread, is its own
row: CPU of the same process, not of the training thread).

Prints one JSON object::

    {"pimm_step_ms": ..., "hand_step_ms": ..., "ratio": pimm/hand,
     "with_features": {"pimm_step_ms": ..., "hand_step_ms": ..., "ratio": ..., ...},
     "small_model": {"pimm_step_ms": ..., "hand_step_ms": ..., "ratio": ..., "parts_us": {...}, ...},
     "machine": {...}, ...}

Usage: ``uv run python benchmarks/trainer_overhead.py [--steps 60] [--repeats 5] [--hidden 2048] [--batch-size 64]
[--log-every 10] [--no-features] [--small-steps 300] [--no-small] [--threads N] [--on-nonfinite stop]``

``--on-nonfinite continue`` gives pimm the hand loop's policy (a NaN/Inf gradient applied, no
check): then, with clipping off, the gradient norm is computed only on the steps that write
a record (``WindowStep``); the default, ``stop``, checks the norm at every step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pimm_core.config import load_config  # noqa: E402
from pimm_core.data.loaders import build_datasets  # noqa: E402
from pimm_core.models import build_model  # noqa: E402
from pimm_core.trainer import Trainer  # noqa: E402


CPU: list[list[float]] = []  # each run_pimm / run_hand's CPU-time step intervals, in call order


def step_timer(optimizer: torch.optim.Optimizer) -> list[float]:
    """Record ``perf_counter`` after every optimizer step; returns the list it appends to."""
    stamps: list[float] = []
    cpu: list[float] = []  # the process's CPU time at the same moments (all its threads)
    optimizer.register_step_post_hook(lambda *_: (stamps.append(time.perf_counter()), cpu.append(time.process_time())))
    CPU.append(cpu)
    return stamps


def intervals(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # drop the first (loader start-up)


def run_pimm(cfg, run_dir: Path | None = None) -> tuple[list[float], float]:
    trainer = Trainer(cfg, run_dir=run_dir)  # run_dir=None: nothing written
    stamps = step_timer(trainer.optimizer)
    start = time.perf_counter()
    state = trainer.train()  # no checkpoint_dir: saves nothing
    wall = time.perf_counter() - start
    assert state.global_step == cfg.train.max_steps, state
    if run_dir is not None:
        assert (run_dir / "metrics.jsonl").stat().st_size > 0 and trainer.ema is not None
    return intervals(stamps), wall


def run_hand(cfg, metrics_path: Path | None = None) -> tuple[list[float], float]:
    """The hand loop; with ``metrics_path``: plus an EMA of the parameters and a JSON line every log step."""
    data = build_datasets(cfg.data)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, data.in_features, data.in_shape, data.num_classes)
    torch.manual_seed(cfg.train.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    loader = torch.utils.data.DataLoader(data.train, batch_size=cfg.data.batch_size, shuffle=True,
                                         num_workers=cfg.data.num_workers, drop_last=False)
    stamps = step_timer(optimizer)
    steps = 0
    ema = [p.detach().float().clone() for p in model.parameters()] if metrics_path is not None else None
    log = open(metrics_path, "a", encoding="utf-8", buffering=1) if metrics_path is not None else None
    model.train()
    start = time.perf_counter()
    while steps < cfg.train.max_steps:
        for x, y, _ in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                with torch.no_grad():
                    d = min(cfg.ema.decay, (1 + steps) / (10 + steps)) if cfg.ema.warmup else cfg.ema.decay
                    torch._foreach_lerp_(ema, [p.detach().float() for p in model.parameters()], 1.0 - d)
            steps += 1
            if steps % cfg.train.log_every_steps == 0 or (log is not None and steps == 1):
                value = loss.item()  # the same host sync pimm does when it logs
                if log is not None:
                    log.write(json.dumps({"step": steps, "split": "train", "loss": value, "time": time.time()}) + "\n")
                    log.flush()
            if steps == cfg.train.max_steps:
                break
    wall = time.perf_counter() - start
    if log is not None:
        log.close()
    return intervals(stamps), wall


def _best_us(fn, calls: int, rounds: int = 5) -> float:
    """The best of ``rounds`` mean CPU times (this thread's: other processes' load moves it
    less than wall time) of ``calls`` calls of ``fn``, in microseconds."""
    for _ in range(min(calls, 50)):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls)
    return round(best * 1e6, 1)


def parts_us(cfg, run_dir: Path, calls: int) -> dict:
    """Each part of a pimm step and of the hand loop's step on the small model, timed alone (µs)."""
    import contextlib

    from pimm_core.checkpoint.tensors.state import unwrap
    from pimm_core.train.evaluator import to_device
    from pimm_core.train.session import after_step
    from pimm_core.train.step import APPLIED, WindowStep

    trainer = Trainer(cfg, run_dir=run_dir)
    trainer.train()  # (the run's files, scheduler and recorder exist, as after any step)
    model, opt, rec = trainer.model, trainer.optimizer, trainer.recorder
    # train() closed metrics.jsonl: open it again, so a logged step writes its line as in a run
    rec.start(trainer.config, {"kind": "start"}, fresh=False, code_version=None, data_fingerprint=None)
    step = WindowStep(model, opt, trainer.scaler, trainer.ema, trainer.config.train, autocast=contextlib.nullcontext,
                      distributed=False, objective=trainer.objective)
    batch = next(iter(trainer.loader))
    loaders = {"pimm": trainer.loader, "hand": torch.utils.data.DataLoader(
        trainer.data.train, batch_size=cfg.data.batch_size, shuffle=True, num_workers=0, drop_last=False)}
    its = {k: iter(v) for k, v in loaders.items()}

    def next_batch(k):
        try:
            return next(its[k])
        except StopIteration:
            its[k] = iter(loaders[k])
            return next(its[k])

    params = list(model.parameters())

    def pimm_forward_backward():
        step.backward(batch, window_len=1, last_in_window=True)
        step.average.finish(params, lazy=True)  # (as the step: the loss is computed when a record reads it)

    def hand_forward_backward():
        F.cross_entropy(model(batch[0]), batch[1]).backward()

    ema = [p.detach().float().clone() for p in model.parameters()]
    loss = torch.tensor(0.5)
    rec.log_every_steps = 10**9  # the bookkeeping of a step that writes nothing
    s = trainer.state
    s.epoch_start_step = -10**9

    def bookkeeping():
        after_step(trainer, APPLIED, loss, cfg.data.batch_size, 0, None)
        trainer.checkpointer.on_step(run_ends=False)

    def logged():
        rec.log_every_steps = 1
        rec.on_step(0, loss, 1e-3, cfg.data.batch_size, grad_norm=loss)
        rec.log_every_steps = 10**9

    def unlogged():
        rec.on_step(0, loss, 1e-3, cfg.data.batch_size, grad_norm=loss)

    from pimm_core.run import write_status

    status_dir = run_dir / "status-write"  # (beside the run's: not racing its writer thread's last write)
    status_dir.mkdir(exist_ok=True)

    def status_write():  # (a logged step's status.json, as the recorder writes it)
        write_status(status_dir, "running", pids=rec.pids, step=s.global_step, epoch=s.epoch, iter=s.iter,
                     total_steps=rec.total, steps_per_epoch=rec.steps_per_epoch, epochs=rec.epochs, world_size=1,
                     stop_reason=None)

    hand_log = open(run_dir / "hand.jsonl", "a", encoding="utf-8", buffering=1)

    def hand_logged():  # (as run_hand's logged step)
        hand_log.write(json.dumps({"step": 1, "split": "train", "loss": loss.item(), "time": time.time()}) + "\n")
        hand_log.flush()

    with rec.training():
        pimm = {
            "data (next batch)": _best_us(lambda: next_batch("pimm"), calls),
            "to_device": _best_us(lambda: to_device(batch, trainer.device), calls),
            "forward + backward + window average": _best_us(pimm_forward_backward, calls),
            "gradient norm + finite check": _best_us(step.gradients_finite, calls),
            # (as WindowStep.finish: through the GradScaler only when it is enabled, amp = "fp16")
            "optimizer step": _best_us(lambda: (trainer.scaler.step(opt), trainer.scaler.update())
                                       if trainer.scaler.is_enabled() else opt.step(), calls),
            "zero_grad": _best_us(lambda: opt.zero_grad(set_to_none=True), calls),
            "ema update": _best_us(lambda: trainer.ema.update(unwrap(model)), calls),
            "bookkeeping (schedule, recorder, callbacks, time limit, stop agreement, saves due)":
                _best_us(bookkeeping, calls),
            "logged step extra (metrics.jsonl + status.json + progress)":
                round(_best_us(logged, max(calls // 10, 20)) - _best_us(unlogged, calls), 1),
            # the same process's CPU, on status.json's writer thread since issue 38's fourth round (on the
            # training thread before, inside the logged step's extra): one write per logged step
            "status.json write (per logged step; writer thread)": _best_us(status_write, max(calls // 10, 20)),
        }
    hand = {
        "data (next batch)": _best_us(lambda: next_batch("hand"), calls),
        "forward + backward": _best_us(hand_forward_backward, calls),
        "optimizer step": _best_us(opt.step, calls),
        "zero_grad": _best_us(lambda: opt.zero_grad(set_to_none=True), calls),
        "ema update (torch._foreach_lerp_)": _best_us(
            lambda: torch._foreach_lerp_(ema, [p.detach().float() for p in params], 0.001), calls),
        "logged step extra (a flushed JSON line)": _best_us(hand_logged, max(calls // 10, 20)),
    }
    hand_log.close()
    rec.close()
    del trainer
    return {"pimm": pimm, "hand": hand}


def compare(cfg, hand_metrics: bool, repeats: int, steps: int, scratch: Path, tag: str) -> dict:
    """Alternated repeats of pimm (with a run directory) and the hand loop; medians (ms)."""
    feat: dict[str, list[float]] = {"pimm": [], "hand": [], "pimm_wall": [], "hand_wall": [], "pimm_cpu": [],
                                    "hand_cpu": []}
    for repeat in range(repeats + 1):
        run_dir = scratch / f"{tag}-run{repeat}"
        fp, fpw = run_pimm(cfg, run_dir)
        fh, fhw = run_hand(cfg, scratch / f"{tag}-hand{repeat}.jsonl" if hand_metrics else None)
        shutil.rmtree(run_dir, ignore_errors=True)
        if repeat == 0:
            continue  # warm-up
        feat["pimm_cpu"] += intervals(CPU[-2])
        feat["hand_cpu"] += intervals(CPU[-1])
        feat["pimm"] += fp
        feat["hand"] += fh
        feat["pimm_wall"].append(fpw / steps)
        feat["hand_wall"].append(fhw / steps)
    fp_ms, fh_ms = statistics.median(feat["pimm"]) * 1e3, statistics.median(feat["hand"]) * 1e3
    fpw_ms, fhw_ms = statistics.median(feat["pimm_wall"]) * 1e3, statistics.median(feat["hand_wall"]) * 1e3
    pc, hc = statistics.median(feat["pimm_cpu"]) * 1e3, statistics.median(feat["hand_cpu"]) * 1e3
    return {"pimm_step_ms": round(fp_ms, 3), "hand_step_ms": round(fh_ms, 3), "ratio": round(fp_ms / fh_ms, 4),
            "pimm_wall_per_step_ms": round(fpw_ms, 3), "hand_wall_per_step_ms": round(fhw_ms, 3),
            "wall_ratio": round(fpw_ms / fhw_ms, 4),
            # CPU time between consecutive steps (the process's, every thread): the load moves it far less
            "pimm_cpu_step_ms": round(pc, 3), "hand_cpu_step_ms": round(hc, 3), "cpu_ratio": round(pc / hc, 4),
            "pimm_cpu_step_ms_mean": round(statistics.mean(feat["pimm_cpu"]) * 1e3, 3),
            "hand_cpu_step_ms_mean": round(statistics.mean(feat["hand_cpu"]) * 1e3, 3)}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "os": platform.platform()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per repeat")
    ap.add_argument("--repeats", type=int, default=5, help="measured repeats of each loop (plus one warm-up)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--log-every", type=int, default=10, help="train.log_every_steps of the with_features comparison")
    ap.add_argument("--no-features", action="store_true", help="skip the with_features comparison")
    ap.add_argument("--small-steps", type=int, default=300, help="optimizer steps per repeat of the small_model row")
    ap.add_argument("--part-calls", type=int, default=300, help="calls per round of each part in parts_us")
    ap.add_argument("--no-small", action="store_true", help="skip the small_model row")
    ap.add_argument("--no-large", action="store_true", help="only the small_model row")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--on-nonfinite", choices=["stop", "skip", "continue"], default="stop",
                    help="train.on_nonfinite of every pimm run (default: the config's default, stop; continue: "
                         "like the hand loop, no finite check, so no gradient norm on a step that writes no record)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    warnings.filterwarnings("ignore")
    logging.getLogger("pimm").setLevel(logging.WARNING)
    load_start = [round(x, 2) for x in os.getloadavg()]
    cfg = load_config(REPO / "configs" / "digits.toml", [
        f"model.hidden={args.hidden}", f"data.batch_size={args.batch_size}", "data.num_workers=0",
        "train.epochs=1000", f"train.max_steps={args.steps}", "train.grad_clip=0", "train.scheduler=constant",
        "train.warmup_steps=0", "train.amp=none", "train.device=cpu", f"train.on_nonfinite={args.on_nonfinite}",
        "eval.every_epochs=0", "checkpoint.every_epochs=0", "checkpoint.every_steps=0",
    ])
    features = None if args.no_features else load_config(REPO / "configs" / "digits.toml", [
        f"model.hidden={args.hidden}", f"data.batch_size={args.batch_size}", "data.num_workers=0",
        "train.epochs=1000", f"train.max_steps={args.steps}", "train.grad_clip=0", "train.scheduler=constant",
        "train.warmup_steps=0", "train.amp=none", "train.device=cpu", f"train.on_nonfinite={args.on_nonfinite}",
        "eval.every_epochs=0", "checkpoint.every_epochs=0", "checkpoint.every_steps=0",
        "ema.enabled=true", f"train.log_every_steps={args.log_every}",
    ])
    feat: dict[str, list[float]] = {"pimm": [], "hand": [], "pimm_wall": [], "hand_wall": []}
    scratch = Path(tempfile.mkdtemp(prefix="pimm-overhead-"))

    pimm_steps: list[float] = []
    hand_steps: list[float] = []
    pimm_walls: list[float] = []
    hand_walls: list[float] = []
    small = None
    if not args.no_small:
        small_cfg = load_config(REPO / "configs" / "digits.toml", [
            "data.num_workers=0", "train.epochs=1000", f"train.max_steps={args.small_steps}", "train.grad_clip=0",
            "train.scheduler=constant", "train.warmup_steps=0", "train.amp=none", "train.device=cpu",
            f"train.on_nonfinite={args.on_nonfinite}", "eval.every_epochs=0", "checkpoint.every_epochs=0",
            "checkpoint.every_steps=0",
            "ema.enabled=true", f"train.log_every_steps={args.log_every}",
        ])
        small = {**compare(small_cfg, True, args.repeats, args.small_steps, scratch, "small"),
                 "model": {"name": small_cfg.model.name, "hidden": small_cfg.model.hidden,
                           "params": sum(p.numel() for p in build_model(small_cfg.model, 64, (1, 8, 8), 10).parameters())},
                 "batch_size": small_cfg.data.batch_size, "log_every_steps": args.log_every,
                 "on_nonfinite": small_cfg.train.on_nonfinite,
                 "features": ["ema", "metrics.jsonl + status.json", "stop agreement (control/stop poll)", "progress"],
                 "parts_us": parts_us(small_cfg, scratch / "parts", args.part_calls)}
    for repeat in range(0 if args.no_large else args.repeats + 1):
        p, pw = run_pimm(cfg)
        h, hw = run_hand(cfg)
        if features is not None:
            run_dir = scratch / f"run{repeat}"
            fp, fpw = run_pimm(features, run_dir)
            fh, fhw = run_hand(features, scratch / f"hand{repeat}.jsonl")
            shutil.rmtree(run_dir, ignore_errors=True)
        if repeat == 0:
            continue  # warm-up
        pimm_steps += p
        hand_steps += h
        pimm_walls.append(pw / args.steps)
        hand_walls.append(hw / args.steps)
        if features is not None:
            feat["pimm"] += fp
            feat["hand"] += fh
            feat["pimm_wall"].append(fpw / args.steps)
            feat["hand_wall"].append(fhw / args.steps)
    shutil.rmtree(scratch, ignore_errors=True)

    if args.no_large:
        print(json.dumps({"small_model": small, "machine": {
            **machine(), "load_average_start": load_start,
            "load_average_end": [round(x, 2) for x in os.getloadavg()]}}, indent=2))
        return
    pimm_ms = statistics.median(pimm_steps) * 1e3
    hand_ms = statistics.median(hand_steps) * 1e3
    with_features = None
    if features is not None:
        fp_ms, fh_ms = statistics.median(feat["pimm"]) * 1e3, statistics.median(feat["hand"]) * 1e3
        fpw_ms, fhw_ms = statistics.median(feat["pimm_wall"]) * 1e3, statistics.median(feat["hand_wall"]) * 1e3
        with_features = {
            "pimm_step_ms": round(fp_ms, 3), "hand_step_ms": round(fh_ms, 3), "ratio": round(fp_ms / fh_ms, 4),
            "pimm_wall_per_step_ms": round(fpw_ms, 3), "hand_wall_per_step_ms": round(fhw_ms, 3),
            "wall_ratio": round(fpw_ms / fhw_ms, 4),
            "features": ["ema", "metrics.jsonl + status.json", "stop agreement (control/stop poll)"],
            "ema_decay": features.ema.decay, "log_every_steps": features.train.log_every_steps,
        }
    print(json.dumps({
        "pimm_step_ms": round(pimm_ms, 3),
        "hand_step_ms": round(hand_ms, 3),
        "ratio": round(pimm_ms / hand_ms, 4),
        "pimm_step_ms_quartiles": [round(q * 1e3, 3) for q in statistics.quantiles(pimm_steps, n=4)],
        "hand_step_ms_quartiles": [round(q * 1e3, 3) for q in statistics.quantiles(hand_steps, n=4)],
        "pimm_wall_per_step_ms": round(statistics.median(pimm_walls) * 1e3, 3),
        "hand_wall_per_step_ms": round(statistics.median(hand_walls) * 1e3, 3),
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "intervals_per_loop": len(pimm_steps),
        "model": {"name": cfg.model.name, "hidden": cfg.model.hidden,
                  "params": sum(p.numel() for p in build_model(cfg.model, 64, (1, 8, 8), 10).parameters())},
        "batch_size": cfg.data.batch_size,
        "with_features": with_features,
        "small_model": small,
        "machine": {**machine(), "load_average_start": load_start, "load_average_end": [round(x, 2) for x in os.getloadavg()]},
    }, indent=2))


if __name__ == "__main__":
    main()
