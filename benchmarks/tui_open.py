"""How long the operator console takes to open a run with a very long metrics.jsonl.

Writes a synthetic run directory (config.toml, status.json of a live-looking run,
metrics.jsonl with N training lines and an evaluation every 1,000 steps, train.log),
then measures, and prints one JSON object:

- ``baseline_read_s``: reading the whole file and counting newlines (like ``wc -l``);
- ``reader_first_poll_s``: :class:`pimm_core.watch.snapshot.RunReader`'s first poll (tail +
  sampled history + byte scan for evaluations);
- ``app_open_s``: ``build_app`` to the Live view drawn with the newest step, headless
  (Textual ``run_test`` at 80x24);
- ``append_poll_s``: the next poll after 1,000 more lines were appended;
- ``tab_switch_s``: a key press that switches views, once the run is open;
- ``process_imports_s``: a fresh interpreter importing ``pimm_core.cli`` and ``pimm_tui``
  (what ``pimm tui`` pays before ``app_open_s``).

Usage: ``uv run python benchmarks/tui_open.py [--lines 1000000] [--keep DIR]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path


def write_run(run: Path, lines: int) -> int:
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.toml").write_text('[train]\nepochs = 100\n[eval]\nmetric = "val/acc"\nmode = "max"\n')
    now = time.time()
    t0 = now - lines * 0.001
    with open(run / "metrics.jsonl", "w", encoding="utf-8", buffering=1 << 20) as f:
        for step in range(1, lines + 1):
            f.write(json.dumps({"step": step, "epoch": step // 10_000, "iter": step % 10_000, "split": "train",
                                "loss": 2.0 / (1 + step / 1000), "lr": 1e-3, "samples_per_s": 16_000.0,
                                "time": round(t0 + step * 0.001, 3)}) + "\n")
            if step % 1000 == 0:
                f.write(json.dumps({"step": step, "epoch": step // 10_000, "iter": 0, "split": "val",
                                    "loss": 1.0 / (1 + step / 1000), "acc": 1 - 1 / (1 + step / 1000),
                                    "time": round(t0 + step * 0.001, 3)}) + "\n")
    (run / "train.log").write_text("".join(f"12:00:00,000 INFO step {s}\n" for s in range(0, lines, 1000)))
    (run / "status.json").write_text(json.dumps({
        "state": "running", "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": now, "step": lines,
        "epoch": lines // 10_000, "iter": lines % 10_000, "total_steps": lines * 2, "steps_per_epoch": 10_000,
        "epochs": lines * 2 // 10_000}))
    return (run / "metrics.jsonl").stat().st_size


def baseline_read(path: Path) -> tuple[float, int]:
    t = time.perf_counter()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
    return time.perf_counter() - t, n


async def app_open(run: Path, lines: int) -> dict[str, float]:
    from pimm_tui import build_app

    t = time.perf_counter()
    app = build_app(run, refresh_s=0.25)
    app.animation_level = "none"
    out: dict[str, float] = {}
    async with app.run_test(size=(80, 24)) as pilot:
        while not (app.snapshot is not None and app.snapshot.step == lines):
            await pilot.pause(0.01)
        await pilot.pause(0)  # let the Live view draw
        out["app_open_s"] = time.perf_counter() - t
        out["plot_points"] = float(app.query_one("#loss-plot").points_shown)
        with open(run / "metrics.jsonl", "a", encoding="utf-8") as f:
            for step in range(lines + 1, lines + 1001):
                f.write(json.dumps({"step": step, "split": "train", "loss": 0.1, "lr": 1e-3, "time": time.time()}) + "\n")
        t = time.perf_counter()
        while app.snapshot.last_train["step"] != lines + 1000:
            await pilot.pause(0.01)
        out["append_seen_s"] = time.perf_counter() - t
        t = time.perf_counter()
        await pilot.press("2")
        out["tab_switch_s"] = time.perf_counter() - t
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, default=None, help="write the run here and keep it")
    args = ap.parse_args()
    tmp = None
    if args.keep is not None:
        run = args.keep
    else:
        tmp = tempfile.mkdtemp(prefix="pimm-tui-bench-")
        run = Path(tmp) / "bench" / "big"
    try:
        size = write_run(run, args.lines)
        baseline_s, newlines = baseline_read(run / "metrics.jsonl")
        from pimm_core.watch.snapshot import RunReader

        t = time.perf_counter()
        reader = RunReader(run)
        snap = reader.poll()
        first_poll = time.perf_counter() - t
        t = time.perf_counter()
        reader.poll()
        idle_poll = time.perf_counter() - t
        result = {
            "lines": newlines, "bytes": size,
            "baseline_read_s": round(baseline_s, 4),
            "reader_first_poll_s": round(first_poll, 4),
            "reader_idle_poll_s": round(idle_poll, 5),
            "evals_found": len(reader.metrics.val),
            "best_step": snap.best_val["step"] if snap.best_val else None,
        }
        import subprocess

        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import pimm_core.cli, pimm_tui"], check=True)
        result["process_imports_s"] = round(time.perf_counter() - t, 4)
        app = asyncio.run(app_open(run, args.lines))
        result.update({k: round(v, 4) for k, v in app.items()})
        result["app_open_under_2s"] = result["app_open_s"] < 2.0
        result["with_imports_under_2s"] = result["app_open_s"] + result["process_imports_s"] < 2.0
        print(json.dumps(result, indent=2))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
