"""Widgets shown by more than one part of the console: the run bar and the metric plot."""

from __future__ import annotations

import math
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.widget import Widget
from textual.widgets import Static

from pimm_core.text import clean_text, plain_text
from pimm_core.watch.fmt import human_duration
from pimm_core.watch.series import NonFinite
from pimm_core.watch.snapshot import RunSnapshot
from pimm_core.watch.status import LIVE_STATES

from .fmt import fmt_num, fmt_step

try:  # a maintained plotting widget; the console still works (with a sparkline) without it
    from textual_plot import HiResMode, PlotWidget
    from textual_plot.axis_formatter import NumericAxisFormatter
except Exception:  # pragma: no cover - textual-plot is a declared dependency
    HiResMode = PlotWidget = NumericAxisFormatter = None  # type: ignore[assignment,misc]

STATE_STYLE = {
    "starting": "bold cyan", "running": "bold green", "stopping": "bold yellow", "stopped": "bold blue",
    "restarting": "bold yellow",
    "finished": "bold green", "failed": "bold red", "unknown": "bold magenta",
}


#: Lines of the run bar (below its first line) for problems.
PROBLEM_LINES = 4


class RunBar(Static):
    """The run's name, state, heartbeat and problems; shown above every view.

    The first line never wraps: what does not fit is left out (pid first, then the
    heartbeat) and the rest is cut with an ellipsis. Each problem takes at most two lines.
    A run that is not live (finished, stopped, failed) shows neither pid nor heartbeat age.
    """

    def on_mount(self) -> None:
        self._shown: tuple[RunSnapshot | None, str | None] | None = None

    def on_resize(self) -> None:
        if self._shown is not None:
            self.show(*self._shown)

    def head_parts(self, snap: RunSnapshot) -> list[tuple[Text, int]]:
        """The first line's pieces with a priority (lower: left out first when it does not fit)."""
        st = snap.status
        parts: list[tuple[Text, int]] = []
        name = "/".join(snap.run_dir.absolute().parts[-2:])
        parts.append((Text(name, style="bold"), 9))
        state = st.display_state
        parts.append((Text(f" {state.upper()} ", style=f"reverse {STATE_STYLE.get(state, 'bold')}"), 9))
        if st.state == "stopped" and st.record.stop_reason:
            parts.append((Text(f"({st.record.stop_reason})", style="blue"), 8))
        if state == "stopping" and st.stop_request:
            parts.append((Text(f"({st.stop_request.get('reason', 'operator')} request)", style="yellow"), 8))
        if st.state in LIVE_STATES:  # a heartbeat and a pid mean something only while it should run
            pid = st.record.pid
            if pid is not None:
                t = Text(f"pid {pid}@{st.record.host or '?'}", style="dim")
                if st.pid_alive is False:
                    t.append(" (gone)", style="bold red")
                parts.append((t, 7 if st.pid_alive is False else 5))
            if st.heartbeat_age is not None:
                if st.stale:
                    parts.append((Text(f"no heartbeat for {human_duration(st.heartbeat_age)}", style="bold red"), 7))
                else:
                    parts.append((Text(f"heartbeat {human_duration(st.heartbeat_age)} ago", style="dim"), 6))
        return parts

    def show(self, snap: RunSnapshot | None, error: str | None = None) -> None:
        self._shown = (snap, error)
        width = self.content_size.width or 78
        t = Text()
        if snap is None:
            t.append("reading the run…" if error is None else "cannot read the run", style="bold")
        else:
            parts = self.head_parts(snap)
            while len(parts) > 2 and sum(len(p.plain) + 2 for p, _ in parts) - 2 > width:
                drop = min(range(len(parts)), key=lambda i: (parts[i][1], -i))
                parts.pop(drop)
            head = Text("  ").join(p for p, _ in parts)
            head.truncate(width, overflow="ellipsis")
            t.append_text(head)
            for lines in self._problem_lines(list(snap.problems), width):
                for line in lines:
                    t.append("\n")
                    t.append_text(line)
        if error:
            t.append(f"\n⚠ {error}", style="bold red")
        self.update(clean_text(t))

    def _problem_lines(self, problems: list[str], width: int) -> list[list[Text]]:
        """Each problem wrapped to ``width``: one line each, then the spare lines of the
        :data:`PROBLEM_LINES` budget go to the first ones that need more; the last line
        of a cut problem ends with an ellipsis."""
        if len(problems) > PROBLEM_LINES:
            problems = problems[:PROBLEM_LINES - 1] + [f"and {len(problems) - PROBLEM_LINES + 1} more problem(s)"]
        wrapped = []
        for p in problems:
            line = Text("⚠ ", style="bold yellow")
            line.append(p, style="yellow")
            try:
                wrapped.append(list(line.wrap(self.app.console, width)))
            except Exception:  # no app (tests of the widget alone)
                wrapped.append([line])
        spare = PROBLEM_LINES - len(wrapped)
        out = []
        for lines in wrapped:
            keep = 1 + min(len(lines) - 1, max(0, spare))
            spare -= keep - 1
            if keep < len(lines):
                last = lines[keep - 1]
                last.truncate(max(1, width - 1))
                last.append("…", style="yellow")
            out.append(lines[:keep])
        return out


