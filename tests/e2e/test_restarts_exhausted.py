"""A launch whose last attempt fails (``pimm launch --max-restarts K``, no restart left) ends with
``status.json`` saying ``failed`` and naming the cause, whichever rank died and however (issue 35's
loose ends): the launcher writes it, since rank 0, the status writer, cannot when it was killed (the
record stayed ``running``, shown as ``stale``) and only says its own consequence (a lost connection)
when another rank died first.

Three real 2-rank torchrun launches, run side by side: rank 0 ``kill -9``ed by this test in each of the
two attempts of a ``--max-restarts 1`` launch (the first marks the run ``restarting``, the second ends
it); rank 1 killed by a fail point (``--max-restarts 0``); rank 1 exiting with code 1 (an I/O error
raised by a fail point, ``--max-restarts 0``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import DIGITS, REPO, clean_env, hang_s, wait_while_running

OVERRIDES = ("train.epochs=1", "model.hidden=16", "train.log_every_steps=5", "checkpoint.memory_every_steps=3",
             "checkpoint.every_epochs=1", "data.num_workers=0")


def _start(root: Path, name: str, restarts: int, env: dict[str, str]) -> subprocess.Popen:
    args = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(DIGITS), "--run.root", str(root),
            "--run.name", name, "--run.no-timestamp", "--nproc-per-node", "2", "--max-restarts", str(restarts),
            "--", *OVERRIDES]
    return subprocess.Popen(args, cwd=REPO, env={**clean_env(), "PIMM_SHM_ROOT": str(root / "shm"), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _status(run: Path) -> dict:
    try:
        return json.loads((run / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _kill_rank0_twice(root: Path, proc: subprocess.Popen, gate: Path) -> dict:
    """Rank 0 pauses at its 4th step in each attempt (a fail point); this test kills it there by the pid
    status.json names: once with a restart left (``restarting``), once with none."""
    run = root / "digits" / "rank0"
    seen: dict = {"pids": []}
    for attempt in range(2):
        wait_while_running(lambda: (gate / "memory.step.reached.4").exists(), f"rank 0 paused (attempt {attempt})", proc)
        (gate / "memory.step.reached.4").unlink()
        pid = _status(run)["pid"]
        assert pid not in seen["pids"], "status.json still names the killed rank 0"
        seen["pids"].append(pid)
        os.kill(pid, signal.SIGKILL)
        if attempt == 0:
            wait_while_running(lambda: _status(run).get("state") == "restarting", "restarting after the first kill", proc)
    return seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("exhausted")
    (root / "shm").mkdir()
    gate = root / "gate"
    gate.mkdir()
    rank0 = _start(root, "rank0", 1, {"PIMM_FAILPOINT": "memory.step@4=pause", "PIMM_FAILPOINT_RANK": "0",
                                      "PIMM_FAILPOINT_DIR": str(gate)})
    rank1 = _start(root, "rank1", 0, {"PIMM_FAILPOINT": "memory.step@4=kill", "PIMM_FAILPOINT_RANK": "1"})
    exit1 = _start(root, "exit1", 0, {"PIMM_FAILPOINT": "memory.step@4=eio", "PIMM_FAILPOINT_RANK": "1"})
    out = {"root": root, "rank0_pids": _kill_rank0_twice(root, rank0, gate)["pids"]}
    for name, proc in (("rank0", rank0), ("rank1", rank1), ("exit1", exit1)):
        text, _ = proc.communicate(timeout=hang_s(300))
        out[name] = (proc.returncode, text)
    return out


@pytest.mark.parametrize("name, cause", [("rank0", "rank 0 was killed by SIGKILL"),
                                         ("rank1", "rank 1 was killed by SIGKILL"),
                                         ("exit1", "rank 1 failed with exit code 1")])
def test_a_launch_whose_last_attempt_fails_says_failed_with_the_cause(runs, name, cause):
    from pimm_core.watch.runs import summarize

    code, out = runs[name]
    assert code == 1, out[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("error: rank"))
    assert line.startswith(f"error: {cause}"), out[-3000:]
    run = runs["root"] / "digits" / name
    status = _status(run)
    assert status["state"] == "failed", status  # not `running` (rank 0 killed), nor rank 0's lost connection
    assert status["error"] == line.removeprefix("error: ")
    assert status["step"] >= 4 and "agent_pid" not in status
    assert summarize(run, runs["root"]).state == "failed"  # `pimm runs ls` (and the console): not `stale`


def test_rank_0_killed_on_the_last_attempt_keeps_what_the_restart_recorded(runs):
    status = _status(runs["root"] / "digits" / "rank0")
    assert status["recovery"]["restart"] == 1 and status["recovery"]["tier"] == "memory"
    assert status["pids"][0] == runs["rank0_pids"][1]  # the second rank 0, the one killed last
