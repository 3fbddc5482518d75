"""The console's Live view shows every rank's heartbeat (``ranks/<rank>.json``) and marks the rank
the others wait for: it has made no progress for longer than its peers while they wait in a
collective (Textual Pilot, 80x24, on a copy of a real run made live again)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from tui_support import copy_run, loaded, make_app, screen_text, tui_run, wait_for

from pimm_core.run.ranks import RankBeat, rank_file

SIZE = (80, 24)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tui_run(tmp_path_factory)


def _beat(run_dir: Path, rank: int, phase: str, detail: str | None, idle_s: float, step: int = 40) -> None:
    now = time.time()
    beat = RankBeat(rank=rank, world_size=2, pid=os.getpid(), host=os.uname().nodename, step=step, phase=phase,
                    detail=detail, since=now - idle_s, progress=now - idle_s, updated=now)
    rank_file(run_dir, rank).parent.mkdir(exist_ok=True)
    rank_file(run_dir, rank).write_text(json.dumps(beat.to_json()))


@pytest.mark.asyncio
async def test_live_view_marks_the_rank_the_others_wait_for(run: Path, tmp_path: Path) -> None:
    rd = copy_run(run, tmp_path)
    status = json.loads((rd / "status.json").read_text())
    # live: this process stands in for rank 0; its last status.json heartbeat is 20 s old (a hang silences it)
    status.update(state="running", pid=os.getpid(), pids=[os.getpid(), os.getpid()], world_size=2, step=40,
                  heartbeat=time.time() - 20)
    (rd / "status.json").write_text(json.dumps(status))
    _beat(rd, 0, "collective", "stop agreement", idle_s=40)
    _beat(rd, 1, "callback", "on_step_end of Flaky", idle_s=41)
    app = make_app(rd, refresh_s=0.1)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await wait_for(pilot, lambda: app.snapshot.lagging == (1,), what="rank 1 marked")
        await pilot.pause(0.1)
        text = " ".join(screen_text(app).split())  # (lines wrap at 80 columns)
        assert re.search(r"ranks 0 collective \(stop agreement\) step 40 \d+ s · 1 STUCK callback "
                         r"\(on_step_end of Flaky\) step 40 \d+ s", text), text
        assert re.search(r"rank 1 made no progress for \d+ s \(phase callback \(on_step_end of Flaky\), step 40\)",
                         text), text
        assert "0 STUCK" not in text

        # rank 1 moves on: nobody is marked
        _beat(rd, 1, "data", None, idle_s=0, step=41)
        await wait_for(pilot, lambda: app.snapshot.lagging == (), what="the mark cleared")
        await pilot.pause(0.1)
        assert "STUCK" not in screen_text(app)

        # both busy in a long step (no one waits in a collective): a slow step is not a hang
        _beat(rd, 0, "forward/backward", None, idle_s=40, step=41)
        _beat(rd, 1, "forward/backward", None, idle_s=41, step=41)
        await pilot.pause(1.5)  # (the ranks are read once a second)
        await loaded(pilot)
        assert app.snapshot.lagging == () and "STUCK" not in screen_text(app)