def _thin(xs: tuple[float, ...], ys: tuple[float, ...], n: int) -> tuple[list[float], list[float]]:
    """At most ``n`` points, evenly chosen, keeping the first and last."""
    if len(xs) <= n or n < 2:
        return list(xs), list(ys)
    idx = [round(i * (len(xs) - 1) / (n - 1)) for i in range(n)]
    return [xs[i] for i in idx], [ys[i] for i in idx]


class StepAxis(NumericAxisFormatter if PlotWidget is not None else object):  # type: ignore[misc]
    """The x axis in global steps: whole steps only, compact labels (``12k``).

    With ``plot`` (the textual-plot widget it labels) every label is whole: a tick whose
    centred label would run past the plot's right edge (``3000`` near the end of a run at
    step 3010 drawn as ``300``) is dropped, and the axis's last step is labelled at the edge
    instead (right-aligned, as textual-plot draws the tick at the maximum) when it fits."""

    def __init__(self, plot: Any = None):
        self.plot = plot

    def _span(self, tick: float, label: str, at_end: bool) -> tuple[int, int]:
        """First and last column of ``label`` as textual-plot writes it under ``tick``: centred
        (an even length one column right), right-aligned at the axis maximum."""
        x = self.plot.get_pixel_from_coordinate(tick, 0.0)[0] + self.plot.margin_left
        if at_end:
            return x - len(label) + 1, x
        div, mod = divmod(len(label), 2)
        start = x - div + (1 if mod == 0 else 0)
        return start, start + len(label) - 1

    def get_ticks_and_labels(self, min_: float, max_: float, max_ticks: int = 8) -> tuple[list[float], list[str]]:
        ticks, labels = super().get_ticks_and_labels(min_, max_, max_ticks)
        if self.plot is None or not self.plot.size.width:
            return ticks, labels
        right = self.plot.size.width - 1
        kept = [(t, lab) for t, lab in zip(ticks, labels) if t == max_ or self._span(t, lab, False)[1] <= right]
        if max_ not in ticks and abs(max_ - round(max_)) < 1e-6 and max_ > min_:
            end = fmt_step(max_)
            start = self._span(max_, end, True)[0]
            if not kept or self._span(kept[-1][0], kept[-1][1], kept[-1][0] == max_)[1] < start - 1:
                kept.append((max_, end))
        return [t for t, _ in kept], [lab for _, lab in kept]

    def get_ticks(self, min_: float, max_: float, max_ticks: int = 8) -> list[float]:
        if max_ - min_ < 5:
            return [float(v) for v in range(math.ceil(min_), math.floor(max_) + 1)]
        return [t for t in super().get_ticks(min_, max_, max_ticks) if abs(t - round(t)) < 1e-6]

    def get_labels_for_ticks(self, ticks: Any) -> list[str]:
        return [fmt_step(t) for t in ticks]


