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

