"""pimm's standard save and load of the peers' state, one code tree against another, alternated.

Usage::

    uv run python benchmarks/save_load_trees.py --trees BEFORE AFTER [--mib 108 624] [--width 1024]
        [--pairs 3] [--saves 3] [--dir /tmp]

``BEFORE``/``AFTER``: directories holding a ``pimm_core`` (e.g. ``git archive <commit> | tar -x -C
DIR``, and this checkout). Each pair runs one process per tree, in turn; each process builds
the state of ``benchmarks/peers.py`` (a stack of ``Linear(--width, --width)`` + AdamW after one
step, >= ``--mib`` MiB), then ``--saves`` times (after one warm-up) ``save_standard`` into a
model dir holding the previous save and ``load_standard`` into a freshly built model and
optimizer (the first parameter checked equal), and reports the medians: wall and CPU seconds
(all threads) of each. Prints one JSON object: every process's medians, in order, with the
load average around it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one_tree(tree: Path, sizes: list[float], width: int, saves: int, where: Path) -> dict:
    sys.path.insert(0, str(tree))
    sys.path.insert(1, str(HERE))
    import torch

    from _common import MiB, build_model, one_adamw_step, settle
    from pimm_core.checkpoint.formats.standard import load_standard, save_standard
    from pimm_core.process.dist import DistInfo

    meta = {"trainer": {"global_step": 1, "epoch": 0, "iter": 1}, "scheduler": {}, "scaler": {}, "world_size": 1,
            "workers_per_rank": 0}
    out: dict = {"tree": str(tree), "load_average_start": list(os.getloadavg())}
    for mib in sizes:
        model = build_model(int(mib * MiB), width)
        opt = one_adamw_step(model)
        d = Path(tempfile.mkdtemp(prefix="pimm-trees-", dir=where))
        rec: dict[str, list[float]] = {"save_s": [], "save_cpu_s": [], "load_s": [], "load_cpu_s": []}
        for i in range(saves + 1):
            settle()
            t, c = time.perf_counter(), time.process_time()
            save_standard(d, model=model, optimizer=opt, meta=meta, rank_state={"rng": torch.get_rng_state()},
                          manifest={"kind": "last", "step": 1, "epoch": 0, "iter": 1}, info=DistInfo())
            save = (time.perf_counter() - t, time.process_time() - c)
            fresh = build_model(int(mib * MiB), width, seed=1)
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4, weight_decay=0.01)
            settle()
            t, c = time.perf_counter(), time.process_time()
            load_standard(d / "last", model=fresh, optimizer=fresh_opt, info=DistInfo())
            load = (time.perf_counter() - t, time.process_time() - c)
            assert torch.equal(next(fresh.parameters()), next(model.parameters()))
            del fresh, fresh_opt
            if i:  # (the first round is a warm-up)
                for key, v in zip(rec, (*save, *load)):
                    rec[key].append(v)
        out[f"{mib:g}"] = {**{k: round(statistics.median(v), 4) for k, v in rec.items()},
                           "save_s_all": [round(x, 3) for x in rec["save_s"]],
                           "load_s_all": [round(x, 3) for x in rec["load_s"]]}
        del model, opt
        time.sleep(0.5)  # (the purge thread removes the superseded save)
        shutil.rmtree(d, ignore_errors=True)
    out["load_average_end"] = list(os.getloadavg())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", type=Path, nargs=2, required=True, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--mib", type=float, nargs="+", default=[108.0, 624.0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # (a child process: one tree)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_tree(args.one, args.mib, args.width, args.saves, args.dir)))
        return
    runs = []
    for _ in range(args.pairs):
        for tree in args.trees:
            cmd = [sys.executable, __file__, "--trees", *map(str, args.trees), "--one", str(tree.resolve()),
                   "--mib", *map(str, args.mib), "--width", str(args.width), "--saves", str(args.saves),
                   "--dir", str(args.dir)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"runs": runs}, indent=2))


if __name__ == "__main__":
    main()
