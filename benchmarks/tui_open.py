"""How long the operator console takes to open a run, at several lengths of metrics.jsonl: the
open must not grow with the file.

For each ``--lines`` count, writes a synthetic run directory (config.toml, status.json of a
live-looking run, metrics.jsonl with N training lines and an evaluation every 1,000 steps,
train.log), then measures, and prints one JSON object with a row per length:

- ``wc_l_s``: ``wc -l metrics.jsonl`` as a process (the baseline: one pass over the bytes);
  ``baseline_read_s``: the same pass in this process;
- ``reader_first_poll_s``: :class:`pimm_core.watch.snapshot.RunReader`'s first poll, what the
  first paint needs (tail + sampled history; the earlier part is scanned after it);
- ``history_s``: the polls after it until every evaluation and non-finite value of the earlier
  part was scanned (a slice per poll; ``evals_found`` must then be every evaluation);
- ``app_open_s``: ``build_app`` to the Live view drawn with the newest step, headless
  (Textual ``run_test`` at 80x24); ``append_seen_s``: 1,000 lines appended, then seen;
  ``tab_switch_s``: a key press that switches views;
- ratios to ``wc -l``: ``first_poll_vs_wc_l`` and ``app_open_vs_wc_l``;

and, over the lengths, ``first_poll_growth`` (first poll at the longest / at the shortest: 1.0
means independent of the length) and ``process_imports_s`` (a fresh interpreter importing
``pimm_core.cli`` and ``pimm_tui``, what ``pimm tui`` pays before ``app_open_s``), with the load.

Usage: ``uv run python benchmarks/tui_open.py [--lines 10000,1000000,5000000] [--keep DIR]``
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
    write_status(run, lines)
    return (run / "metrics.jsonl").stat().st_size


def write_status(run: Path, lines: int) -> None:
    now = time.time()
    (run / "status.json").write_text(json.dumps({
        "state": "running", "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": now, "step": lines,
        "epoch": lines // 10_000, "iter": lines % 10_000, "total_steps": lines * 2, "steps_per_epoch": 10_000,
        "epochs": lines * 2 // 10_000}))


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
        before = (run / "metrics.jsonl").stat().st_size
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
    os.truncate(run / "metrics.jsonl", before)  # (as written: a --keep run is measured again the same)
    return out


def measure(run: Path, lines: int, reuse: bool = False) -> dict[str, object]:
    import subprocess

    if reuse and (run / "metrics.jsonl").is_file():
        write_status(run, lines)  # (the file from an earlier --keep run; app_open appended 1,000 lines to it)
        size = (run / "metrics.jsonl").stat().st_size
    else:
        size = write_run(run, lines)
    wc = []
    for _ in range(3):
        t = time.perf_counter()
        subprocess.run(["wc", "-l", str(run / "metrics.jsonl")], check=True, capture_output=True)
        wc.append(time.perf_counter() - t)
    baseline_s, newlines = baseline_read(run / "metrics.jsonl")
    from pimm_core.watch.snapshot import RunReader

    first = []
    for _ in range(3):
        t = time.perf_counter()
        reader = RunReader(run)
        snap = reader.poll()
        first.append(time.perf_counter() - t)
    t = time.perf_counter()
    polls = 0
    while snap.metrics_history is not None:
        snap = reader.poll()
        polls += 1
    history_s = time.perf_counter() - t
    wc_s = sorted(wc)[1]
    first_s = sorted(first)[1]
    row: dict[str, object] = {
        "lines": newlines, "bytes": size, "wc_l_s": round(wc_s, 4), "baseline_read_s": round(baseline_s, 4),
        "reader_first_poll_s": round(first_s, 4), "history_s": round(history_s, 4), "history_polls": polls,
        "evals_found": len(reader.metrics.val), "evals_written": lines // 1000,
        "best_step": snap.best_val["step"] if snap.best_val else None,
    }
    app = asyncio.run(app_open(run, lines))
    row.update({k: round(v, 4) for k, v in app.items()})
    row["first_poll_vs_wc_l"] = round(first_s / wc_s, 2)
    row["app_open_vs_wc_l"] = round(row["app_open_s"] / wc_s, 2)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", default="10000,1000000,5000000", help="comma-separated metrics.jsonl lengths")
    ap.add_argument("--keep", type=Path, default=None,
                    help="write the runs here and keep them (a later run with the same DIR reuses them)")
    args = ap.parse_args()
    counts = [int(n) for n in args.lines.split(",")]
    base = args.keep if args.keep is not None else Path(tempfile.mkdtemp(prefix="pimm-tui-bench-"))
    load_start = os.getloadavg()
    try:
        import subprocess

        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import pimm_core.cli, pimm_tui"], check=True)
        imports_s = time.perf_counter() - t
        rows = []
        for n in counts:
            run = base / "bench" / f"l{n}"
            rows.append(measure(run, n, reuse=args.keep is not None))
            if args.keep is None:
                shutil.rmtree(run, ignore_errors=True)  # (the 5M-line file is ~800 MB)
        result = {
            "rows": rows,
            "first_poll_growth": round(rows[-1]["reader_first_poll_s"] / rows[0]["reader_first_poll_s"], 2),
            "app_open_growth": round(rows[-1]["app_open_s"] / rows[0]["app_open_s"], 2),
            "process_imports_s": round(imports_s, 4),
            "load_avg_1m": {"start": round(load_start[0], 2), "end": round(os.getloadavg()[0], 2)},
            "cpus": os.cpu_count(),
        }
        print(json.dumps(result, indent=2))
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
