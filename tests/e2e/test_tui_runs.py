"""`pimm tui ROOT`: the runs table (filter, open and back, stop) and the compare view, through Pilot,
at 80x24 (over SSH) and 120x40, on real runs: two tiny finished ones that differ in train.lr
(trained once per module) and, for the stop, a real `pimm launch` training in the background.

That live run is paced (a callback sleeps 20 ms after each step, as a bigger model's step would
take): it only has to stay live while the console drives it, and at full speed it kept a core
busy for the whole test."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import DIGITS, REPO, clean_env, describe, launch
from tui_support import screen_text, wait_for

from pimm_tui import build_runs_app
from pimm_tui.screens import ConfirmStop
from pimm_tui.views.compare import CompareScreen
from pimm_tui.views.runs import RunsScreen

SIZES = [(80, 24), (120, 40)]
# a callback that makes each optimizer step take at least 20 ms (see the module docstring)
PACED = """
[[callbacks]]
target = "paced_steps:Paced"
"""
PACED_MODULE = """\
import time


class Paced:
    def on_step_end(self, trainer):
        time.sleep(0.02)
"""
TINY = ("train.epochs=1", "train.max_steps=8", "train.log_every_steps=2")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two finished runs, digits/base and digits/lowlr (train.lr=0.0005); do not modify them."""
    root = tmp_path_factory.mktemp("runs-view")
    for name, extra in (("base", ()), ("lowlr", ("train.lr=0.0005",))):
        r = launch(root, name, *TINY, *extra, here=True)
        assert r.returncode == 0, describe(r)
    return root


def _app(root: Path):
    app = build_runs_app(root, refresh_s=0.2)
    app.animation_level = "none"
    return app


def _status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


async def _table(pilot, rows: int) -> RunsScreen:
    """The runs screen once it lists ``rows`` runs."""
    screen = pilot.app.screen
    assert isinstance(screen, RunsScreen), screen
    await wait_for(pilot, lambda: len(screen.rows) >= rows and screen.shown, 60, f"{rows} run(s) listed")
    await pilot.pause(0.1)
    return screen


@pytest.mark.asyncio
@pytest.mark.parametrize("size", SIZES)
async def test_filter_open_and_back(root: Path, size: tuple[int, int]) -> None:
    app = _app(root)
    async with app.run_test(size=size) as pilot:
        runs = await _table(pilot, 2)
        assert [r.name for r in runs.shown] == ["digits/base", "digits/lowlr"]
        assert {r.state for r in runs.shown} == {"finished"}
        await wait_for(pilot, lambda: all(w in screen_text(app) for w in ("digits/base", "digits/lowlr", "finished")),
                       what="both rows drawn")
        # `/` opens the filter; typing filters by name...
        await pilot.press("slash", *"lowlr")
        await wait_for(pilot, lambda: [r.name for r in runs.shown] == ["digits/lowlr"], what="the name filter")
        await wait_for(pilot, lambda: "digits/base" not in screen_text(app), what="the filtered table drawn")
        # ...or by state: no run is stopped, both are finished.
        await pilot.press(*["backspace"] * 5, *"stopped")
        await wait_for(pilot, lambda: runs.shown == [], what="the state filter")
        await pilot.press(*["backspace"] * 7, *"finished lowlr", "enter")  # Enter: back to the table
        await wait_for(pilot, lambda: [r.name for r in runs.shown] == ["digits/lowlr"], what="both words")
        # `s` on a finished run asks nothing and writes nothing.
        await pilot.press("s")
        await pilot.pause(0.2)
        assert not isinstance(app.screen, ConfirmStop)
        assert not (root / "digits" / "lowlr" / "control" / "stop").exists()
        # Enter opens the highlighted run in the one-run views...
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.run_dir == root / "digits" / "lowlr",
                       30, "the run opened")
        await wait_for(pilot, lambda: "FINISHED" in screen_text(app), what="the run bar")
        assert "digits/lowlr" in screen_text(app) and "1 Live" in screen_text(app)
        assert app.snapshot.step == 8
        # ...and Escape returns to the table, the same run highlighted.
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, RunsScreen), what="the runs table")
        assert runs.highlighted() is not None and runs.highlighted().name == "digits/lowlr"
        # Clearing the filter keeps the operator's run highlighted; Enter then opens the other one.
        await pilot.press("slash", *["backspace"] * 14, "enter")
        await wait_for(pilot, lambda: len(runs.shown) == 2, what="the filter cleared")
        assert runs.highlighted().name == "digits/lowlr"
        await pilot.press("up", "enter")
        await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.run_dir == root / "digits" / "base",
                       30, "the other run opened")
        await wait_for(pilot, lambda: "digits/base" in screen_text(app), what="its name on the run bar")


