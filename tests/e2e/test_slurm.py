"""``pimm launch`` under a real Slurm (a one-node cluster on localhost, tests/e2e/_slurm.py).

The batch script is the README's: ``sbatch --signal=B:USR1@N --time=T`` running
``exec pimm launch --nproc-per-node 2 ... --train.auto-resume``, with pimm's defaults (no
``train.stop_signals``, no ``train.requeue``). Slurm's own SIGUSR1, N seconds before the time
limit, interrupts it once while it trains: the two ranks stop cleanly, ``last`` is saved, and
pimm asks Slurm to requeue the job, which starts again under the same job id and resumes (the
test lets it start at once: Slurm holds a requeued job back for a while, its BeginTime). The
run ends finished, bitwise equal to an uninterrupted run, and ``provenance.json`` names the job
and its restart count at each start.

One job: the explicit settings (``train.stop_signals`` with SIGUSR1, ``train.requeue = true``)
and ``scancel --signal=USR1 --batch`` deliver the same signal to the same code as the defaults
and Slurm's own timer, so a second job (two more 2-rank starts) checked nothing more.
"""

from __future__ import annotations

import re
import shlex
import sys
import time
from pathlib import Path

import pytest

from _helpers import DIGITS, REPO, clean_env, hang_s, read_json
from _slurm import start_cluster
from test_stop_runs import TWO_RANKS, SharedReference, assert_same_weights

pytestmark = pytest.mark.slurm

TIMEOUT = hang_s(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("slurm"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-rank run, outside Slurm, started at once so that it overlaps the job (shared
    with test_stop_runs and test_scheduler_stop)."""
    ref = SharedReference(tmp_path_factory)
    yield ref
    ref.close()


def pimm_command() -> list[str]:
    script = Path(sys.executable).parent / "pimm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "pimm_core.cli"]


def job_state(cluster, job: str) -> dict[str, str]:
    out = cluster.run("scontrol", "show", "job", "-o", job, check=False).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for(what: str, ready, cluster, out: Path, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}\n--- job output\n{out.read_text(errors='replace')[-4000:] if out.exists() else ''}"
                f"\n{cluster.logs()}")


# A user callback that makes the first start's steps slow (3 s each, 46 steps: longer than the job's
# --time) so that Slurm's own SIGUSR1, sent about N s before the time limit, lands while it trains;
# after the requeue (SLURM_RESTART_COUNT 1) the steps run at full speed. Weights are unchanged.
_SLOW_FIRST_START = """\
import os
import time


class SlowFirstStart:
    def on_step_end(self, trainer):
        if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" and not trainer.stop.requested:
            time.sleep(3.0)
"""


def test_slurms_own_usr1_before_the_time_limit_stops_and_requeues_by_default(cluster, reference, tmp_path):
    """No train.stop_signals, no train.requeue: `sbatch --signal=B:USR1@60 --time=3` and a job script that
    execs `pimm launch ... --train.auto-resume`. Slurm itself sends SIGUSR1 (about a minute before the
    limit): the run stops cleanly, the job requeues, and the run ends bitwise equal to an uninterrupted one."""
    (tmp_path / "slow_first_start.py").write_text(_SLOW_FIRST_START)
    config = tmp_path / "digits.toml"
    config.write_text(DIGITS.read_text() + '\n[[callbacks]]\ntarget = "slow_first_start:SlowFirstStart"\n')
    root, name = tmp_path / "runs", "job"
    run_dir = root / "digits" / name
    out = tmp_path / "job.out"
    launch = [*pimm_command(), "launch", "--nproc-per-node", "2", "--train.config", str(config), "--run.root",
              str(root), "--run.name", name, "--run.no-timestamp", "--train.auto-resume", "--", *TWO_RANKS]
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\ncd {shlex.quote(str(REPO))}\nexec {shlex.join(launch)}\n")
    submitted = cluster.run("sbatch", "--parsable", "--signal=B:USR1@60", "--time=3", "-c", "2",
                            "-o", str(out), "--open-mode=append", str(script), base_env=clean_env())
    job = submitted.stdout.strip().split(";")[0]
    requeued = wait_for("the job to be requeued",
                        lambda: (j := job_state(cluster, job)).get("Restarts") == "1" and j.get("JobState") != "COMPLETING"
                        and j, cluster, out)
    if requeued.get("JobState") == "PENDING":  # Slurm holds a requeued job back (BeginTime): let it start now
        cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
    final = wait_for("the job to complete after its requeue",
                     lambda: (j := job_state(cluster, job)).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED",
                                                                                 "TIMEOUT") and j,
                     cluster, out)
    text = out.read_text(errors="replace")
    assert final["JobState"] == "COMPLETED" and final["ExitCode"] == "0:0", f"{final}\n{text[-4000:]}"
    assert final["Restarts"] == "1", final
    assert read_json(run_dir / "status.json")["state"] == "finished", text[-4000:]
    assert_same_weights(reference.result(), run_dir)
    starts = read_json(run_dir / "provenance.json")["starts"]
    assert [e["kind"] for e in starts] == ["start", "stop", "resume"], starts
    assert starts[1]["reason"] == "signal:SIGUSR1" and starts[1]["step"] > 0, starts[1]
    assert [(e["scheduler"]["job_id"], e["scheduler"]["restart_count"]) for e in (starts[0], starts[2])] == \
        [(job, 0), (job, 1)], starts
    assert f"requeued Slurm job {job}" in text, text[-4000:]
