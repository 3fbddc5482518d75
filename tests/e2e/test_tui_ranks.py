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


@pytest.mark.asyncio
async def test_live_view_marks_a_straggler_and_names_a_hung_ranks_frame(run: Path, tmp_path: Path) -> None:
    """Heartbeat files written by real Heartbeats: rank 1's steps take 3x rank 0's before they can
    communicate (SLOW); then rank 1 hangs in a callback and a stack written at the hang names its frame."""
    from pimm_core.run.heartbeat import Heartbeat
    from pimm_core.run.stacks import write_main_stack

    rd = copy_run(run, tmp_path)
    status = json.loads((rd / "status.json").read_text())
    status.update(state="running", pid=os.getpid(), pids=[os.getpid(), os.getpid()], world_size=2, step=40,
                  heartbeat=time.time())
    (rd / "status.json").write_text(json.dumps(status))
    clock = [time.time() - 30]
    beats = [Heartbeat(rd, r, 2) for r in range(2)]
    for hb, work in zip(beats, (0.02, 0.06)):
        hb.clock = lambda: clock[0]
        hb.arm()
        for step in range(21, 41):
            hb.enter("data")
            clock[0] += work
            hb.enter("forward/backward")
            hb.forward_done()
            hb.enter("collective", "stop agreement")
            hb.at_step(step)
        hb.enter("data")
        hb._write()
    app = make_app(rd, refresh_s=0.1)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await wait_for(pilot, lambda: app.snapshot.stragglers == (1,), what="rank 1 marked slow")
        await pilot.pause(0.1)
        text = " ".join(screen_text(app).split())
        assert re.search(r"ranks 0 data step 40 \d+ s · 1 SLOW data step 40", text), text
        assert "0 SLOW" not in text

        # rank 1 hangs in a callback, rank 0 waits; a hang's stack request is answered (here: this thread's)
        _beat(rd, 0, "collective", "stop agreement", idle_s=40)
        _beat(rd, 1, "callback", "on_step_end of Flaky", idle_s=41)
        frame = write_main_stack(rd, 1)
        await wait_for(pilot, lambda: app.snapshot.frame_of(1) == frame, what="rank 1's frame")
        await pilot.pause(0.1)
        assert "1 STUCK callback" in " ".join(screen_text(app).split())
        shown = screen_text(app).replace("\n", "").replace(" ", "")  # (a long path wraps)
        assert f"in{frame}".replace(" ", "") in shown, shown
        assert f"waitingin{frame}".replace(" ", "") in shown, shown  # the run bar's line says it too