@pytest.mark.asyncio
@pytest.mark.parametrize("size", SIZES)
async def test_compare_two_finished_runs(root: Path, size: tuple[int, int]) -> None:
    app = _app(root)
    async with app.run_test(size=size) as pilot:
        runs = await _table(pilot, 2)
        await pilot.press("c")  # nothing marked: a note, no compare view
        await pilot.pause(0.1)
        assert isinstance(app.screen, RunsScreen)
        await pilot.press("m", "down", "space")
        assert runs.marked == [str(root / "digits" / "base"), str(root / "digits" / "lowlr")]
        await pilot.press("c")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareScreen) and app.screen.runs is not None, 30,
                       "the compare view")
        cmp = app.screen
        # The train loss of both runs, on one plot.
        assert cmp.metric == "loss"
        assert set(cmp.plotted) == {"digits/base", "digits/lowlr"} and min(cmp.plotted.values()) >= 2, cmp.plotted
        await wait_for(pilot, lambda: all(w in screen_text(app) for w in ("loss vs global step", "digits/base",
                                                                          "digits/lowlr", "train.lr")),
                       what="the plot's title, legend and the config difference drawn")
        # The config difference of the second run, against the first marked one.
        assert "train.lr: 0.002 → 0.0005" in cmp.diff_text, cmp.diff_text
        # A log y axis (every loss is positive), then another metric (the evaluation's accuracy),
        # then samples seen on x.
        await pilot.press("l")
        assert cmp.log_shown and set(cmp.plotted) == {"digits/base", "digits/lowlr"}
        await wait_for(pilot, lambda: "loss vs global step" in screen_text(app) and "log" in screen_text(app),
                       what="the log axis drawn")
        while cmp.metric != "val/acc":
            await pilot.press("n")
        assert set(cmp.plotted) == {"digits/base", "digits/lowlr"}
        await pilot.press("x")
        assert cmp.x_samples
        await wait_for(pilot, lambda: "val/acc vs samples seen" in screen_text(app), what="the x axis switched")
        assert set(cmp.plotted) == {"digits/base", "digits/lowlr"}
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, RunsScreen), what="the runs table")
        assert len(runs.marked) == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("size", SIZES)
async def test_stop_a_live_run_from_the_table(tmp_path: Path, size: tuple[int, int]) -> None:
    run_dir = tmp_path / "digits" / "live"
    (tmp_path / "paced_steps.py").write_text(PACED_MODULE)  # beside the config: found through its directory
    config = tmp_path / "paced.toml"
    config.write_text(DIGITS.read_text() + PACED)
    cmd = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(config), "--run.root", str(tmp_path),
           "--run.name", "live", "--run.no-timestamp", "--", "train.epochs=200", "train.log_every_steps=5",
           "checkpoint.every_epochs=0"]
    with open(tmp_path / "live.out", "wb") as out:  # a file: a pipe nobody reads would block the run
        proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while _status(run_dir).get("state") != "running":
            assert proc.poll() is None, (tmp_path / "live.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.1)
        app = _app(tmp_path)
        async with app.run_test(size=size) as pilot:
            runs = await _table(pilot, 1)
            await wait_for(pilot, lambda: runs.shown[0].state == "live", 60, "the run live in the table")
            # `s`, then `n`: nothing is written.
            await pilot.press("s")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmStop), what="the confirmation")
            await wait_for(pilot, lambda: "Stop digits/live" in screen_text(app), what="the question drawn")
            await pilot.press("n")
            await wait_for(pilot, lambda: isinstance(app.screen, RunsScreen), what="the cancel")
            assert not (run_dir / "control" / "stop").exists() and proc.poll() is None
            # `s`, then `y`: the run saves last and stops; the table says so.
            await pilot.press("s")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmStop), what="the confirmation")
            await pilot.press("y")
            await wait_for(pilot, lambda: _status(run_dir).get("state") == "stopped", 120, "status.json stopped")
            await wait_for(pilot, lambda: runs.shown[0].state == "stopped", 30, "the table's row stopped")
            await wait_for(pilot, lambda: "stopped" in screen_text(app), what="the stopped row drawn")
        assert proc.wait(timeout=60) == 0, (tmp_path / "live.out").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _status(run_dir)["stop_reason"] == "operator"


