"""The console's stop key on a live run: a real `pimm launch` subprocess stops cleanly on `s`, `y`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import DIGITS, REPO, clean_env, hang_s
from tui_support import loaded, make_app, screen_text, wait_for

from pimm_core.checkpoint.select.selection import select_resume
from pimm_core.process.shell import resume_command
from pimm_tui.screens import ConfirmStop


def _status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.asyncio
async def test_stop_key_stops_a_live_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "digits" / "live"
    cmd = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(DIGITS), "--run.root", str(tmp_path),
           "--run.name", "live", "--run.no-timestamp", "--", "train.epochs=200", "train.log_every_steps=5",
           "checkpoint.every_epochs=0"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + hang_s(120)
        while _status(run_dir).get("state") != "running":
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.1)
        app = make_app(run_dir)
        async with app.run_test(size=(80, 24)) as pilot:
            await loaded(pilot)
            await wait_for(pilot, lambda: app.can_stop(), what="a live run")
            assert app.check_action("stop", ()) is True
            assert "RUNNING" in screen_text(app)
            # `s` asks first; `n` cancels and writes nothing.
            await pilot.press("s")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmStop), what="the confirmation")
            assert "Stop digits/live" in screen_text(app)
            # the same command `pimm launch` prints when the run stops
            text = str(app.screen.query_one("#confirm-text").render())
            assert text.endswith(f"resume later with: {resume_command(run_dir)}"), text
            await pilot.press("n")
            await wait_for(pilot, lambda: not isinstance(app.screen, ConfirmStop), what="the cancel")
            assert not (run_dir / "control" / "stop").exists()
            assert proc.poll() is None
            # `s`, `y`: the stop request goes out through pimm_core.process.stop.
            await pilot.press("s")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmStop), what="the confirmation")
            await pilot.press("y")
            await wait_for(pilot, lambda: app.snapshot.status.display_state == "stopped", timeout=90,
                           what="state stopped")
            assert "STOPPED" in screen_text(app) and "(operator)" in screen_text(app)
            assert app.check_action("stop", ()) is None  # no longer live: disabled
        out, _ = proc.communicate(timeout=hang_s(60))
        assert proc.returncode == 0, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    seen = app.states_seen
    assert seen.index("running") < seen.index("stopping") < seen.index("stopped"), seen
    status = _status(run_dir)
    assert status["state"] == "stopped" and status["stop_reason"] == "operator"
    chosen, _ = select_resume(run_dir / "model")
    assert chosen is not None and chosen.name == "last" and chosen.complete
    assert chosen.step == status["step"]
    assert "stopped (operator)" in out
    assert resume_command(run_dir) in out
