"""``pimm runs ls``: every run under a root, its state and what a resume would load (torch-free).

The root holds real runs in each state: finished and failed ones trained here, a live one
training in the background (then stopped with ``pimm stop``: stopped), and one whose
launcher was killed with SIGKILL (its ``status.json`` still says running: stale).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import DIGITS, REPO, clean_env, describe, hang_s, pimm, pimm_here, read_json


def _ls_json(root: Path, *args: str) -> dict:
    r = pimm("runs", "ls", root, "--json", *args, timeout=60)
    assert r.returncode in (0, 1), describe(r)
    return json.loads(r.stdout)


def _background(root: Path, name: str) -> subprocess.Popen:
    args = ["launch", "--train.config", str(DIGITS), "--run.root", str(root), "--run.name", name, "--run.no-timestamp",
            "--", "train.epochs=500", "train.log_every_steps=1"]
    # output to a file: a pipe nobody reads fills up and blocks the run's progress lines
    log = open(root / f"{name}.out", "wb")
    return subprocess.Popen([sys.executable, "-m", "pimm_core.cli", *args], cwd=REPO, env=clean_env(),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(predicate, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + hang_s(timeout)
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _state(root: Path, name: str) -> str | None:
    rows = {r["name"]: r for r in _ls_json(root)["runs"]}
    return rows.get(f"digits/{name}", {}).get("state")


def _training(run: Path) -> bool:
    try:
        s = read_json(run / "status.json")
    except (OSError, ValueError):
        return False
    return s.get("state") == "running" and (s.get("step") or 0) >= 1


@pytest.fixture(scope="module")
def root(tmp_path_factory, trained_run):
    root = tmp_path_factory.mktemp("runs")
    live, killed = _background(root, "live"), _background(root, "killed")
    try:
        trained_run.copy_to(root)  # finished: digits/t
        # in this process (the fail point raises): its first save, after step 1, fails
        failed = pimm_here("launch", "--train.config", DIGITS, "--run.root", root, "--run.name", "failed",
                           "--run.no-timestamp", "--", "train.max_steps=1", failpoint="standard.weights_written=enospc")
        assert failed.returncode == 1, describe(failed)
        for p in (live, killed):
            _wait_for(lambda: _training(root / "digits" / ("live" if p is live else "killed")), "a training step")
            # paused (still alive, its lock held) once it trained a step: a live run need not burn a core
            # while the tests read it (a 500-epoch run otherwise trains until `pimm stop`)
            os.killpg(p.pid, signal.SIGSTOP)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        yield root, live
    finally:
        for p in (live, killed):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_runs_ls_names_every_state_and_what_a_resume_loads(root):
    root, live = root
    rows = {r["name"]: r for r in _ls_json(root)["runs"]}
    assert sorted(rows) == ["digits/failed", "digits/killed", "digits/live", "digits/t"]
    assert rows["digits/t"]["state"] == "finished"
    assert rows["digits/t"]["resume"] == "last" and rows["digits/t"]["resume_step"] == rows["digits/t"]["step"]
    assert rows["digits/t"]["best"]["metric"] == "val/acc" and 0.5 < rows["digits/t"]["best"]["value"] <= 1
    assert rows["digits/failed"]["state"] == "failed" and rows["digits/failed"]["resume"] is None
    assert rows["digits/live"]["state"] == "live" and rows["digits/live"]["step"] >= 1
    assert rows["digits/live"]["loss"] is not None and rows["digits/live"]["world_size"] == 1
    assert rows["digits/killed"]["state"] == "stale" and "gone" in rows["digits/killed"]["note"]

    assert [r["name"] for r in _ls_json(root, "--state", "stale")["runs"]] == ["digits/killed"]
    text = pimm("runs", "ls", root, timeout=60)
    assert text.returncode == 0, describe(text)
    header, *lines = text.stdout.splitlines()
    assert header.split()[:3] == ["RUN", "STATE", "STEP"]
    assert any(line.split()[:2] == ["digits/killed", "stale"] for line in lines), text.stdout

    stop = pimm("stop", root / "digits" / "live", timeout=60)
    assert stop.returncode == 0, describe(stop)
    os.killpg(live.pid, signal.SIGCONT)  # (paused by the fixture) it reads the request at its next step
    live.wait(timeout=hang_s(240))
    assert _state(root, "live") == "stopped"
    row = {r["name"]: r for r in _ls_json(root / "digits")["runs"]}["live"]  # a group as the root
    assert row["resume"] == "last" and row["resume_step"] == row["step"]


def test_runs_ls_refusals_are_one_line(tmp_path):
    # in this process (pimm_here): the console script's wiring is the other tests' (a process each)
    r = pimm_here("runs", "ls", tmp_path / "nowhere")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, describe(r)
    r = pimm_here("runs", "ls", tmp_path)
    assert r.returncode == 1 and r.stderr == f"error: no run directories under {tmp_path}\n", describe(r)
    r = pimm_here("runs", "ls", tmp_path, "--sort", "size")
    assert r.returncode == 2 and "--sort 'size' is not one of" in r.stderr, describe(r)


def test_runs_ls_does_not_import_torch(trained_run):
    code = ("import sys; from pimm_core.cli import main; "
            f"main(['runs', 'ls', {str(trained_run.root)!r}, '--json']); print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                       timeout=hang_s(60))
    assert r.stdout.strip().splitlines()[-1] == "False", describe(r)
