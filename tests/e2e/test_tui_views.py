"""The operator console's views on a run produced by the real trainer (Textual Pilot, 80x24)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import describe, pimm_here
from tui_support import copy_run, loaded, make_app, screen_text, tui_run, wait_for

from pimm_core.watch.resume_diff import resume_diff
from pimm_tui.app import PimmConsole
from pimm_tui.screens import ConfirmStop
from pimm_tui.views.checkpoints import CheckpointsView
from pimm_tui.views.export import ExportView
from pimm_tui.views.topology import TopologyView
from pimm_tui.widgets import MetricPlot

SIZE = (80, 24)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tui_run(tmp_path_factory)


def _cell(app: PimmConsole, row_key: str, column: str) -> str:
    from textual.widgets import DataTable

    table = app.query_one("#ckpt-table", DataTable)
    value = table.get_cell(row_key, column)
    return getattr(value, "plain", str(value))


@pytest.mark.asyncio
async def test_live_view_finished_run(run: Path) -> None:
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        text = screen_text(app)
        assert "FINISHED" in text
        assert "step 90/90" in text and "epochs 2/2 done" in text
        assert "best acc 0.8969" in text and "eval epoch 1 step 90: loss 0.5584 acc 0.8969" in text
        assert "loss (train) vs global step" in text
        assert "saved" in text  # a train.log line
        # 18 training records (every 5 steps) + step 1, all plotted.
        assert app.query_one("#loss-plot", MetricPlot).points_shown == 19
        snap = app.snapshot
        assert snap is not None and snap.best_val is not None and snap.best_val["step"] == 90
        # Not live: the stop key is shown disabled and does nothing.
        assert app.check_action("stop", ()) is None
        await pilot.press("s")
        await pilot.pause(0.1)
        assert not isinstance(app.screen, ConfirmStop)
        assert not (run / "control" / "stop").exists()
        # Narrow terminal: `p` switches the plot between loss and LR.
        assert not app.query_one("#lr-plot").display
        await pilot.press("p")
        await pilot.pause(0.05)
        assert app.query_one("#lr-plot").display and not app.query_one("#loss-plot").display


@pytest.mark.asyncio
async def test_live_plot_grows_with_metrics(run: Path, tmp_path: Path) -> None:
    rd = copy_run(run, tmp_path)
    metrics = rd / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    half = len(lines) // 2
    metrics.write_bytes(b"".join(lines[:half]) + lines[half][:10])  # and a half-written line
    app = make_app(rd, refresh_s=0.1)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        first = app.query_one("#loss-plot", MetricPlot).points_shown
        first_step = app.snapshot.last_train["step"]
        with open(metrics, "ab") as f:
            f.write(lines[half][10:])
            f.writelines(lines[half + 1:])
        await wait_for(pilot, lambda: app.snapshot.last_train["step"] == 90, what="the appended records")
        await pilot.pause(0.1)
        assert app.query_one("#loss-plot", MetricPlot).points_shown > first
        assert first_step < 90
        assert app.snapshot.metrics_records == len(lines)
        assert not any("damaged" in p for p in app.snapshot.problems)


@pytest.mark.asyncio
async def test_checkpoints_view_lists_marks_and_verifies(run: Path, tmp_path: Path) -> None:
    rd = copy_run(run, tmp_path)
    weights = rd / "model" / "iter_80.pth"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF  # same size, different sha256
    weights.write_bytes(bytes(data))
    app = make_app(rd)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("2")
        await pilot.pause(0.1)
        view = app.query_one(CheckpointsView)
        names = [c.name for c in app.snapshot.candidates]
        assert names == ["last", "model_best.pth", "iter_40.pth", "iter_60.pth", "iter_80.pth"]
        assert _cell(app, "last", "mark") == "▶"
        assert _cell(app, "iter_40.pth", "mark") == ""
        assert _cell(app, "last", "step") == "90" and _cell(app, "last", "status") == "complete"
        text = screen_text(app)
        assert "resume would load: last" in text and "val/acc" in text
        # The cursor starts on resume's choice; verify it.
        assert view.highlighted().name == "last"
        await pilot.press("v")
        await wait_for(pilot, lambda: _cell(app, "last", "status").startswith("verified"), what="verify of last")
        assert _cell(app, "last", "status") == "verified ✓"
        # The damaged snapshot fails verification with the reason.
        await pilot.press("down", "down", "down", "down")
        await wait_for(pilot, lambda: view.highlighted().name == "iter_80.pth", what="cursor on iter_80.pth")
        await pilot.press("v")
        await wait_for(pilot, lambda: _cell(app, "iter_80.pth", "status").startswith("FAILED"), what="verify fails")
        assert _cell(app, "iter_80.pth", "status") == "FAILED: sha256"
        assert "verify FAILED: iter_80.pth: sha256 mismatch" in view.detail_text
        assert "sha256 mismatch" in screen_text(app)
        # `e` opens the Export view prefilled with the highlighted checkpoint.
        await pilot.press("e")
        await pilot.pause(0.1)
        from textual.widgets import Select

        assert app.query_one("#tabs").active == "export"
        assert app.query_one("#exp-cand", Select).value == "iter_80.pth"


@pytest.mark.asyncio
async def test_topology_view_follows_inputs(run: Path, tmp_path: Path) -> None:
    rd = copy_run(run, tmp_path)
    # Make `last` a mid-epoch checkpoint (step 60 = epoch 1, iteration 15) to show a replay boundary.
    manifest_path = rd / "model" / "last" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest.update(step=60, epoch=1, iter=15, has_loader_state=True)
    manifest_path.write_text(json.dumps(manifest))
    app = make_app(rd)
    async with app.run_test(size=(SIZE[0], SIZE[1] + 1)) as pilot:  # (one more diff row: train samples)
        await loaded(pilot)
        await pilot.press("3")
        view = app.query_one(TopologyView)
        await wait_for(pilot, lambda: "policy: same world size" in view.result_text, what="the default plan")
        assert view.result_text == "\n".join(resume_diff(rd).lines())
        assert "exact continuation" in screen_text(app)
        # Only a launch computes the planned data fingerprint (it loads the data): say so.
        assert "computed at launch" in screen_text(app) and "checked at launch" not in screen_text(app)
        # World size 2: reshard, discard cursor and RNG, replay from the epoch start.
        app.query_one("#plan-ws").focus()
        await pilot.press("backspace", "2")
        await wait_for(pilot, lambda: "world size changes" in view.result_text, what="world size 2 plan")
        assert "replay boundary: epoch 1 restarts at step 45" in view.result_text
        assert view.result_text == "\n".join(resume_diff(rd, world_size=2).lines())
        text = screen_text(app)
        assert "changed" in text and "discard:" in text
        # Same world size, other workers.
        await pilot.press("backspace", "1")
        app.query_one("#plan-workers").focus()
        await pilot.press("backspace", "3")
        await wait_for(pilot, lambda: "per-rank worker count changes" in view.result_text, what="workers plan")
        assert "data.num_workers: 0 -> 3" in view.result_text
        # Same world size and workers, another strategy: named; cursor and RNG kept.
        await pilot.press("backspace", "0")
        app.query_one("#plan-overrides").value = "train.strategy=fsdp"
        await wait_for(pilot, lambda: "strategy changes at the same world size" in view.result_text,
                       what="strategy plan")
        assert view.result_text == "\n".join(resume_diff(rd, world_size=1, workers=0,
                                                         overrides=["train.strategy=fsdp"]).lines())
        assert "strategy changed ddp -> fsdp" in view.result_text and "discard: nothing" in view.result_text
        assert "fsdp" in screen_text(app)
        app.query_one("#plan-overrides").value = ""
        # A bad override is a readable error, not a crash.
        app.query_one("#plan-overrides").focus()
        await pilot.press(*"data.nope=1")
        await wait_for(pilot, lambda: "unknown key data.nope" in view.result_text, what="override error")
        # From Checkpoints, `t` shows a weights-only snapshot (it cannot resume).
        await pilot.press("escape", "2")
        await pilot.pause(0.05)
        await pilot.press("down")
        await pilot.press("t")
        await pilot.press("ctrl+a")
        app.query_one("#plan-overrides").value = ""
        await wait_for(pilot, lambda: "weights only" in view.result_text, what="weights-only candidate")
        assert app.query_one("#tabs").active == "topology"


def _metadata(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return f.metadata()


def _tensors(path: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(path))


@pytest.mark.asyncio
async def test_export_from_console_matches_pimm_export(run: Path, tmp_path: Path) -> None:
    from textual.widgets import Input, Select

    ours, theirs = tmp_path / "console", tmp_path / "cli"
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("4")
        view = app.query_one(ExportView)
        assert app.query_one("#exp-cand", Select).value == "last"  # resume's choice by default
        assert app.query_one("#exp-dest", Input).value == str(run / "export" / "last-raw")
        app.query_one("#exp-dest", Input).value = str(ours)
        await pilot.click("#exp-go")
        await wait_for(pilot, lambda: view.last_result or view.last_error, timeout=60, what="the export")
        assert view.last_error is None, view.last_error
        assert "exported" in screen_text(app)
        # EMA weights this run does not have: a readable error, and the console goes on.
        app.query_one("#exp-weights", Select).value = "ema"
        app.query_one("#exp-dest", Input).value = str(tmp_path / "ema")
        await pilot.pause(0.05)
        assert view.start_export()
        await wait_for(pilot, lambda: view.last_result or view.last_error, timeout=60, what="the EMA export")
        assert view.last_error and "ema" in view.last_error.lower()
        assert "export failed" in screen_text(app)
        assert not (tmp_path / "ema").exists()
    result = pimm_here("export", "--run-dir", run, "last", theirs)
    assert result.returncode == 0, describe(result)
    a, b = _tensors(ours / "model.safetensors"), _tensors(theirs / "model.safetensors")
    assert sorted(a) == sorted(b) and a
    for k in a:
        assert a[k].dtype == b[k].dtype and (a[k] == b[k]).all(), k
    ja, jb = json.loads((ours / "export.json").read_text()), json.loads((theirs / "export.json").read_text())
    for key in ("step", "epoch", "weights", "format", "file", "num_tensors", "aliases", "config", "source"):
        assert ja[key] == jb[key], key
    # (The safetensors header's metadata order varies between processes, so file hashes may differ.)
    assert _metadata(ours / "model.safetensors") == _metadata(theirs / "model.safetensors")
    assert (ours / "config.json").read_text() == (theirs / "config.json").read_text()


# ------------------------------------------------------------------- robustness
def _damage(kind: str, run: Path, tmp_path: Path) -> tuple[Path, str]:
    """A broken copy of ``run`` and a phrase the console must show about it."""
    if kind == "empty":
        d = tmp_path / "empty"
        d.mkdir()
        return d, "empty run directory"
    if kind == "missing-path":
        return tmp_path / "not-there", "does not exist"
    rd = copy_run(run, tmp_path)
    if kind == "half-created":
        for p in ("status.json", "metrics.jsonl", "train.log", "provenance.json"):
            (rd / p).unlink()
        import shutil

        shutil.rmtree(rd / "model")
        return rd, "no status.json"
    if kind == "finished":
        return rd, "FINISHED"
    if kind == "failed":
        status = json.loads((rd / "status.json").read_text())
        status.update(state="failed", error="RuntimeError: CUDA out of memory")
        (rd / "status.json").write_text(json.dumps(status))
        return rd, "run failed: RuntimeError: CUDA out of memory"
    if kind == "truncated-metrics":
        with open(rd / "metrics.jsonl", "ab") as f:
            f.write(b'{"step": 91, "epoch": 2, "spl')
        return rd, "unfinished line"
    if kind == "garbage-metrics":
        with open(rd / "metrics.jsonl", "ab") as f:
            f.write(b"\x00\xffnot json\n[1, 2]\n")
        return rd, "2 damaged line(s)"
    if kind == "corrupt-manifest":
        (rd / "model" / "last" / "manifest.json").write_text('{"step": 9')
        return rd, "damaged manifest: last"
    if kind == "missing-status":
        (rd / "status.json").unlink()
        return rd, "no status.json"
    if kind == "corrupt-status":
        (rd / "status.json").write_text("{oops")
        return rd, "status.json is not valid JSON"
    if kind == "dead-pid":
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        status = json.loads((rd / "status.json").read_text())
        import time

        status.update(state="running", pid=proc.pid, pids=[proc.pid], heartbeat=time.time())
        (rd / "status.json").write_text(json.dumps(status))
        return rd, f"process {proc.pid} is gone"
    if kind == "stale-heartbeat":
        status = json.loads((rd / "status.json").read_text())
        status.update(state="running", pid=os.getpid(), heartbeat=1.0)
        (rd / "status.json").write_text(json.dumps(status))
        return rd, "no heartbeat for"
    raise ValueError(kind)


ALL_TABS = ("empty", "half-created", "corrupt-manifest", "truncated-metrics", "dead-pid")
KINDS = ["empty", "missing-path", "half-created", "finished", "failed", "truncated-metrics", "garbage-metrics",
         "corrupt-manifest", "missing-status", "corrupt-status", "dead-pid", "stale-heartbeat"]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_damaged_runs_open_and_say_what_is_wrong(kind: str, run: Path, tmp_path: Path) -> None:
    rd, phrase = _damage(kind, run, tmp_path)
    app = make_app(rd)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert phrase in screen_text(app), screen_text(app)
        if kind in ALL_TABS:  # every view draws without raising (the others: Live only, for time)
            for tab in "2341":
                await pilot.press(tab)
                await pilot.pause(0.05)
        if kind in ("dead-pid", "stale-heartbeat", "failed", "half-created"):
            assert app.check_action("stop", ()) is None  # not live: stop disabled
        await loaded(pilot)
        assert app.poll_error is None
        assert app.is_running
    if kind == "corrupt-manifest":
        assert isinstance(app.snapshot.candidates[0].reason, str)