def _tick_label(v: float) -> str:
    """A y label of a log axis (its value, not the logarithm), at most 7 characters."""
    if 1e-3 <= abs(v) < 1e4:
        return f"{v:.3g}"
    mant, exp = f"{v:.0e}".split("e")
    return f"{mant}e{int(exp)}"


class LogAxis(NumericAxisFormatter if PlotWidget is not None else object):  # type: ignore[misc]
    """A log10 y axis: the plot draws log10(value); ticks sit at 1, 2, 5 x 10^k (or nicer
    values inside one decade) and are labelled with the values."""

    def get_ticks(self, min_: float, max_: float, max_ticks: int = 8) -> list[float]:
        lo, hi = math.floor(min_), math.ceil(max_)
        if max_ - min_ >= 1:
            mants = (1,) if max_ - min_ >= 3 else (1, 2, 5)
            ticks = [math.log10(m) + e for e in range(lo, hi + 1) for m in mants]
            ticks = [t for t in ticks if min_ <= t <= max_]
            stride = max(1, math.ceil(len(ticks) / max_ticks))
            return ticks[::stride]
        # Inside one decade: nice values of the linear range, placed at their logarithms.
        vals = super().get_ticks(10 ** min_, 10 ** max_, max_ticks)
        return [math.log10(v) for v in vals if v > 0 and min_ <= math.log10(v) <= max_]

    def get_labels_for_ticks(self, ticks: Any) -> list[str]:
        return [_tick_label(10 ** t) for t in ticks]


if PlotWidget is not None:

    class _Plot(PlotWidget, can_focus=False):  # type: ignore[misc,valid-type]
        """textual-plot's widget, without focus (its keys would shadow the console's).

        A failure while drawing is shown in place of the plot and kept in
        ``render_error`` instead of ending the console.
        """

        DEFAULT_CSS = "_Plot { height: 1fr; }"

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            # Small margins for an 80x24 terminal (set before mount: no watchers run).
            self.set_reactive(PlotWidget.margin_top, 0)
            self.set_reactive(PlotWidget.margin_bottom, 2)
            self.set_reactive(PlotWidget.margin_left, 9)
            self.render_error: str | None = None

        def render(self) -> Any:
            try:
                return super().render()
            except Exception as e:  # noqa: BLE001 - a plot must not take the console down
                self._needs_rerender = False
                self.render_error = f"{e.__class__.__name__}: {e}"
                return plain_text(f"cannot draw this plot: {self.render_error}", style="red")
else:  # pragma: no cover
    _Plot = None  # type: ignore[assignment,misc]


