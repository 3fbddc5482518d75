"""The console's Live view shows the age and step of the newest checkpoint in each tier (memory from
``memory/<rank>.json``, disk ``last``, the remote store) and the latest recovery from ``status.json``
(Textual Pilot, 100x30, on a run written by hand: the ranks' memory indexes as the contract gives them)."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tui_support import fake_run, loaded, make_app, screen_text, train_record, wait_for, write_generation

SIZE = (110, 30)


def _iso(seconds_ago: float) -> str:
    return datetime.fromtimestamp(time.time() - seconds_ago, timezone.utc).isoformat(timespec="seconds")


def _index(rd: Path, rank: int, own: tuple[int, float] | None, buddy: tuple[int, int, float] | None) -> None:
    """``memory/<rank>.json``: its own snapshot ``(step, seconds ago)`` and the copy of rank
    ``buddy[0]``'s state at ``(step, seconds ago)`` it holds."""
    now = time.time()
    rec = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "shm": f"/dev/shm/pimm-x/{rank}",
           "own": None if own is None else {"step": own[0], "epoch": 1, "time": now - own[1], "bytes": 1000,
                                             "sha256": "ab" * 32},
           "buddy": None if buddy is None else {"rank": buddy[0], "step": buddy[1], "time": now - buddy[2],
                                                 "bytes": 1000, "sha256": "cd" * 32}}
    (rd / "memory").mkdir(exist_ok=True)
    (rd / "memory" / f"{rank}.json").write_text(json.dumps(rec))


def _flat(app) -> str:
    return " ".join(screen_text(app).split())


@pytest.mark.asyncio
async def test_live_view_shows_each_tiers_newest_checkpoint_and_the_recovery(tmp_path: Path) -> None:
    store = tmp_path / "store"
    rd = fake_run(tmp_path, state="running", records=[train_record(s, 1.0 / s) for s in range(1, 125)],
                  step=124, total_steps=500, world_size=2, pids=[os.getpid(), os.getpid()],
                  recovery={"tier": "memory", "step": 120, "restart": 1})
    (rd / "config.toml").write_text(f'[eval]\nmetric = "val/acc"\nmode = "max"\n[checkpoint]\n'
                                    f'memory_every_steps = 10\nremote = "file://{store}"\n')
    (rd / "model").mkdir()
    write_generation(rd / "model" / "last", 100, b"w" * 64, created=_iso(62))
    remote = store / "digits" / "r" / "model" / "step_80"
    remote.mkdir(parents=True)
    (remote / "manifest.json").write_text(json.dumps({"step": 80, "created": _iso(3 * 3600 + 600)}))
    (remote / ".complete").write_bytes(b"")
    _index(rd, 0, own=(120, 4), buddy=(1, 120, 3))
    _index(rd, 1, own=(120, 4), buddy=(0, 120, 3))

    app = make_app(rd, refresh_s=0.1)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        text = await wait_for(pilot, lambda: "checkpoints:" in _flat(app) and _flat(app), what="the tiers line")
        m = re.search(r"checkpoints: memory (\d+) s \(step 120\) · disk (\d+) min (\d+) s \(step 100\) · "
                      r"remote 3 h (\d+) min \(step 80\)", text)
        assert m, text
        memory_age, disk_age = int(m[1]), 60 * int(m[2]) + int(m[3])  # (the console may take seconds to open)
        assert 56 <= disk_age - memory_age <= 60 and int(m[4]) in (10, 11), text
        assert "recovered from memory at step 120 (restart 1)" in text, text

        # rank 1's node lost its shared memory (its own snapshot and the copy it held): rank 1 still
        # reaches step 120 through the copy rank 0 holds
        _index(rd, 1, own=None, buddy=None)
        await pilot.pause(1.2)  # (the memory indexes are read once a second)
        await loaded(pilot)
        assert re.search(r"memory \d+ s \(step 120\)", _flat(app)), _flat(app)

        # both copies of rank 1's state are gone: no step in memory every rank reaches
        _index(rd, 0, own=(120, 4), buddy=None)
        await pilot.pause(1.2)
        await wait_for(pilot, lambda: "memory — (no step every rank reaches)" in _flat(app), what="memory gone")


@pytest.mark.asyncio
async def test_live_view_tiers_off_and_a_stores_error_is_never_markup(tmp_path: Path) -> None:
    rd = fake_run(tmp_path, state="running", records=[train_record(1, 1.0)], step=1)
    app = make_app(rd, refresh_s=0.1)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        text = await wait_for(pilot, lambda: "checkpoints:" in _flat(app) and _flat(app), what="the tiers line")
        assert "checkpoints: memory off · disk — · remote off" in text, text
        assert "recovered" not in text

    # a store that cannot be listed: its error is shown as written
    (rd / "config.toml").write_text('[eval]\nmetric = "val/acc"\nmode = "max"\n[checkpoint]\n'
                                    'remote = "nosuchscheme[bold]x://b/[red]y"\n')
    app = make_app(rd, refresh_s=0.1)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        text = await wait_for(pilot, lambda: "cannot list the store" in _flat(app) and _flat(app), what="the error")
        assert "remote — (cannot list the store:" in text and "[bold]" in text, text
