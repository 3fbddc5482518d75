"""The runs view (``pimm tui ROOT``): every run under a root, as ``pimm runs ls`` lists them, live.

The table's rows are :class:`~pimm_core.watch.runs.RunRow` (``runs ls``'s reader), read again
in a worker thread every poll by :class:`~pimm_core.watch.runs_poll.RunsPoller` (unchanged
finished runs cost a few ``stat`` calls). The view asks the app to open a run, stop one or
compare marked ones with the messages below; it never imports the app.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Static

from pimm_core.text import clean_text, plain_text, printable
from pimm_core.watch.fmt import fmt_age, fmt_value
from pimm_core.watch.runs import RunRow
from pimm_core.watch.runs_poll import RunsPoller

from ..fmt import error_line
from ..widgets import STATE_STYLE

#: The columns, as ``pimm runs ls`` prints them, after the mark column.
COLUMNS = ("RUN", "STATE", "STEP", "EPOCH", "LOSS", "BEST", "RESUME", "AGE", "HOST", "RANKS")
#: States the stop key acts on (the rest are refused with a note: nothing to stop).
STOPPABLE = ("live", "starting")
_STYLE = {"live": "bold green", "stale": "bold magenta", **{k: v for k, v in STATE_STYLE.items() if k != "running"}}


@dataclass
class OpenRun(Message):
    """Open ``run_dir`` in the one-run views (Live, Checkpoints, Topology, Export)."""

    run_dir: Path


@dataclass
class StopRun(Message):
    """Ask the operator to confirm, then stop the live run ``run_dir`` (``step``: where it is)."""

    run_dir: Path
    step: int | None


@dataclass
class CompareRuns(Message):
    """Compare the marked runs (the first is the reference for config differences); ``names``: as listed."""

    run_dirs: list[Path]
    names: list[str]


@dataclass
class RunsPolled(Message):
    """The worker read the root: the rows, or None and why not."""

    rows: list[RunRow] | None
    error: str | None


def cells(row: RunRow, marked: bool) -> list[Text]:
    """The table cells of ``row``: the mark, then :data:`COLUMNS` (user text never markup)."""
    def cell(v: object) -> str:
        return "-" if v is None else str(v)

    step = cell(row.step) + (f"/{row.total_steps}" if row.total_steps is not None else "")
    epoch = cell(row.epoch) + (f"/{row.epochs}" if row.epochs is not None else "")
    best = "-" if row.best is None else f"{row.best['metric']} {fmt_value(row.best['value'])}"
    resume = "-" if row.resume is None else f"{row.resume}@{cell(row.resume_step)}"
    values = [row.name, row.state, step, epoch, row.loss_text(), best, resume, fmt_age(row.age_s), cell(row.host),
              cell(row.world_size)]
    out = [Text("*" if marked else " ", style="bold yellow")]
    for i, v in enumerate(values):
        out.append(plain_text(v, style=_STYLE.get(row.state, "") if i == 1 else ("bold" if i == 0 else "")))
    return out


def matches(row: RunRow, query: str) -> bool:
    """Every word of ``query`` is in the run's name or is its state (case-insensitive)."""
    name, state = row.name.lower(), row.state.lower()
    return all(w in name or w == state for w in query.lower().split())


