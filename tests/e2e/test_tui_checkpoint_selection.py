"""The Checkpoints view keeps the operator's selection by name while rotation changes ``model/``
(Textual Pilot, 80x24, a run written by hand: no training): a removed row before the selected one
does not move the selection; the selected checkpoint removed clears it visibly (no row
highlighted, the detail line says why), ``e`` then asks for a selection instead of exporting
another row; the first arrow key selects again."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from textual.widgets import DataTable

from tui_support import fake_run, loaded, make_app, rotate, screen_text, train_record, wait_for, write_generation

from pimm_tui.views.checkpoints import CheckpointsView


def weights_file(model: Path, name: str, step: int, value: float) -> None:
    """An opaque weights file with a valid sidecar (as model_best.pth / best_<step>.pth have)."""
    data = f"weights of step {step}".encode()
    (model / name).write_bytes(data)
    (model / f"{name}.json").write_text(json.dumps({
        "format": "weights", "kind": "best", "step": step, "epoch": 0, "iter": step,
        "selection_metric": {"name": "val/acc", "value": value, "mode": "max"}, "metrics": {"val/acc": value},
        "files": {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}))


def remove(model: Path, name: str) -> None:
    (model / name).unlink()
    (model / f"{name}.json").unlink()


@pytest.fixture
def run(tmp_path: Path) -> Path:
    rd = fake_run(tmp_path, records=[train_record(s, 1.0 / s) for s in range(10, 90, 10)])
    model = rd / "model"
    write_generation(model / "last", 80, b"last at 80")
    for name, step, value in (("model_best.pth", 60, 0.9), ("best_40.pth", 40, 0.8), ("best_60.pth", 60, 0.9),
                              ("best_70.pth", 70, 0.85)):
        weights_file(model, name, step, value)
    return rd


def rows(app) -> list[str]:
    return [str(k.value) for k in app.query_one("#ckpt-table", DataTable).rows]


@pytest.mark.asyncio
async def test_rotation_keeps_or_visibly_clears_the_selection(run: Path) -> None:
    model = run / "model"
    app = make_app(run, refresh_s=0.1)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await loaded(pilot)
        await pilot.press("2")
        view = app.query_one(CheckpointsView)
        table = app.query_one("#ckpt-table", DataTable)
        await wait_for(pilot, lambda: rows(app) == ["last", "model_best.pth", "best_40.pth", "best_60.pth",
                                                    "best_70.pth"], what="the checkpoints listed")
        assert view.highlighted().name == "last"  # resume's choice, at first
        await pilot.press("down", "down", "down")
        await wait_for(pilot, lambda: view.selected == "best_60.pth", what="best_60.pth selected")

        # a row above the selection goes, and `last` is replaced: the selection stays on best_60.pth
        remove(model, "best_40.pth")
        rotate(model, 90, b"last at 90")
        await wait_for(pilot, lambda: "best_40.pth" not in rows(app), what="best_40.pth gone from the table")
        await pilot.pause(0.3)  # a few more refreshes
        assert view.highlighted().name == "best_60.pth" and table.cursor_row == rows(app).index("best_60.pth")

        # the selected checkpoint goes: no row is highlighted, and nothing else is selected
        remove(model, "best_60.pth")
        await wait_for(pilot, lambda: "best_60.pth" not in rows(app), what="best_60.pth gone from the table")
        await pilot.pause(0.3)
        assert view.highlighted() is None and view.selected is None and not table.show_cursor
        assert "no checkpoint selected: best_60.pth was removed" in view.detail_text
        assert "no checkpoint selected" in screen_text(app)
        await pilot.press("e")  # asks for a selection; never exports a row the operator did not choose
        await pilot.pause(0.2)
        assert app.query_one("#tabs").active != "export"
        assert any("select a checkpoint first" in n.message for n in app._notifications)
        await pilot.press("v")
        await pilot.pause(0.2)
        assert all(r is None or r.outcome != "ok" for r in view.results.values())  # nothing verified

        # the first arrow key selects again, from the top
        await pilot.press("down")
        await wait_for(pilot, lambda: view.selected == "last", what="a selection again")
        assert table.show_cursor and view.highlighted().name == "last"
        assert "no checkpoint selected" not in view.detail_text
