"""Opening ``pimm tui ROOT`` on a root of many runs with long metrics files, against ``pimm runs ls --json``.

Writes a synthetic root: ``--runs`` run directories (``bench/r000``...), each with config.toml,
status.json (one in ten live: this process's pid and a heartbeat that stays fresh, so the
view reads it again on every poll) and a ``--lines``-line metrics.jsonl (an evaluation every 1,000 steps). The
metrics files are hard links of one file: the disk holds one copy, the readers cannot tell.

Each measurement runs in a fresh interpreter (imports included, peak RSS its own), interleaved,
``--repeats`` times (medians), and prints one JSON object:

- ``baseline``: ``pimm runs ls --json ROOT`` (the same rows, printed): wall time and peak RSS;
- ``view``: ``build_runs_app(ROOT)`` headless at 80x24: time to first paint (the table drawn
  with every run), peak RSS; then, with the view polling every two seconds, the latency of a
  key press (the cursor moves; median of 5) and the compare view of two marked runs (``compare_s``: their
  metrics read, bounded, and plotted); after the app, the reader alone: its first poll
  (``cold_poll_s``) and a steady one (``poll_s``: unchanged finished runs are only
  ``stat``-ed, live ones read again: ``summarized_per_poll``);
- ``one_run_console``: ``pimm tui RUN`` on one of those runs (first paint: its Live view drawn),
  the console's fixed cost (Textual) without the table;
- ``ratio``: view / baseline for the time to first paint and the peak RSS (and view / one-run
  console: what the 200 runs add to the console's own start);
- ``runs_ls_per_run_ms``: what one row of ``pimm runs ls`` costs, in-process after the imports
  (``find_runs`` + ``summarize`` of every run, median of 5, divided by the runs; target <= 2 ms), and
  ``runs_ls_cpu_per_run_ms`` the same in CPU seconds of the process (on a busy machine the wall
  time mostly measures the wait for a core). ``--runs-ls-only`` measures only these.

Each run also holds a ``model/`` as a run saving with ``checkpoint.keep_iter`` does: a standard
``last/``, ``model_best.pth`` and ``--snapshots`` ``iter_<step>.pth`` with their sidecars (hard
links of one fabricated set, from ``scripting_latency.fabricate``).

Usage: ``uv run python benchmarks/runs_view.py [--runs 200] [--lines 100000] [--snapshots 5] [--repeats 3] [--keep DIR]
[--runs-ls-only]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Each child prints one JSON line: its wall time from start (imports included) and its peak RSS.
_BASELINE = """
import time; t0 = time.perf_counter()
import contextlib, io, json, resource, sys
sys.argv = ["pimm", "runs", "ls", "--json", sys.argv[1]]
from pimm_core.cli import run
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        run()
    except SystemExit:
        pass