class MetricPlot(Widget):
    """A line plot of one metric against the global step (textual-plot; a sparkline as fallback).

    Only finite values are drawn. Where the metric stopped being finite (NaN/Inf in
    metrics.jsonl) a red vertical line marks the first such step and the title says so.
    With ``log_y`` the y axis is logarithmic while every value is positive (else linear).
    """

    DEFAULT_CSS = """
    MetricPlot { height: 1fr; min-height: 5; }
    MetricPlot > .plot-title { height: 1; color: $text-muted; }
    """

    def __init__(self, title: str, color: str = "cyan", *, log_y: bool = False, id: str | None = None):
        super().__init__(id=id)
        self.title = title
        self.color = color
        self.log_y = log_y
        self._data: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
        self._nonfinite: NonFinite | None = None
        self._latest: Any = None
        self.points_shown = 0
        self.log_shown = False  # the y axis drawn is logarithmic
        self.marker_at: float | None = None  # step of the not-finite marker drawn
        self.title_text = ""

    def compose(self) -> ComposeResult:
        yield Static(plain_text(self.title), classes="plot-title")
        if _Plot is not None:
            yield _Plot(allow_pan_and_zoom=False)
        else:  # pragma: no cover
            from textual.widgets import Sparkline

            yield Sparkline([])

    def set_data(self, xs: tuple[float, ...], ys: tuple[float, ...], *, nonfinite: NonFinite | None = None,
                 latest: Any = None) -> None:
        """Plot ``(xs, ys)``; ``nonfinite`` marks where the metric stopped being finite;
        ``latest`` is the newest logged value (shown in the title even when it is NaN)."""
        self._data = (xs, ys)
        self._nonfinite = nonfinite
        self._latest = latest
        self._redraw()

    def set_log(self, log_y: bool) -> None:
        self.log_y = log_y
        self._redraw()

    @property
    def render_error(self) -> str | None:
        if _Plot is None or not self.is_mounted:
            return None
        return self.query_one(_Plot).render_error

    def on_resize(self) -> None:
        self._redraw()

    def _title(self, ys: list[float], log: bool) -> Text:
        t = Text(self.title, style="bold")
        latest = self._latest if self._latest is not None else (ys[-1] if ys else None)
        if latest is not None:
            bad = isinstance(latest, float) and not math.isfinite(latest)
            t.append(f"  last {fmt_num(latest)}", style="bold red" if bad else "bold")
        if log:
            t.append("  log", style="dim")
        nf = self._nonfinite
        if nf is not None and nf.first_step is not None:
            if nf.recovered:
                t.append(f"  not finite at {fmt_step(nf.first_step)}", style="yellow")
                if nf.last_step != nf.first_step:
                    t.append(f"-{fmt_step(nf.last_step or nf.first_step)}", style="yellow")
            else:
                t.append(f"  not finite from step {fmt_step(nf.first_step)}", style="bold red")
        elif not ys and self._latest is None:
            t.append("  (no values yet)", style="dim")
        return t

    def _redraw(self) -> None:
        if not self.is_mounted:
            return
        xs_all, ys_all = self._data
        pts = [(x, y) for x, y in zip(xs_all, ys_all) if math.isfinite(x) and math.isfinite(y)]
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        log = self.log_y and bool(ys) and min(ys) > 0
        width = max(8, self.size.width)
        xs_l, ys_l = _thin(tuple(xs), tuple(ys), width * 2)
        title = self._title(ys, log)
        self.title_text = title.plain
        self.query_one(".plot-title", Static).update(clean_text(title))
        self.points_shown = len(xs_l)
        self.log_shown = log
        if _Plot is None:  # pragma: no cover
            from textual.widgets import Sparkline

            self.query_one(Sparkline).data = ys_l
            return
        plot = self.query_one(_Plot)
        plot.clear()
        nf = self._nonfinite
        mark = nf.first_step if nf is not None and nf.first_step is not None else None
        self.marker_at = mark
        if not xs_l and mark is None:
            return
        plot.set_x_formatter(StepAxis(plot))
        plot.set_y_formatter(LogAxis() if log else NumericAxisFormatter())
        draw_y = [math.log10(y) for y in ys_l] if log else ys_l
        if len(xs_l) == 1:
            plot.scatter(xs_l, draw_y, marker_style=self.color)
        elif xs_l:
            plot.plot(xs_l, draw_y, line_style=self.color, hires_mode=HiResMode.BRAILLE)
        if mark is not None:
            plot.add_v_line(mark, line_style="bold red")
        if draw_y:
            lo, hi = min(draw_y), max(draw_y)
            pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
            if log:
                pad = max(pad, 0.05)
            plot.set_ylimits(lo - pad, hi + pad)
        else:
            plot.set_ylimits(0.0, 1.0)
        xvals = xs_l + ([mark] if mark is not None else []) + \
            ([nf.last_step] if nf is not None and nf.last_step is not None else [])
        x0, x1 = min(xvals), max(xvals)
        plot.set_xlimits(x0, x1 if x1 > x0 else x0 + 1)
