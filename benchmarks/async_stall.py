"""Stall per checkpoint: how long the training thread is blocked by a save, async vs sync.

Same state as ``save_throughput.py`` (Linear stack + AdamW after one step, >= ``--gib`` GiB).

- ``sync``: ``save_standard`` (what ``save_checkpoint`` does without ``checkpoint.async``):
  the training thread is blocked for the whole write, fsync, sha256 manifest and rotation.
- ``async``: ``AsyncStandardFormat.save(..., background=True)`` (what ``Trainer.save_checkpoint(background=True)``
  calls with ``checkpoint.async = true``): the stall is the time until ``save`` returns
  (optimizer state dict, packing, copies of the buffers, thread start) plus the time the
  next training step then waits, before its optimizer step, for the staging copies that
  run on a background thread during its forward/backward (``wait_staged``). The
  previous save is always finished before the timed call (``wait()`` outside the timer),
  so no in-flight wait is counted; ``background_s`` is the time from ``save`` returning to
  the checkpoint being published (``wait()`` returning), measured separately.
- ``step_slowdown``: a synthetic training step (forward/backward through the stack on a
  small batch plus the AdamW update) timed while a background save runs, vs without one,
  to show what the background write costs the training thread on this 2-core machine.

Repeats alternate sync / async; one warm-up pair is discarded.

Prints one JSON object with ``stall_fraction = median(async stall) / median(sync save)``
(target <= 0.10). Usage::

    uv run python benchmarks/async_stall.py [--gib 1.0] [--repeats 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import GiB, build_state, load_average, machine, median, r, remove, settle, state_bytes  # noqa: E402
from pimm_core.checkpoint.formats.async_save import AsyncStandardFormat  # noqa: E402
from pimm_core.checkpoint.formats.protocol import SaveItem  # noqa: E402
from pimm_core.checkpoint.formats.standard import StandardFormat, save_standard  # noqa: E402
from pimm_core.process.dist import DistInfo  # noqa: E402

META = {"trainer": {"global_step": 1}}
MANIFEST = {"kind": "last", "step": 1, "epoch": 0, "iter": 0}


def train_step(model, opt, x, before_step=None) -> float:
    """One forward/backward/AdamW step; returns the seconds spent in ``before_step`` (the
    trainer's wait for a background save's staging copies, as in ``WindowStep.finish``)."""
    loss = F.mse_loss(model(x), x)
    loss.backward()
    waited = 0.0
    if before_step is not None:
        t0 = time.perf_counter()
        before_step()
        waited = time.perf_counter() - t0
    opt.step()
    opt.zero_grad(set_to_none=True)
    return waited


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()

    warnings.filterwarnings("ignore")
    logging.getLogger("pimm").setLevel(logging.WARNING)
    load_start = load_average()
    model, opt = build_state(int(args.gib * GiB), args.width)
    sizes = state_bytes(model, opt)
    x = torch.randn(8, args.width)
    work = Path(tempfile.mkdtemp(prefix="pimm-async-bench-", dir=args.dir))
    sync_dir, async_dir = work / "sync", work / "async"
    sync_dir.mkdir()
    async_dir.mkdir()
    info = DistInfo()
    saver = AsyncStandardFormat(StandardFormat(info))
    sync_s: list[float] = []
    stall_s: list[float] = []
    staging_wait_s: list[float] = []
    background_s: list[float] = []
    step_idle: list[float] = []
    step_during: list[float] = []
    try:
        for repeat in range(args.repeats + 1):
            settle()
            t0 = time.perf_counter()
            save_standard(sync_dir, model=model, optimizer=opt, meta=META, rank_state={"rng": torch.get_rng_state()},
                          manifest=MANIFEST, info=info)
            t_sync = time.perf_counter() - t0

            settle()
            t0 = time.perf_counter()
            train_step(model, opt, x)
            t_idle = time.perf_counter() - t0

            saver.wait()
            settle()
            t0 = time.perf_counter()
            saver.save(async_dir, SaveItem(model=model, optimizer=opt, meta=META, rank_state={"rng": torch.get_rng_state()},
                                           manifest=MANIFEST, step=1), background=True)
            t1 = time.perf_counter()
            # the training thread goes on while the copy and the write run; it waits for
            # the copy only before the optimizer step changes what is being copied
            waited = train_step(model, opt, x, before_step=saver.wait_staged)
            t2 = time.perf_counter()
            saver.wait()
            t3 = time.perf_counter()
            assert (async_dir / "last" / ".complete").exists()
            if repeat:
                sync_s.append(t_sync)
                stall_s.append(t1 - t0 + waited)
                staging_wait_s.append(waited)
                background_s.append(t3 - t1)
                step_idle.append(t_idle)
                step_during.append(t2 - t1)
    finally:
        try:
            saver.wait()
        finally:
            remove(work)

    sync_med, stall_med = median(sync_s), median(stall_s)
    print(json.dumps({
        "state_bytes": sizes,
        "state_gib": r(sizes["total"] / GiB, 3),
        "sync_save_s_median": r(sync_med),
        "async_stall_s_median": r(stall_med),
        "stall_fraction": r(stall_med / sync_med),
        "target_stall_fraction": 0.10,
        "async_background_s_median": r(median(background_s)),
        "train_step_s_median": {"no_save": r(median(step_idle)), "during_background_save": r(median(step_during))},
        "step_slowdown_during_background_save": r(median(step_during) / median(step_idle)),
        "async_staging_wait_before_next_step_s_median": r(median(staging_wait_s)),
        "seconds_all": {"sync": [r(x) for x in sync_s], "async_stall": [r(x) for x in stall_s],
                        "async_background": [r(x) for x in background_s]},
        "repeats": args.repeats,
        "machine": machine(work.parent, load_start),
    }, indent=2))


if __name__ == "__main__":
    main()
