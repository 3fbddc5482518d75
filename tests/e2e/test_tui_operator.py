"""Operator experience of the console (issue 14), on hand-written runs (no training; Textual Pilot).

Non-finite metrics, verify on a live `last`, the 80x24 and 120x40 layouts, the stop dialog's
step, and `pimm tui`'s exit status when the console itself fails.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import REPO, clean_env, describe, hang_s
from tui_support import fake_run, loaded, make_app, rotate, screen_text, train_record, wait_for

from pimm_tui.screens import ConfirmStop
from pimm_tui.views.checkpoints import CheckpointsView
from pimm_tui.widgets import MetricPlot, RunBar

SIZES = [(80, 24), (120, 40)]
NAN, INF = float("nan"), float("inf")


def _diverged(tmp_path: Path) -> Path:
    """Loss falls from 2.3 for 40 steps, is Infinity at step 41 and NaN at 42; val loss NaN."""
    recs = [train_record(s, 2.3 * math.exp(-s / 8)) for s in range(1, 41)]
    recs += [train_record(41, INF), train_record(42, NAN)]
    recs.append({"step": 42, "epoch": 0, "iter": 42, "split": "val", "loss": NAN, "acc": 0.1, "time": 2000.0})
    return fake_run(tmp_path, "diverge", state="failed", records=recs, step=42, epoch=0, total_steps=90,
                    error="TrainingError: loss is not finite")


def _lines(app) -> list[str]:
    return screen_text(app).splitlines()


def _notifications(app) -> list[str]:
    return [n.message for n in app._notifications]


# ------------------------------------------------------------------ non-finite metrics
@pytest.mark.asyncio
@pytest.mark.parametrize("size", SIZES)
async def test_console_opens_a_diverged_run_and_marks_where_loss_stopped_being_finite(tmp_path: Path, size) -> None:
    rd = _diverged(tmp_path)
    assert '"loss": Infinity' in (rd / "metrics.jsonl").read_text()
    app = make_app(rd)
    async with app.run_test(size=size, notifications=True) as pilot:
        await loaded(pilot, polls=3)
        plot = app.query_one("#loss-plot", MetricPlot)
        assert plot.points_shown == 40  # every finite value, none of the others
        assert plot.marker_at == 41 and plot.render_error is None
        assert "last NaN" in plot.title_text and "not finite from step 41" in plot.title_text
        assert plot.log_shown  # loss on a log axis by default
        text = screen_text(app)
        assert "loss not finite from step 41" in text
        assert "train loss NaN" in text and "eval epoch 0 step 42: loss NaN acc 0.1000" in text
        problem = "loss not finite from step 41 (NaN at step 42); val/loss not finite from step 42 (NaN)"
        assert problem in app.snapshot.problems
        assert app.snapshot.best_val["step"] == 42  # acc is finite; the NaN val loss is not "best"
        # `l` switches the loss axis to linear and back.
        await pilot.press("l")
        await pilot.pause(0.05)
        assert not plot.log_shown
        await pilot.press("l")
        await pilot.pause(0.05)
        assert plot.log_shown
        for tab in "2341":
            await pilot.press(tab)
            await pilot.pause(0.05)
        await loaded(pilot)
        assert app.is_running and app.crash is None and app.poll_error is None
        assert plot.render_error is None


@pytest.mark.asyncio
async def test_loss_finite_again_after_a_skipped_step_and_a_run_with_no_finite_loss(tmp_path: Path) -> None:
    recs = [train_record(s, INF if s == 20 else 1.0 / s) for s in range(1, 31)]
    rd = fake_run(tmp_path, "amp", records=recs, step=30, total_steps=30)
    app = make_app(rd)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await loaded(pilot)
        plot = app.query_one("#loss-plot", MetricPlot)
        assert plot.points_shown == 29 and plot.marker_at == 20
        assert "not finite at 20" in plot.title_text and "last 0.0333" in plot.title_text
        assert "loss was not finite at step 20 (1 value); finite again from step 21" in screen_text(app)
    rd = fake_run(tmp_path, "allnan", state="failed", records=[train_record(s, NAN, lr=-INF) for s in (1, 2, 3)])
    app = make_app(rd)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await loaded(pilot, polls=2)
        plot = app.query_one("#loss-plot", MetricPlot)
        assert plot.points_shown == 0 and plot.marker_at == 1 and plot.render_error is None
        await pilot.press("p")  # the LR plot: -Infinity only
        await pilot.pause(0.1)
        lr = app.query_one("#lr-plot", MetricPlot)
        assert lr.points_shown == 0 and "last -inf" in lr.title_text and lr.render_error is None
        assert app.is_running and app.crash is None


def _run_tui(rd: Path, then: str) -> subprocess.CompletedProcess[str]:
    """``pimm tui RD`` (through pimm_core.cli.main) headless at 80x24; ``then`` runs in on_mount."""
    code = f"""
import sys
from textual.app import App
import pimm_tui.app as a
a.PimmConsole.run = lambda self, **kw: App.run(self, headless=True, size=(80, 24))
mount = a.PimmConsole.on_mount
def on_mount(self):
    mount(self)
    {then}