@pytest.mark.asyncio
async def test_names_and_config_values_are_shown_as_text(tmp_path: Path) -> None:
    """A run name or config value holding markup or terminal escapes is shown escaped, never obeyed."""
    from tui_support import fake_run, train_record

    hostile = "x[red]\x1b]0;pwned\x07"
    fake_run(tmp_path, "plain", records=[train_record(s, 1.0 / s) for s in range(1, 5)])
    odd = fake_run(tmp_path, hostile, records=[train_record(s, 2.0 / s) for s in range(1, 5)])
    (odd / "config.toml").write_text('[eval]\nmetric = "val/acc"\nmode = "max"\n[model]\nname = "[bold]\\u001b[2J"\n')
    app = _app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        runs = await _table(pilot, 2)
        await wait_for(pilot, lambda: "x[red]\\x1b]0;pwned\\x07" in screen_text(app), what="the escaped name")
        assert "\x1b" not in screen_text(app)
        await pilot.press("m", "down", "m", "c")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareScreen) and app.screen.runs is not None, 30,
                       "the compare view")
        assert len(runs.marked) == 2
        await wait_for(pilot, lambda: "model.name: (unset) → '[bold]\\x1b[2J'" in screen_text(app),
                       what="the escaped config value")
        assert "\x1b" not in screen_text(app)


@pytest.mark.asyncio
async def test_escape_in_a_field_leaves_the_field_first(tmp_path: Path) -> None:
    """In a run opened from the table, Escape while typing in a field leaves the field (as in
    `pimm tui RUN`); the next Escape goes back to the table."""
    from textual.widgets import Input

    from tui_support import fake_run, train_record

    fake_run(tmp_path, "one", records=[train_record(s, 1.0 / s) for s in range(1, 5)])
    app = _app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await _table(pilot, 1)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.snapshot is not None, 30, "the run opened")
        await pilot.press("4")
        app.query_one("#exp-dest", Input).focus()
        await pilot.pause(0.1)
        await pilot.press("escape")
        await pilot.pause(0.1)
        assert not isinstance(app.focused, Input) and not isinstance(app.screen, RunsScreen)
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, RunsScreen), what="the runs table")


@pytest.mark.asyncio
async def test_a_diverged_run_says_where_it_stopped_being_finite(tmp_path: Path) -> None:
    """A run whose loss became NaN then inf: the table's LOSS reads inf (not '-', nothing logged),
    and the compare view's legend says from which step its loss line is not finite; a metric
    it logged only as NaN is still offered (n), marked, not called 'not logged'."""
    from tui_support import fake_run, train_record

    fake_run(tmp_path, "ok", records=[train_record(s, 1.0 / s) for s in range(1, 9)])
    fake_run(tmp_path, "diverged", records=[*(train_record(s, 1.0 / s) for s in range(1, 5)),
                                            train_record(5, float("nan")), train_record(6, float("inf")),
                                            {"step": 6, "split": "val", "acc": float("nan"), "time": 1006.0}])
    app = _app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        runs = await _table(pilot, 2)
        assert runs.rows[str(tmp_path / "digits" / "diverged")].loss_text() == "inf"
        await wait_for(pilot, lambda: " inf " in screen_text(app), what="inf in the LOSS column")
        await pilot.press("m", "down", "m", "c")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareScreen) and app.screen.runs is not None, 30,
                       "the compare view")
        cmp = app.screen
        assert cmp.metric == "loss"
        await wait_for(pilot, lambda: "digits/diverged (not finite from step 5 (inf at step 6))" in screen_text(app),
                       what="the non-finite note in the legend")
        assert cmp.plotted == {"digits/diverged": 4, "digits/ok": 8}  # the finite values are plotted
        while cmp.metric != "val/acc":
            await pilot.press("n")
            await pilot.pause(0.05)
        await wait_for(pilot, lambda: "digits/diverged (not finite from step 6 (NaN))" in screen_text(app),
                       what="the NaN-only metric's note")
        assert "digits/ok (not logged)" in screen_text(app)
