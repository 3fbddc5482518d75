"""``train.requeue``: after a clean stop by a signal or the time limit inside a Slurm job,
ask Slurm to requeue the job (``scontrol requeue $SLURM_JOB_ID``); the job starts again
under the same id and, launched with ``--train.auto-resume``, continues exactly.

Done once per job by its outermost pimm process on the job's first node (``SLURM_NODEID``
0): the ``pimm launch --nproc-per-node`` launcher once its ranks are gone, or rank 0 of
ranks started by ``srun``/an external torchrun.
A pause asked with ``pimm stop`` (or ``Trainer.stop.request``) is not requeued.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ..config import Config
from ..process.stop import caught_signals
from ..run import read_run_status

#: Stop reasons that requeue (``signal:<NAME>``, ``time limit: ...``).
REQUEUE_REASONS = ("signal:", "time limit")


def requeue_if_asked(cfg: Config, run_dir: Path) -> int:
    """Requeue this Slurm job when ``train.requeue`` is set and the run stopped (not finished) for a
    signal or its time limit; returns the exit code to end with (0, or 1 when ``scontrol`` failed)."""
    if not cfg.train.requeue:
        return 0
    status = read_run_status(run_dir)
    if status.state != "stopped" or not (status.stop_reason or "").startswith(REQUEUE_REASONS):
        return 0
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        print("train.requeue: not inside a Slurm job ($SLURM_JOB_ID unset); nothing requeued", flush=True)
        return 0
    if os.environ.get("SLURM_NODEID", "0") != "0":
        return 0  # the job's first node asks, once for the whole job
    # Slurm ends this job's processes (SIGTERM, then SIGKILL) as it requeues it: this process has
    # nothing left to do but exit, so the stop signals are ignored from here on.
    for sig in caught_signals():
        signal.signal(sig, signal.SIG_IGN)
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"error: train.requeue: scontrol requeue {job} failed: {e}; requeue the job yourself "
              f"(scontrol requeue {job}) or resubmit it", file=sys.stderr)
        return 1
    if done.returncode != 0:
        print(f"error: train.requeue: scontrol requeue {job} failed: {(done.stderr or done.stdout).strip()}; "
              f"requeue the job yourself or resubmit it", file=sys.stderr)
        return 1
    print(f"requeued Slurm job {job}: it starts again and resumes with --train.auto-resume", flush=True)
    return 0