a.PimmConsole.on_mount = on_mount
def boom():
    raise ValueError("cannot convert float NaN to integer")
from pimm_core.cli import main
sys.exit(main(["tui", {str(rd)!r}]))
"""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=hang_s(120))


def test_pimm_tui_opens_a_diverged_run_and_quits_with_0(tmp_path: Path) -> None:
    r = _run_tui(_diverged(tmp_path), "self.set_timer(2.0, self.exit)")
    assert r.returncode == 0, describe(r)
    assert "error" not in r.stderr.lower(), r.stderr


def test_pimm_tui_exits_1_with_one_error_line_when_the_console_fails(tmp_path: Path) -> None:
    r = _run_tui(_diverged(tmp_path), "self.set_timer(0.5, boom)")
    assert r.returncode == 1, describe(r)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: the console stopped on an error: ValueError: cannot convert float NaN to "
                               "integer (traceback in "), lines[0]
    log = Path(lines[0].rsplit("traceback in ", 1)[1].rstrip(")"))
    try:
        assert "Traceback" in log.read_text() and "boom" in log.read_text()
    finally:
        log.unlink()
    assert "Traceback" not in r.stdout + r.stderr


# ------------------------------------------------------------------ verify on a live `last`
def _with_checkpoint(tmp_path: Path, name: str = "r", **status) -> Path:
    rd = fake_run(tmp_path, name, records=[train_record(s, 1.0 / s) for s in range(1, 11)], **status)
    (rd / "model").mkdir()
    rotate(rd / "model", 10, b"a" * 4000)
    return rd


def _cell(app, row: str, column: str) -> str:
    from textual.widgets import DataTable

    value = app.query_one("#ckpt-table", DataTable).get_cell(row, column)
    return getattr(value, "plain", str(value))


@pytest.mark.asyncio
async def test_verify_result_belongs_to_the_checkpoint_it_checked(tmp_path: Path) -> None:
    rd = _with_checkpoint(tmp_path, step=10)
    app = make_app(rd)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await loaded(pilot)
        await pilot.press("2", "v")  # the keys work as soon as the tab is chosen
        view = app.query_one(CheckpointsView)
        await wait_for(pilot, lambda: _cell(app, "last", "status") == "verified ✓", what="verify of last")
        assert "verified: every file matches" in view.detail_text
        # A save replaces `last`: its row shows the new checkpoint, not verified; the result stays with step 10.
        rotate(rd / "model", 20, b"b" * 5000)
        app.poll(force=True)
        await wait_for(pilot, lambda: _cell(app, "last", "step") == "20", what="the new last")
        assert _cell(app, "last", "status") == "complete"
        assert "the earlier last (step 10, replaced since): verified ✓" in view.detail_text
        await pilot.press("v")
        await wait_for(pilot, lambda: _cell(app, "last", "status") == "verified ✓", what="verify of the new last")
        assert [r.step for r in view.results.values() if r.ok] == [10, 20]
        assert _notifications(app) == []  # the result is on screen: no toast over it


@pytest.mark.asyncio
async def test_verify_while_a_save_rotates_last_is_never_a_mismatch(tmp_path: Path, monkeypatch) -> None:
    import pimm_core.checkpoint.select.selection as selection

    rd = _with_checkpoint(tmp_path, step=10)
    real = selection.verify_candidate
    pending = [20]

    def rotating(c):  # the save lands while the console hashes the old `last`
        if pending and c.step == 10:
            rotate(rd / "model", pending.pop(), b"b" * 5000)
        return real(c)

    app = make_app(rd)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await loaded(pilot)
        await pilot.press("2")
        await pilot.pause(0.1)
        assert _cell(app, "last", "step") == "10"
        monkeypatch.setattr(selection, "verify_candidate", rotating)
        await pilot.press("v")
        # The row it was pressed on says the checkpoint was replaced; then the row shows step 20, verified.
        await wait_for(pilot, lambda: _cell(app, "last", "step") == "20", what="the new last")
        await wait_for(pilot, lambda: _cell(app, "last", "status") == "verified ✓", what="the new last verified")
        view = app.query_one(CheckpointsView)
        assert not [r for r in view.results.values() if r.outcome == "failed"]
        old = [r for r in view.results.values() if r.step is None]
        assert old and "replaced by a newer last (step 20)" in old[0].problems[0]


# ------------------------------------------------------------------ layout at 80x24 and 120x40
@pytest.mark.asyncio
@pytest.mark.parametrize("size", SIZES)
async def test_layout_of_a_finished_run(tmp_path: Path, size) -> None:
    recs = [train_record(s, 2.3 * math.exp(-s / 20) + 0.01) for s in range(1, 201)]
    rd = fake_run(tmp_path, "a-long-run-name-20261130-235959", records=recs, step=200, total_steps=200)
    (rd / "model").mkdir()
    rotate(rd / "model", 200, b"a" * 4000)
    app = make_app(rd)
    width = size[0]
    async with app.run_test(size=size, notifications=True) as pilot:
        await loaded(pilot)
        lines = _lines(app)
        assert lines[0].strip() == "digits/a-long-run-name-20261130-235959   FINISHED"  # no pid, no heartbeat age
        assert app.query_one(RunBar).region.height == 1
        assert "Stop: run finished" in lines[-1]  # `s` shown as unavailable, with why
        await pilot.press("s")
        await pilot.pause(0.1)
        assert not isinstance(app.screen, ConfirmStop)
        # Loss on a log axis, x in global steps (whole steps on the axis).
        plot = app.query_one("#loss-plot", MetricPlot)
        assert plot.log_shown and plot.points_shown >= 60 and "vs global step" in plot.title_text
        axis = [line for line in lines if "200" in line and "┫" not in line and "┣" not in line]
        assert axis and all("." not in line for line in axis), axis
        # Checkpoints: the status column is whole; format/epoch only on a wide terminal.
        await pilot.press("2", "v")
        await wait_for(pilot, lambda: _cell(app, "last", "status") == "verified ✓", what="verify")
        await pilot.pause(0.1)
        row = next(line for line in _lines(app) if "last" in line and "KiB" in line)
        assert row.rstrip().endswith("verified ✓") and len(row.rstrip()) <= width
        header = next(line for line in _lines(app) if "name" in line and "status" in line)
        assert ("format" in header) == (width >= 120)
        assert _notifications(app) == []
        # A result arriving while the operator looks elsewhere is a toast.
        view = app.query_one(CheckpointsView)
        await pilot.press("1")
        await pilot.pause(0.05)
        from pimm_core.watch.candidates import VerifyResult

        ident = view._ids["last"]
        view._verified_done(ident, VerifyResult("last", ident, 200, "ok", []))
        await pilot.pause(0.1)
        assert _notifications(app) == ["last (step 200): every file matches its manifest"]


@pytest.mark.asyncio
@pytest.mark.parametrize("size", SIZES)
async def test_header_of_a_live_run_fits_on_one_line(tmp_path: Path, size) -> None:
    recs = [train_record(s, 1.0 / s, time=time.time() - 10 + s) for s in range(1, 11)]
    rd = fake_run(tmp_path, "a-long-run-name-20261130-235959", state="running", records=recs, step=10,
                  total_steps=1000, host="gpu-node-017.cluster.example.org")
    app = make_app(rd)
    async with app.run_test(size=size, notifications=True) as pilot:
        await loaded(pilot)
        bar = app.query_one(RunBar)
        assert bar.region.height == 1
        first = _lines(app)[0]
        assert "RUNNING" in first and "heartbeat" in first
        assert ("pid" in first) == (size[0] >= 120)  # left out first when the line is too short
        # (the footer shows the key once the app has found the run live: an event, not the first frame)
        await wait_for(pilot, lambda: "Stop run" in _lines(app)[-1], what="the stop key in the footer")


# ------------------------------------------------------------------ stop dialog
@pytest.mark.asyncio
async def test_stop_dialog_shows_the_current_step(tmp_path: Path) -> None:
    rd = fake_run(tmp_path, "live", state="running", records=[train_record(1700, 0.1, time=time.time())],
                  step=1700, total_steps=5000)
    app = make_app(rd, refresh_s=0.1)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await loaded(pilot)
        await wait_for(pilot, app.can_stop, what="a live run")
        await pilot.press("s")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmStop), what="the question")
        assert "now at step 1700" in screen_text(app)
        # The run goes on while the question is open: the question follows it.
        status = json.loads((rd / "status.json").read_text())
        status.update(step=1850, heartbeat=time.time())
        (rd / "status.json").write_text(json.dumps(status))
        await wait_for(pilot, lambda: "now at step 1850" in screen_text(app), what="the step to follow the run")
        assert app.snapshot.step == 1850
        await pilot.press("n")
        await wait_for(pilot, lambda: not isinstance(app.screen, ConfirmStop), what="cancel")
        assert "step 1850/5000" in screen_text(app)
        assert not (rd / "control" / "stop").exists()


# ------------------------------------------------------------------ a user objective's metrics
@pytest.mark.asyncio
async def test_live_view_shows_the_metrics_a_language_model_reports(tmp_path: Path) -> None:
    """A run whose objective reports val/perplexity (no accuracy) shows that metric and its best."""
    records = [train_record(s, 3.0 - 0.01 * s) for s in range(1, 21)]
    records += [{"step": 10, "epoch": 0, "iter": 10, "split": "val", "loss": 2.5, "perplexity": 12.1825, "time": 1.0},
                {"step": 20, "epoch": 1, "iter": 10, "split": "val", "loss": 2.25, "perplexity": 9.4877, "time": 2.0}]
    rd = fake_run(tmp_path, records=records)
    (rd / "config.toml").write_text('objective = "language_modeling"\n[eval]\nmetric = "val/perplexity"\nmode = "min"\n')
    app = make_app(rd)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot, polls=2)
        text = screen_text(app)
        assert "eval epoch 1 step 20: loss 2.2500 perplexity 9.4877" in text
        assert "best perplexity 9.4877 (epoch 1)" in text
        assert " acc " not in text
