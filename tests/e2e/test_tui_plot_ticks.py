"""The plots' x-axis labels are whole at the sizes an operator uses (Textual Pilot, a run written
by hand): at 130x30 the side-by-side loss and LR plots of a run that ended at step 3010 used to
show ``2500     300`` (the ``3000`` tick cut at the right edge); every label is now a whole step,
the last one the run's last step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tui_support import fake_run, loaded, make_app, screen_text, train_record, wait_for

from pimm_tui.widgets import MetricPlot

TICKS = re.compile(r"^\s+\d+(\s+\d+)+\s*$")  # an x-axis label line: whole steps only


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [(130, 30), (80, 24), (120, 40)])
async def test_the_last_x_tick_label_is_whole(tmp_path: Path, size: tuple[int, int]) -> None:
    rd = fake_run(tmp_path, records=[train_record(s, 1.0 / s) for s in range(10, 3011, 10)], step=3010)
    app = make_app(rd)
    async with app.run_test(size=size) as pilot:
        await loaded(pilot)
        await wait_for(pilot, lambda: app.query_one("#loss-plot", MetricPlot).points_shown > 0, what="the plot")
        await pilot.pause(0.3)
        text = screen_text(app)
        lines = [line for line in text.splitlines() if TICKS.match(line)]
        assert lines, text
        plots = sum(1 for p in app.query(MetricPlot) if p.display)  # side by side when wide (loss | LR)
        assert plots == (2 if size[0] >= 120 else 1)
        labels = lines[0].split()
        assert labels.count("3010") == plots, text  # the last step, whole, under each plot
        for label in labels:  # each label a whole tick: a round step or the last one, never a cut "300"
            assert int(label) % 500 == 0 or label == "3010", (label, lines[0])
        assert len(lines) == 1, text
