"""A scheduler's stop signal and time limit on a real 2-rank ``pimm launch --nproc-per-node 2``.

One chain of sessions on one run directory (the helpers of test_stop_runs.py):

1. ``train.stop_signals`` names SIGUSR1 (what ``sbatch --signal=B:USR1@60`` sends): a real
   ``kill -USR1`` to the launcher is a clean stop on both ranks (torchrun's agent forwards
   it), ``last`` saved, exit 0.
2. A resume whose environment says the job ends in one second (``SLURM_JOB_END_TIME``,
   read at the start): it cannot take a step without overrunning the limit plus the margin,
   so it stops cleanly after its first step (the check runs after each step), naming the
   time limit, ``last`` saved; its provenance entry names the job.
3. A resume to the end: bitwise equal to an uninterrupted run of the same config.

Nothing depends on machine speed: the signal is sent once status.json shows training,
and the end time is in the past or within the reserve whatever the start-up takes.
"""

from __future__ import annotations

import signal
import time

import pytest

from _helpers import read_json
from test_stop_runs import (TWO_RANKS, Session, SharedReference, _require_resumable, check_end, check_stopped,
                            finish_stage, resume_to_end, signal_stage)

# (the job's environment is faked, there is no Slurm to requeue it: train.requeue unset would try)
SCHED = (*TWO_RANKS, 'train.stop_signals=["SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1"]', "train.requeue=false")
NAME = "sched"


@pytest.fixture(scope="module", autouse=True)
def _reference_run(tmp_path_factory):
    """The uninterrupted 2-rank run of TWO_RANKS, started first so that it overlaps the chain (shared with
    test_stop_runs and test_slurm: SCHED's stop settings do not change what trains)."""
    ref = SharedReference(tmp_path_factory)
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("sched-chain")
    a = signal_stage(root, NAME, SCHED, nproc=2, resume=False, label="sigusr1-launcher", target="launcher",
                     sig=signal.SIGUSR1, start_step=0)
    _require_resumable(a)
    env = {"SLURM_JOB_END_TIME": str(int(time.time()) + 1), "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"}
    sess = Session(root, NAME, SCHED, nproc=2, resume=True, tag="slurm-end", env=env)
    b = finish_stage(sess, "slurm-end", {"step": a.status["step"]})
    _require_resumable(b)
    end = resume_to_end(root, NAME, b, label="end", stale_reason="stale from before")
    return {"usr1": a, "limit": b, "end": end}


def test_sigusr1_to_the_launcher_is_a_clean_stop_on_both_ranks(chain):
    check_stopped(chain["usr1"], "signal:SIGUSR1", 2)


def test_the_job_end_time_stops_cleanly_before_the_limit(chain):
    st, before = chain["limit"], chain["usr1"]
    reason = st.status["stop_reason"]
    assert reason is not None and reason.startswith("time limit: SLURM_JOB_END_TIME"), st.why()
    check_stopped(st, reason, 2)
    assert st.status["step"] == before.status["step"] + 1  # the first step already leaves too little time
    start = st.provenance["starts"][-2]
    assert start["kind"] == "resume" and start["scheduler"] == {
        "name": "slurm", "job_id": "4242", "restart_count": 1, "end_time": start["scheduler"]["end_time"]}, start
    assert "scheduler" not in st.provenance["starts"][0]  # the first start was outside Slurm


def test_the_chain_ends_bitwise_equal_to_an_uninterrupted_run(chain, _reference_run):
    ref = _reference_run.result()
    check_end(chain["end"], ref, 2)
    assert read_json(ref / "status.json")["state"] == "finished"