n = len(json.loads(out.getvalue())["runs"])
print(json.dumps({"first_paint_s": time.perf_counter() - t0, "rows": n,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

_ONE_RUN = """
import time; t0 = time.perf_counter()
import asyncio, json, resource, sys
from pathlib import Path
from pimm_tui import build_app

async def main(run):
    app = build_app(Path(run))
    app.animation_level = "none"
    async with app.run_test(size=(80, 24)) as pilot:
        while app.snapshot is None:
            await pilot.pause(0.01)
        await pilot.pause(0)
        out = {"first_paint_s": time.perf_counter() - t0, "rows": 1}
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))

asyncio.run(main(sys.argv[1]))
"""

_VIEW = """
import time; t0 = time.perf_counter()
import asyncio, json, resource, sys
from pathlib import Path
from pimm_tui import build_runs_app

async def main(root, runs):
    app = build_runs_app(Path(root))
    app.animation_level = "none"
    out = {}
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.screen
        while not (screen.polls and len(screen.shown) == runs):
            await pilot.pause(0.01)
        await pilot.pause(0)  # the table drawn
        out["first_paint_s"] = time.perf_counter() - t0
        out["rows"] = len(screen.shown)
        keys = []
        for _ in range(5):  # the cursor moves while the view polls (every 2 s)
            t = time.perf_counter()
            await pilot.press("down")
            keys.append(time.perf_counter() - t)
            await pilot.pause(0.5)
        out["key_s"] = sorted(keys)[2]
        t = time.perf_counter()
        await pilot.press("m", "down", "m", "c")
        while getattr(app.screen, "runs", None) is None:
            await pilot.pause(0.01)
        await pilot.pause(0)
        out["compare_s"] = time.perf_counter() - t
        out["compare_points"] = sum(app.screen.plotted.values())
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    from pimm_core.watch.runs_poll import RunsPoller

    poller = RunsPoller(Path(root))
    t = time.perf_counter()
    poller.poll()
    out["cold_poll_s"] = time.perf_counter() - t
    t = time.perf_counter()
    poller.poll()  # what the view pays every second: unchanged finished runs are only stat-ed
    out["poll_s"] = time.perf_counter() - t
    out["summarized_per_poll"] = poller.summarized
    print(json.dumps(out))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


_PER_RUN = """
import json, sys, time
from pathlib import Path
from pimm_core.watch.runs import find_runs, summarize
root = Path(sys.argv[1])
runs = find_runs(root)
[summarize(r, root) for r in runs]  # (page cache)
times, cpu = [], []
for _ in range(5):
    t, c = time.perf_counter(), time.process_time()
    rows = [summarize(r, root) for r in find_runs(root)]
    times.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
assert all(r.resume == "last" for r in rows), [r.resume for r in rows][:3]
print(json.dumps({"per_run_ms": sorted(times)[2] * 1000 / len(runs), "cpu_per_run_ms": sorted(cpu)[2] * 1000 / len(runs),
                  "rows": len(rows)}))
"""


def write_model(template: Path, snapshots: int) -> None:
    """One ``model/`` (last, model_best.pth, ``snapshots`` iter files with sidecars) to hard-link into each run."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from scripting_latency import fabricate

    fabricate(template, snapshots)


def write_root(root: Path, runs: int, lines: int, snapshots: int = 5) -> int:
    """The synthetic root; returns the bytes of one metrics.jsonl."""
    root.mkdir(parents=True, exist_ok=True)
    template = root.parent / "model-template"
    shutil.rmtree(template, ignore_errors=True)
    write_model(template, snapshots)
    metrics = root / "metrics.jsonl.src"
    now = time.time()
    t0 = now - lines * 0.01
    with open(metrics, "w", encoding="utf-8", buffering=1 << 20) as f:
        for step in range(1, lines + 1):
            f.write(json.dumps({"step": step, "epoch": step // 10_000, "iter": step % 10_000, "split": "train",
                                "loss": 2.0 / (1 + step / 1000), "lr": 1e-3, "samples_per_s": 16_000.0,
                                "grad_norm": 0.5, "time": round(t0 + step * 0.01, 3)}) + "\n")
            if step % 1000 == 0:
                f.write(json.dumps({"step": step, "epoch": step // 10_000, "iter": 0, "split": "val",
                                    "loss": 1.0 / (1 + step / 1000), "acc": 1 - 1 / (1 + step / 1000),
                                    "time": round(t0 + step * 0.01, 3)}) + "\n")
    for i in range(runs):
        run = root / "bench" / f"r{i:03d}"
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.toml").write_text(f'[train]\nepochs = 100\nlr = {0.001 * (1 + i % 7)}\n'
                                         '[data]\nbatch_size = 32\n[eval]\nmetric = "val/acc"\nmode = "max"\n')
        live = i % 10 == 0
        (run / "status.json").write_text(json.dumps({
            "state": "running" if live else "finished", "host": socket.gethostname(), "pid": os.getpid(),
            "pids": [os.getpid()], "heartbeat": now + (86_400 if live else 0), "step": lines, "epoch": lines // 10_000,
            "iter": lines % 10_000, "total_steps": lines * (2 if live else 1), "steps_per_epoch": 10_000,
            "epochs": 10, "world_size": 1}))
        os.link(metrics, run / "metrics.jsonl")
        shutil.copytree(template / "model", run / "model", copy_function=os.link)
    return metrics.stat().st_size


def child(code: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--snapshots", type=int, default=5, help="iter_<step>.pth snapshots in each run's model/")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None, help="write the root here and keep it")
    ap.add_argument("--runs-ls-only", action="store_true", help="only the cost of one `runs ls` row (no console)")
    args = ap.parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]
    tmp = None if args.keep is not None else tempfile.mkdtemp(prefix="pimm-runs-bench-")
    root = args.keep if args.keep is not None else Path(tmp) / "exp"
    try:
        size = write_root(root, args.runs, args.lines, args.snapshots)
        if args.runs_ls_only:
            rows = [child(_PER_RUN, str(root)) for _ in range(args.repeats)]
            print(json.dumps({
                "runs": args.runs, "lines_per_run": args.lines, "snapshots_per_run": args.snapshots,
                "repeats": args.repeats, "runs_ls_per_run_ms": round(median([x["per_run_ms"] for x in rows]), 3),
                "runs_ls_cpu_per_run_ms": round(median([x["cpu_per_run_ms"] for x in rows]), 3),
                "runs_ls_per_run_target_ms": 2.0,
                "machine": {"cores": os.cpu_count(), "python": sys.version.split()[0], "load_average_start": load_start,
                            "load_average_end": [round(x, 2) for x in os.getloadavg()]}}, indent=2))
            return 0
        child(_BASELINE, str(root))  # warm-up (page cache, .pyc), discarded
        base: list[dict] = []
        view: list[dict] = []
        one: list[dict] = []
        for _ in range(args.repeats):
            base.append(child(_BASELINE, str(root)))
            one.append(child(_ONE_RUN, str(root / "bench" / "r001")))
            view.append(child(_VIEW, str(root), str(args.runs)))
        assert all(b["rows"] == args.runs for b in base) and all(v["rows"] == args.runs for v in view)
        per_run_rows = [child(_PER_RUN, str(root)) for _ in range(args.repeats)]
        per_run = [x["per_run_ms"] for x in per_run_rows]

        def med(rows: list[dict], key: str) -> float:
            return round(median([r[key] for r in rows]), 4)

        b = {k: med(base, k) for k in ("first_paint_s", "peak_rss_mib")}
        v = {k: med(view, k) for k in ("first_paint_s", "peak_rss_mib", "cold_poll_s", "poll_s", "key_s",
                                                     "compare_s")}
        o = {k: med(one, k) for k in ("first_paint_s", "peak_rss_mib")}
        v["summarized_per_poll"] = view[-1]["summarized_per_poll"]
        v["compare_points"] = view[-1]["compare_points"]
        result = {
            "runs": args.runs, "lines_per_run": args.lines, "metrics_bytes_per_run": size, "repeats": args.repeats,
            "snapshots_per_run": args.snapshots,
            "runs_ls_per_run_ms": round(median(per_run), 3),
            "runs_ls_cpu_per_run_ms": round(median([x["cpu_per_run_ms"] for x in per_run_rows]), 3),
            "runs_ls_per_run_target_ms": 2.0,
            "baseline_runs_ls_json": b, "one_run_console": o, "view": v,
            "ratio": {"first_paint": round(v["first_paint_s"] / b["first_paint_s"], 2),
                      "peak_rss": round(v["peak_rss_mib"] / b["peak_rss_mib"], 2),
                      "first_paint_vs_one_run_console": round(v["first_paint_s"] / o["first_paint_s"], 2),
                      "peak_rss_vs_one_run_console": round(v["peak_rss_mib"] / o["peak_rss_mib"], 2)},
            "machine": {"cores": os.cpu_count(), "python": sys.version.split()[0],
                        "load_average_start": load_start, "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        }
        print(json.dumps(result, indent=2))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
