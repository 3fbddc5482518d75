"""Small widgets and formatting helpers of the console."""

from __future__ import annotations

import math
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.widget import Widget
from textual.widgets import Static

from pimm_core.runview import RunSnapshot, human_duration

try:  # a maintained plotting widget; the console still works (with a sparkline) without it
    from textual_plot import HiResMode, PlotWidget
except Exception:  # pragma: no cover - textual-plot is a declared dependency
    HiResMode = PlotWidget = None  # type: ignore[assignment,misc]

STATE_STYLE = {
    "starting": "bold cyan", "running": "bold green", "stopping": "bold yellow", "stopped": "bold blue",
    "finished": "bold green", "failed": "bold red", "unknown": "bold magenta",
}


def fmt_num(v: Any, digits: int = 4) -> str:
    """A metric value: ``0.8969``, ``1.27e-03``, ``-`` for missing."""
    if not isinstance(v, (int, float)) or isinstance(v, bool) or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if v == 0:
        return "0"
    if abs(v) < 1e-3 or abs(v) >= 1e5:
        return f"{v:.2e}"
    return f"{v:.{digits}f}"


def fmt_rate(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 1e6:
        return f"{v / 1e6:.1f}M"
    if v >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.1f}"


def fmt_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


def fmt_age(seconds: float | None) -> str:
    """Compact age: ``12s``, ``5m``, ``3h``, ``2d``."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


class RunBar(Static):
    """The run's name, state, heartbeat and problems; shown above every view."""

    def show(self, snap: RunSnapshot | None, error: str | None = None) -> None:
        t = Text()
        if snap is None:
            t.append("reading the run…" if error is None else "cannot read the run", style="bold")
        else:
            st = snap.status
            name = "/".join(snap.run_dir.absolute().parts[-2:])
            t.append(name, style="bold")
            state = st.display_state
            t.append("  ")
            t.append(f" {state.upper()} ", style=f"reverse {STATE_STYLE.get(state, 'bold')}")
            if st.state == "stopped" and st.raw.get("stop_reason"):
                t.append(f" ({st.raw['stop_reason']})", style="blue")
            if state == "stopping" and st.stop_request:
                t.append(f" ({st.stop_request.get('reason', 'operator')} request)", style="yellow")
            pid = st.raw.get("pid")
            if pid is not None:
                t.append(f"  pid {pid}@{st.raw.get('host', '?')}", style="dim")
                if st.pid_alive is False:
                    t.append(" (gone)", style="bold red")
            if st.heartbeat_age is not None:
                style = "bold red" if st.stale else "dim"
                label = f"no heartbeat for {human_duration(st.heartbeat_age)}" if st.stale else \
                    f"heartbeat {human_duration(st.heartbeat_age)} ago"
                t.append(f"  {label}", style=style)
            for p in snap.problems:
                t.append("\n⚠ ", style="bold yellow")
                t.append(p, style="yellow")
        if error:
            t.append(f"\n⚠ {error}", style="bold red")
        self.update(t)


def _thin(xs: tuple[float, ...], ys: tuple[float, ...], n: int) -> tuple[list[float], list[float]]:
    """At most ``n`` points, evenly chosen, keeping the first and last."""
    if len(xs) <= n or n < 2:
        return list(xs), list(ys)
    idx = [round(i * (len(xs) - 1) / (n - 1)) for i in range(n)]
    return [xs[i] for i in idx], [ys[i] for i in idx]


if PlotWidget is not None:

    class _Plot(PlotWidget, can_focus=False):  # type: ignore[misc,valid-type]
        """textual-plot's widget, without focus (its keys would shadow the console's)."""

        DEFAULT_CSS = "_Plot { height: 1fr; }"

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            # Small margins for an 80x24 terminal (set before mount: no watchers run).
            self.set_reactive(PlotWidget.margin_top, 0)
            self.set_reactive(PlotWidget.margin_bottom, 2)
            self.set_reactive(PlotWidget.margin_left, 9)
else:  # pragma: no cover
    _Plot = None  # type: ignore[assignment,misc]


class MetricPlot(Widget):
    """A line plot of one metric against the global step (textual-plot; a sparkline as fallback)."""

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
        self.points_shown = 0

    def compose(self) -> ComposeResult:
        yield Static(self.title, classes="plot-title")
        if _Plot is not None:
            yield _Plot(allow_pan_and_zoom=False)
        else:  # pragma: no cover
            from textual.widgets import Sparkline

            yield Sparkline([])

    def set_data(self, xs: tuple[float, ...], ys: tuple[float, ...]) -> None:
        self._data = (xs, ys)
        self._redraw()

    def on_resize(self) -> None:
        self._redraw()

    def _redraw(self) -> None:
        xs, ys = self._data
        if not self.is_mounted:
            return
        width = max(8, self.size.width)
        xs_l, ys_l = _thin(xs, ys, width * 2)
        title = self.title if not ys else f"{self.title}  last {fmt_num(ys[-1])}"
        self.query_one(".plot-title", Static).update(Text(title, style="bold"))
        self.points_shown = len(xs_l)
        if _Plot is None:  # pragma: no cover
            from textual.widgets import Sparkline

            self.query_one(Sparkline).data = ys_l
            return
        plot = self.query_one(_Plot)
        plot.clear()
        if not xs_l:
            return
        if len(xs_l) == 1:
            plot.scatter(xs_l, ys_l, marker_style=self.color)
        else:
            plot.plot(xs_l, ys_l, line_style=self.color, hires_mode=HiResMode.BRAILLE)
        lo, hi = min(ys_l), max(ys_l)
        pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
        plot.set_ylimits(lo - pad, hi + pad)
        plot.set_xlimits(xs_l[0], xs_l[-1] if xs_l[-1] > xs_l[0] else xs_l[0] + 1)
