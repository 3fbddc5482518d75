"""What a person sees in a terminal: log lines scroll above one live Rich progress bar
(checked in a real tmux terminal at 100 columns, as a person would look at it)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from _helpers import DIGITS, REPO, hang_s

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (a real terminal)")


def test_log_lines_scroll_above_one_progress_bar(tmp_path):
    session = f"pimm-{uuid.uuid4().hex[:8]}"
    # one intra-op thread, as _helpers.clean_env gives the other launches
    cmd = "OMP_NUM_THREADS=1 " + shlex.join([sys.executable, "-m", "pimm_core.cli", "launch", "--train.config",
                                             str(DIGITS), "--run.root", str(tmp_path), "--run.name", "t",
                                             "--run.no-timestamp", "--", "train.epochs=400", "train.log_every_steps=5"])
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "100", "-y", "30", "-c", str(REPO)], check=True)
    try:
        subprocess.run(["tmux", "send-keys", "-t", session, f"cd {shlex.quote(str(REPO))} && {cmd}", "Enter"],
                       check=True)
        deadline, lines = time.monotonic() + hang_s(120), []
        while time.monotonic() < deadline:
            time.sleep(0.25)
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True).stdout
            lines = [ln for ln in screen.splitlines() if ln.strip()]
            if sum("eval:" in ln for ln in lines) >= 4 and any(ln.startswith("train ") for ln in lines):
                break
        bars = [ln for ln in lines if "━" in ln]
        assert len(bars) == 1 and bars[0].startswith("train "), "\n".join(lines)
        assert lines[-1] == bars[0]  # the bar stays at the bottom; log lines scroll above it
        logged = [ln for ln in lines if "eval:" in ln or " saved " in ln]
        assert len(logged) >= 4 and all(re.match(r"^\d\d:\d\d:\d\d (epoch \d+ eval:|saved )", ln) for ln in logged), \
            "\n".join(lines)
    finally:
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c", ""], check=False)
        _wait_stopped(tmp_path / "digits" / "t" / "status.json", timeout=hang_s(10))
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)


def _wait_stopped(status: Path, timeout: float) -> None:
    """Until the run's status.json says it is no longer live (its stop after Ctrl-C), at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads(status.read_text()).get("state") not in ("starting", "running", "stopping"):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
