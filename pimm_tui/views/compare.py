"""The compare view: one metric of two or more runs on one plot, and how their configs differ.

The marked runs' ``metrics.jsonl`` are read in a worker thread by
:func:`~pimm_core.watch.compare.read_series` (bounded: a tail plus an evenly spaced sample of
a large file, at most ``max_points`` per metric); only the marked runs are read, when the view
opens and on ``r``. ``n``/``p`` choose the metric, ``x`` switches the x axis between the global
step and samples seen, ``l`` the y axis between linear and log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Static
from textual_plot.axis_formatter import NumericAxisFormatter

from pimm_core.text import clean_text, printable
from pimm_core.watch.compare import RunSeries, config_diff, read_series

from ..fmt import error_line
from ..widgets import LogAxis, StepAxis, _Plot, _thin

#: Line colours of the runs, in marking order (cycled beyond six runs).
COLORS = ("cyan", "magenta", "yellow", "green", "red", "blue")


@dataclass
class SeriesRead(Message):
    """The worker read the marked runs (None and why not when it failed)."""

    runs: list[RunSeries] | None
    error: str | None


def metric_order(runs: list[RunSeries]) -> list[str]:
    """Every metric any run logged (finite or not): ``loss`` first, then evaluation ones (``val/...``),
    then the rest."""
    names = {n for r in runs for n in (*r.series, *r.nonfinite)}
    return sorted(names, key=lambda n: (n != "loss", not n.startswith("val/"), n))


def _value(v: object) -> str:
    return "(unset)" if v is None else printable(repr(v) if isinstance(v, str) else v)


class CompareScreen(Screen[None]):
    """The marked runs side by side; Escape goes back to the runs table.

    Attributes:
        runs: what was read of each run (None until the worker is done).
        metric: the metric plotted; x_samples: the x axis is samples seen (else the global step).
        plotted: run name -> points drawn (a run without the metric is left out).
        diff_text: the config differences as shown (plain text).
    """

    # 80 columns: the diff below the plot; 120 and more (-wide): beside it.
    DEFAULT_CSS = """
    CompareScreen #cmp-body { layout: vertical; height: 1fr; }
    CompareScreen #cmp-left { height: 1fr; padding: 0 1; }
    CompareScreen #cmp-title { height: 1; }
    CompareScreen #cmp-legend { height: auto; max-height: 2; }
    CompareScreen #cmp-plot { height: 1fr; }
    CompareScreen #cmp-diff-box { height: 7; border-top: solid $primary-darken-2; padding: 0 1; }
    CompareScreen.-wide #cmp-body { layout: horizontal; }
    CompareScreen.-wide #cmp-diff-box { width: 44; height: 1fr; border-top: none; border-left: solid $primary-darken-2; }
    """
    BINDINGS = [
        Binding("escape", "back", "Runs"),
        Binding("n", "metric(1)", "Metric"),
        Binding("p", "metric(-1)", "Previous metric", show=False),  # the title says n/p
        Binding("x", "toggle_x", "Step/samples"),
        Binding("l", "toggle_log", "Log/lin"),
        Binding("r", "reload", "Re-read"),
    ]

    def __init__(self, run_dirs: list[Path], names: list[str], *, max_points: int = 1000):
        super().__init__(id="compare")
        self.run_dirs = [Path(p) for p in run_dirs]
        self.names = list(names)
        self.max_points = max_points
        self.runs: list[RunSeries] | None = None
        self.metric = "loss"
        self.x_samples = False
        self.log_y = False
        self.log_shown = False  # the y axis drawn is logarithmic (asked, and every value positive)
        self.plotted: dict[str, int] = {}
        self.diff_text = ""
        self.error: str | None = None

    def compose(self) -> ComposeResult:
        with Horizontal(id="cmp-body"):
            with Vertical(id="cmp-left"):
                yield Static("reading the marked runs…", id="cmp-title")
                yield Static("", id="cmp-legend")
                yield _Plot(allow_pan_and_zoom=False, id="cmp-plot")
            with VerticalScroll(id="cmp-diff-box"):
                yield Static("", id="cmp-diff")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#cmp-diff-box").border_title = "config differences"
        self._read()

    @work(thread=True, group="compare", exit_on_error=False)
    def _read(self) -> None:
        try:
            runs, error = [read_series(p, max_points=self.max_points) for p in self.run_dirs], None
        except Exception as e:  # a reader bug must not take the console down
            runs, error = None, f"reading the runs failed: {error_line(e)}"
        self.post_message(SeriesRead(runs, error))

    def on_series_read(self, message: SeriesRead) -> None:
        self.runs, self.error = message.runs, message.error
        if self.runs:
            order = metric_order(self.runs)
            if self.metric not in order and order:
                self.metric = order[0]
        self._draw_diff()
        self._draw_plot()

    # ------------------------------------------------------------- drawing
    def _draw_diff(self) -> None:
        t = Text()
        if self.runs:
            base = self.runs[0]
            t.append("vs ", style="dim")
            t.append(printable(self.names[0]), style=f"bold {COLORS[0]}")
            for i, (name, run) in enumerate(zip(self.names[1:], self.runs[1:]), start=1):
                t.append("\n")
                t.append(printable(name), style=f"bold {COLORS[i % len(COLORS)]}")
                diffs = config_diff(base.config, run.config)
                if not diffs:
                    t.append("\n  same config", style="dim")
                for key, a, b in diffs:
                    t.append(f"\n  {printable(key)}: ", style="bold")
                    t.append(f"{_value(a)} → {_value(b)}")
            for name, run in zip(self.names, self.runs):
                if run.problem:
                    t.append(f"\n⚠ {printable(name)}: {printable(run.problem)}", style="yellow")
        self.diff_text = t.plain
        self.query_one("#cmp-diff", Static).update(clean_text(t))

    def on_resize(self) -> None:
        self._draw_plot()

    def _draw_plot(self) -> None:
        if not self.is_mounted:
            return
        plot = self.query_one("#cmp-plot", _Plot)
        plot.clear()
        self.plotted = {}
        title = Text()
        if self.error or not self.runs:
            title.append(self.error or "reading the marked runs…", style="bold red" if self.error else "dim")
            self.query_one("#cmp-title", Static).update(clean_text(title))
            return
        order = metric_order(self.runs)
        axis = "samples seen" if self.x_samples else "global step"
        shown = [run.series.get(self.metric, ([], []))[1] for run in self.runs]
        log = self.log_y and any(shown) and all(y > 0 for ys in shown for y in ys)
        self.log_shown = log
        title.append(printable(self.metric), style="bold")
        title.append(f" vs {axis}", style="bold")
        title.append(f"  ({order.index(self.metric) + 1}/{len(order)}: n/p)" if self.metric in order else "", style="dim")
        if log:
            title.append("  log", style="dim")
        legend = Text()
        width = max(8, plot.size.width)
        lo = hi = x0 = x1 = None
        for i, (name, run) in enumerate(zip(self.names, self.runs)):
            color = COLORS[i % len(COLORS)]
            xs, ys = run.series.get(self.metric, ([], []))
            note = ""
            if self.x_samples and xs:
                if run.samples_per_step is None:
                    xs, ys, note = [], [], " (batch size unknown)"
                else:
                    xs = [x * run.samples_per_step for x in xs]
            elif not xs:
                note = " (not logged)"
            nf = run.nonfinite.get(self.metric)
            if nf is not None:  # NaN/Inf are not plotted: say where the line stops being finite
                note = f" ({nf.note().removeprefix(self.metric + ' ')})"
            if legend:
                legend.append("  ")
            legend.append("━━ ", style=f"bold {color}")
            legend.append(printable(name) + note, style="bold red" if nf is not None else "dim" if note else "")
            if not xs:
                continue
            xs, ys = _thin(tuple(xs), tuple(ys), width * 2)
            if log:
                ys = [math.log10(y) for y in ys]
            self.plotted[name] = len(xs)
            if len(xs) == 1:
                plot.scatter(xs, ys, marker_style=color)
            else:
                from textual_plot import HiResMode

                plot.plot(xs, ys, line_style=color, hires_mode=HiResMode.BRAILLE)
            lo, hi = min(ys + ([lo] if lo is not None else [])), max(ys + ([hi] if hi is not None else []))
            x0, x1 = min(xs + ([x0] if x0 is not None else [])), max(xs + ([x1] if x1 is not None else []))
        self.query_one("#cmp-title", Static).update(clean_text(title))
        self.query_one("#cmp-legend", Static).update(clean_text(legend))
        if lo is None or x0 is None or hi is None or x1 is None:
            return
        plot.set_x_formatter(StepAxis())
        plot.set_y_formatter(LogAxis() if log else NumericAxisFormatter())
        pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
        if log:
            pad = max(pad, 0.05)
        plot.set_ylimits(lo - pad, hi + pad)
        plot.set_xlimits(x0, x1 if x1 > x0 else x0 + 1)

    # ------------------------------------------------------------- actions
    def action_back(self) -> None:
        self.dismiss()

    def action_metric(self, delta: int) -> None:
        order = metric_order(self.runs or [])
        if not order:
            return
        i = order.index(self.metric) if self.metric in order else 0
        self.metric = order[(i + delta) % len(order)]
        self._draw_plot()

    def action_toggle_x(self) -> None:
        self.x_samples = not self.x_samples
        self._draw_plot()

    def action_toggle_log(self) -> None:
        self.log_y = not self.log_y
        self._draw_plot()

    def action_reload(self) -> None:
        """Read the marked runs again (a live run has logged more since the view opened)."""
        self._read()
