"""``train.requeue``: after a clean stop by a signal or the time limit inside a Slurm job,
ask Slurm to requeue the job (``scontrol requeue $SLURM_JOB_ID``); the job starts again
under the same id and, launched with ``--train.auto-resume``, continues exactly.

Done once per job by its outermost pimm process on the job's first node (``SLURM_NODEID``
0): the ``pimm launch --nproc-per-node`` launcher once its ranks are gone, or rank 0 of
ranks started by ``srun``/an external torchrun.
A pause asked with ``pimm stop`` (or ``Trainer.stop.request``) is not requeued.

``train.requeue`` unset (the default) requeues inside a Slurm job after SIGUSR1 (a stop signal
there by default: :func:`pimm_core.process.stop.default_signals`) or the time limit, when the job's
command resumes the run as it starts again (``--train.auto-resume``, ``pimm resume``); a
``scancel`` (SIGTERM) is never requeued by default. ``false``: never; ``true``: after any stop
signal or the time limit.
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
#: ...with ``train.requeue`` unset: the signal Slurm sends before the time limit, and the time limit
#: (a SIGTERM is ``scancel``'s: a cancelled job stays cancelled).
AUTO_REASONS = ("signal:SIGUSR1", "time limit")

_restart_resumes = False


def restart_resumes() -> None:
    """This process's command resumes the run when the job starts again (``--train.auto-resume``,
    ``pimm resume``): ``train.requeue`` unset may requeue it."""
    global _restart_resumes
    _restart_resumes = True


def requeue_if_asked(cfg: Config, run_dir: Path) -> int:
    """Requeue this Slurm job when the run stopped (not finished) for a signal or its time limit and
    ``train.requeue`` is true, or unset (``None``) inside a Slurm job whose command resumes, for
    SIGUSR1 (``sbatch --signal=B:USR1@N``) or the time limit; returns the exit code to end with (0, or
    1 when ``scontrol`` failed)."""
    asked = cfg.train.requeue
    if asked is False:
        return 0
    status = read_run_status(run_dir)
    reasons = REQUEUE_REASONS if asked else AUTO_REASONS
    if status.state != "stopped" or not (status.stop_reason or "").startswith(reasons):
        return 0
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        if asked:
            print("train.requeue: not inside a Slurm job ($SLURM_JOB_ID unset); nothing requeued", flush=True)
        return 0
    if asked is None and not _restart_resumes:
        if os.environ.get("SLURM_NODEID", "0") == "0":
            print(f"Slurm job {job} not requeued: its command would not resume this run when it starts again; launch "
                  "with --train.auto-resume (or pimm resume) to have it requeued, or set train.requeue = false",
                  flush=True)
        return 0
    if os.environ.get("SLURM_NODEID", "0") != "0":
        return 0  # the job's first node asks, once for the whole job
    # Slurm ends this job's processes (SIGTERM, then SIGKILL) as it requeues it: this process has
    # nothing left to do but exit, so the stop signals are ignored from here on.
    for sig in caught_signals():
        signal.signal(sig, signal.SIG_IGN)
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=120)
        why = None if done.returncode == 0 else (done.stderr or done.stdout).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    if why is not None:
        # asked for (train.requeue = true): the job fails; by default: the clean stop stands, with a warning
        kind, code = ("error: train.requeue", 1) if asked else ("warning: the default requeue (train.requeue unset)", 0)
        print(f"{kind}: scontrol requeue {job} failed: {why}; requeue the job yourself (scontrol requeue {job}) "
              "or resubmit it", file=sys.stderr)
        return code
    print(f"requeued Slurm job {job}: it starts again and resumes with --train.auto-resume", flush=True)
    return 0