class RunsScreen(Screen[None]):
    """The runs table with its filter; ``refresh_s``: seconds between reads of the root.

    Attributes:
        rows: every run's newest row (unfiltered), by path.
        shown: the rows in the table now (filtered), in order.
        marked: paths of the marked runs, in the order they were marked.
        polls: reads applied (tests wait on it).
    """

    DEFAULT_CSS = """
    RunsScreen #runs-head { height: auto; max-height: 3; padding: 0 1; background: $boost; }
    RunsScreen #runs-filter { height: 1; border: none; padding: 0 1; }
    RunsScreen #runs-table { height: 1fr; }
    """
    BINDINGS = [
        Binding("slash,f", "filter", "Filter"),
        Binding("m,space", "mark", "Mark"),
        Binding("c", "compare", "Compare"),
        Binding("s", "stop", "Stop run"),
        Binding("r", "refresh", "Refresh", show=False),
        Binding("escape", "leave_filter", "Leave filter", show=False),
    ]

    def __init__(self, root: Path, *, refresh_s: float = 2.0):
        super().__init__(id="runs")
        self.root = Path(root)
        self.refresh_s = refresh_s
        self.rows: dict[str, RunRow] = {}
        self.shown: list[RunRow] = []
        self.marked: list[str] = []
        self.polls = 0
        self.error: str | None = None
        self._poller = RunsPoller(self.root)
        self._drawn: dict[str, list[Text]] = {}  # the cells in the table, by path
        self._polling = False

    def compose(self) -> ComposeResult:
        yield Static(plain_text(f"{self.root}: reading the runs…"), id="runs-head")
        yield Input(placeholder="filter: words of the name, or a state (live, finished…)", id="runs-filter")
        yield DataTable(id="runs-table", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_column(" ", key="mark", width=1)
        for name in COLUMNS:
            table.add_column(name, key=name.lower())
        self.query_one("#runs-filter", Input).display = False
        table.focus()
        self.set_interval(self.refresh_s, self.poll)
        self.poll()

    # ------------------------------------------------------------- reading
    def poll(self) -> None:
        """Read the root again in a worker (reads are coalesced; none while another screen covers this one)."""
        if not self._polling and self.is_current:
            self._polling = True
            self._read()

    @work(thread=True, group="runs-poll", exit_on_error=False)
    def _read(self) -> None:
        try:
            rows, error = self._poller.poll(), None
        except Exception as e:  # a reader bug must not take the console down
            rows, error = None, f"reading the runs failed: {error_line(e)}"
        self.post_message(RunsPolled(rows, error))

    def on_runs_polled(self, message: RunsPolled) -> None:
        self._polling = False
        self.error = message.error
        if message.rows is not None:
            self.rows = {r.path: r for r in message.rows}
            self.marked = [p for p in self.marked if p in self.rows]  # a deleted run is unmarked
        self.polls += 1
        self._redraw()

    def on_screen_resume(self) -> None:
        self.poll()  # back from a run, the compare view or the stop question: fresh rows now

    # ------------------------------------------------------------- drawing
    @property
    def query_text(self) -> str:
        return self.query_one("#runs-filter", Input).value

    def highlighted(self) -> RunRow | None:
        table = self.query_one(DataTable)
        if not self.shown or table.cursor_row is None or not 0 <= table.cursor_row < len(self.shown):
            return None
        return self.shown[table.cursor_row]

    def _redraw(self) -> None:
        table = self.query_one(DataTable)
        keep = self.highlighted()
        shown = [r for r in self.rows.values() if matches(r, self.query_text)]
        if [r.path for r in shown] == [r.path for r in self.shown] and table.row_count == len(shown):
            for row in shown:  # the same runs: update the cells that changed, in place (the cursor stays)
                new = cells(row, row.path in self.marked)
                old = self._drawn.get(row.path, [])
                for i, (col, value) in enumerate(zip(["mark", *(c.lower() for c in COLUMNS)], new)):
                    if i >= len(old) or old[i] != value:
                        table.update_cell(row.path, col, value, update_width=True)
                self._drawn[row.path] = new
        else:
            table.clear()
            self._drawn = {}
            for row in shown:
                self._drawn[row.path] = cells(row, row.path in self.marked)
                table.add_row(*self._drawn[row.path], key=row.path)
            if shown:  # DataTable keeps rows drawn before it measured them: redraw once measured
                first = shown[0].path
                table.call_after_refresh(lambda: first in self._drawn and table.is_valid_row_index(0) and
                                         table.update_cell(first, "mark", self._drawn[first][0]))
            paths = [r.path for r in shown]
            if keep is not None and keep.path in paths:  # the operator's run stays highlighted
                table.move_cursor(row=paths.index(keep.path), animate=False)
        self.shown = shown
        self._head()

    def _head(self) -> None:
        counts: dict[str, int] = {}
        for r in self.rows.values():
            counts[r.state] = counts.get(r.state, 0) + 1
        t = Text()
        t.append(printable(self.root), style="bold")
        t.append(f"  {len(self.rows)} run(s)")
        if counts:
            t.append(": " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
        if self.query_text:
            t.append(f"  showing {len(self.shown)} matching ", style="cyan")
            t.append(printable(repr(self.query_text)), style="cyan")
        if self.marked:
            t.append(f"  {len(self.marked)} marked", style="yellow")
        if not self.rows and self.polls:
            t.append("\nno run directories here (yet)", style="dim")
        if self.error:
            t.append(f"\n⚠ {self.error}", style="bold red")
        self.query_one("#runs-head", Static).update(clean_text(t))

    # ------------------------------------------------------------- actions
    def action_filter(self) -> None:
        box = self.query_one("#runs-filter", Input)
        box.display = True
        box.focus()

    @on(Input.Changed, "#runs-filter")
    def _filter_changed(self) -> None:
        self._redraw()

    @on(Input.Submitted, "#runs-filter")
    def _filter_done(self) -> None:
        self.action_leave_filter()

    def action_leave_filter(self) -> None:
        box = self.query_one("#runs-filter", Input)
        box.display = bool(box.value)  # an empty filter goes away; a set one stays in sight
        self.query_one(DataTable).focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if isinstance(self.focused, Input) and action in ("mark", "compare", "stop", "refresh", "filter"):
            return False  # these keys type into the filter
        if action == "leave_filter":
            return isinstance(self.focused, Input)
        return True

    def action_mark(self) -> None:
        row = self.highlighted()
        if row is None:
            return
        if row.path in self.marked:
            self.marked.remove(row.path)
        else:
            self.marked.append(row.path)
        mark = cells(row, row.path in self.marked)[0]
        self.query_one(DataTable).update_cell(row.path, "mark", mark)
        if row.path in self._drawn:
            self._drawn[row.path][0] = mark
        self._head()

    def action_compare(self) -> None:
        if len(self.marked) < 2:
            self.notify("mark two or more runs first (m or space on each), then c", severity="warning")
            return
        rows = [self.rows[p] for p in self.marked]
        self.post_message(CompareRuns([Path(r.path) for r in rows], [r.name for r in rows]))

    def action_stop(self) -> None:
        row = self.highlighted()
        if row is None:
            return
        if row.state not in STOPPABLE:
            why = f"the run is {row.state}" + (f" ({row.note})" if row.note else "")
            self.notify(printable(f"cannot stop {row.name}: {why}"), severity="warning", markup=False)
            return
        self.post_message(StopRun(Path(row.path), row.step))

    def action_refresh(self) -> None:
        self.poll()

    @on(DataTable.RowSelected, "#runs-table")
    def _open(self, event: DataTable.RowSelected) -> None:
        self.post_message(OpenRun(Path(str(event.row_key.value))))
