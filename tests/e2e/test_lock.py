"""One writer per run directory: a second launch refuses at once, a killed holder's lock is taken over.

The run lock is an OS ``flock`` on ``<run>/.lock`` (``pimm_core.process.lock``): a second
``pimm launch`` on the same run exits 2 with one line naming the holder's pid and host;
after the holder is SIGKILLed the kernel releases the lock, and a resume takes it and
trains. ``pimm checkpoints ls`` keeps answering while the run writes checkpoints.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from _helpers import DIGITS, REPO, clean_env, describe, hang_s, pimm, pimm_here, read_json

# long enough to still be running while the test looks at it; a save at every epoch end
LONG = ("train.epochs=200", "checkpoint.every_epochs=1", "train.log_every_steps=1000")


def _args(root: Path, *extra: str, overrides: tuple[str, ...] = LONG) -> list[str]:
    return ["launch", "--train.config", str(DIGITS), "--run.root", str(root), "--run.name", "locked",
            "--run.no-timestamp", *extra, "--", *overrides]


def _argv(root: Path, *extra: str, overrides: tuple[str, ...] = LONG) -> list[str]:
    return [sys.executable, "-m", "pimm_core.cli", *_args(root, *extra, overrides=overrides)]


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + hang_s(timeout)
    while not cond():
        assert proc.poll() is None, f"the run ended early: exit {proc.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_second_launch_refused_killed_holder_taken_over(tmp_path):
    run = tmp_path / "digits" / "locked"
    out = open(tmp_path / "first.out", "w")
    first = subprocess.Popen(_argv(tmp_path), cwd=REPO, env=clean_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: (run / "model" / "last" / ".complete").exists(), first)

        # `pimm checkpoints ls` while the run keeps saving (a save every epoch): always answers
        for _ in range(5):
            ls = pimm("checkpoints", "ls", run, "--json", timeout=60)
            assert ls.returncode == 0, describe(ls)
            assert json.loads(ls.stdout)["selected"] in ("last", "last.prev"), ls.stdout
        assert first.poll() is None

        # a second launch on the same run (in this process: the holder is another process either way):
        # refused at once, naming the holder
        start = time.monotonic()
        second = pimm_here(*_args(tmp_path, "--train.resume"))
        took = time.monotonic() - start
        assert second.returncode == 2, describe(second)
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in second.stderr, describe(second)
        assert f"pid {first.pid}" in errors[0] and socket.gethostname() in errors[0], errors[0]
        assert took < 60, f"the refusal took {took:.1f} s"
        assert first.poll() is None  # the holder is unaffected

        # kill -9 the holder: its flock goes with it; lock.json (the holder's record) stays behind
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=hang_s(30))
    finally:
        if first.poll() is None:
            first.kill()
        out.close()
    assert read_json(run / "lock.json")["pid"] == first.pid

    step = read_json(run / "model" / "last" / "manifest.json")["step"]
    # the resume takes the dead holder's lock (in this process: any process can)
    resumed = pimm_here(*_args(tmp_path, "--train.resume", overrides=(*LONG, f"train.max_steps={step + 5}")))
    assert resumed.returncode == 0, describe(resumed)
    entry = read_json(run / "provenance.json")["starts"][-1]
    assert entry["kind"] == "resume" and entry["checkpoint_step"] == step, entry
    assert read_json(run / "status.json")["state"] == "finished"
    assert not (run / "lock.json").exists()  # released at the end
    assert read_json(run / "model" / "last" / "manifest.json")["step"] == step + 5


def test_launch_refused_while_held_by_this_process(tmp_path):
    """The refusal names whoever holds the flock (here: this test process, on this host)."""
    from pimm_core.process.lock import RunLock

    run = tmp_path / "digits" / "locked"
    with RunLock(run):
        result = pimm("launch", "--train.config", DIGITS, "--run.root", tmp_path, "--run.name", "locked",
                      "--run.no-timestamp", "--", "train.epochs=1", timeout=120)
    assert result.returncode == 2, describe(result)
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error:") and f"pid {os.getpid()}" in line and socket.gethostname() in line, line
    assert not (run / "model").exists() and not (run / "train.log").exists()
