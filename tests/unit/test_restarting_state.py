"""``restarting`` as the launcher and the console see it (issue 35): torchrun's agent, in the launcher's
process, reports its monitoring through torch's elastic metrics API; a failed worker group with restarts
left marks the run ``restarting`` even when rank 0 (the status writer) is the rank that died, and
``failed`` once the launch ends. In process: torch's own ``put_metric``, no agent (the e2e memory-tier
launches cover a real kill)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pimm_core.run.status import mark_failed, read_run_status, write_status
from pimm_core.watch.runs import summarize
from pimm_core.watch.status import read_status


def test_a_failed_group_with_restarts_left_marks_the_run_restarting_then_failed(tmp_path):
    from torch.distributed.elastic.metrics import put_metric

    from pimm_core.launch.restarts import watch_restarts

    write_status(tmp_path, "running", step=7, pids=[11, 12], memory_step=6)
    with watch_restarts(tmp_path):
        put_metric("workers.default.remaining_restarts", 1)
        put_metric("workers.default.healthy", 1)
        assert read_run_status(tmp_path).state == "running"
        put_metric("workers.default.failed", 1)
    rec = read_run_status(tmp_path)
    assert rec.state == "restarting" and rec.extra["agent_pid"] == os.getpid()
    assert rec.step == 7 and rec.memory_step == 6 and "restarts the ranks" in rec.error
    view = read_status(tmp_path)
    assert view.live and not view.stoppable and view.note is None  # the agent (this process) is alive
    put_metric("workers.default.failed", 1)  # (outside: the handler is gone)
    mark_failed(tmp_path, "rank 1 was killed by SIGKILL")
    rec = read_run_status(tmp_path)
    assert rec.state == "failed" and "agent_pid" not in rec.extra and rec.step == 7
    assert rec.error == "rank 1 was killed by SIGKILL"  # the launch's cause, not the previous attempt's


def test_a_failed_group_with_no_restart_left_is_not_marked(tmp_path):
    from torch.distributed.elastic.metrics import put_metric

    from pimm_core.launch.restarts import watch_restarts

    write_status(tmp_path, "running", step=3)
    with watch_restarts(tmp_path):
        put_metric("workers.default.remaining_restarts", 0)
        put_metric("workers.default.failed", 1)
    assert read_run_status(tmp_path).state == "running"


def test_restarting_whose_launcher_is_gone_is_stale(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "g" / "r"
    run.mkdir(parents=True)
    (run / "config.toml").write_text("")
    write_status(run, "restarting", step=5, agent_pid=dead.pid, error="RuntimeError: peer lost")
    view = read_status(run)
    assert not view.live and view.pid_alive is False and "launcher" in view.note
    assert summarize(run, tmp_path).state == "stale"
    write_status(run, "restarting", step=5, agent_pid=os.getpid())
    assert summarize(run, tmp_path).state == "restarting"
    assert json.loads((run / "status.json").read_text())["agent_pid"] == os.getpid()



def test_the_launch_s_failure_names_the_cause_unless_rank_0_s_own_error_is_it(tmp_path):
    """What the launcher writes when the last attempt failed (the e2e launches: tests/e2e/test_restarts_exhausted.py)."""
    why = "rank 1 was killed by SIGKILL; the run stopped"
    write_status(tmp_path, "failed", step=4, error="RuntimeError: Connection reset by peer")
    mark_failed(tmp_path, why, keep_error=True)  # rank 0's own failure is the cause: its exception stays
    assert read_run_status(tmp_path).error == "RuntimeError: Connection reset by peer"
    mark_failed(tmp_path, why)  # rank 0 only lost its connection to the rank that died
    rec = read_run_status(tmp_path)
    assert rec.state == "failed" and rec.error == why and rec.step == 4
    for state in ("stopped", "finished"):  # an end the ranks reached is kept
        write_status(tmp_path, state, step=9)
        mark_failed(tmp_path, why)
        rec = read_run_status(tmp_path)
        assert rec.state == state and rec.error is None
