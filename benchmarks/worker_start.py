"""DataLoader worker start-up: what each ``data.multiprocessing_context`` costs.

pimm's train loader starts its workers at every epoch (``persistent_workers=False``, so a
dataset's ``set_epoch`` reaches them). This measures, for 2 workers over the bundled digits
train split (1,437 samples, batches of 32) and ``--epochs`` epochs, in a fresh process per
variant (the fork server is per process):

- ``first_batch_s``: from creating the loader to the first batch of the first epoch (for
  ``forkserver`` this includes starting the server);
- ``epoch_s``: the median time of a whole later epoch (start workers, read every batch);
- ``ratio``: each variant's ``epoch_s`` over ``fork``'s (the old behaviour), same run.

Variants: ``fork`` (the old default: exposed to the fork-while-threads hang, see
``pimm_core.data.workers``), ``forkserver`` (pimm's default: the server preloads
``pimm_core.data``), ``forkserver_no_preload`` (each worker imports torch itself), ``spawn``,
and for reference ``fork_persistent`` (workers started once; it would not see ``set_epoch``)
and ``in_process`` (``num_workers = 0``).

Prints one JSON object. Usage::

    uv run python benchmarks/worker_start.py [--epochs 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = ["fork", "forkserver", "forkserver_no_preload", "spawn", "fork_persistent", "in_process"]


def measure(variant: str, epochs: int) -> dict:
    import functools
    import os

    import torch

    from pimm_core.data import loaders as data
    from pimm_core.data import workers as loader_workers
    from pimm_core.config import DataConfig
    from pimm_core.process.dist import DistInfo

    if variant == "forkserver_no_preload":
        loader_workers.PRELOAD = []
    method = {"forkserver_no_preload": "forkserver", "fork_persistent": "fork", "in_process": "fork"}.get(variant, variant)
    workers = 0 if variant == "in_process" else 2
    ds = data.digits().train
    t0 = time.perf_counter()
    extra = {} if not workers else {"multiprocessing_context": loader_workers.worker_context(method),
                                    "persistent_workers": variant == "fork_persistent"}
    loader = data.TrainLoader(ds, batch_size=32, sampler=torch.utils.data.DistributedSampler(ds, 1, 0, seed=0),
                              num_workers=workers, worker_init_fn=functools.partial(data.init_worker, os.getpid())
                              if workers else None, **extra)
    loader.sampler.set_epoch(0)
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    for _ in it:
        pass
    times = []
    for epoch in range(1, epochs):
        loader.sampler.set_epoch(epoch)
        t = time.perf_counter()
        n = sum(1 for _ in loader)
        times.append(time.perf_counter() - t)
        assert n == len(loader)
    return {"first_batch_s": round(first, 4), "epoch_s": round(statistics.median(times), 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.epochs)))
        return
    from _common import load_average, machine

    out: dict = {"benchmark": "worker_start", "workers": 2, "epochs": args.epochs, "machine": machine(),
                 "load_before": load_average()}
    for v in VARIANTS:
        res = subprocess.run([sys.executable, __file__, "--variant", v, "--epochs", str(args.epochs)],
                             capture_output=True, text=True, check=True, cwd=REPO)
        out[v] = json.loads(res.stdout.strip().splitlines()[-1])
    for v in VARIANTS:
        out[v]["ratio"] = round(out[v]["epoch_s"] / out["fork"]["epoch_s"], 2)
    out["load_after"] = load_average()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
