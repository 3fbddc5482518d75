"""The console application: one run directory, polled by a worker thread once a second
(``pimm tui ROOT``: first a table of the runs under a root, see :mod:`.runs_routing`).

The views (:mod:`pimm_tui.views`) do not import this module: they get snapshots through
``show()`` and ask for tab changes and re-reads with messages (:mod:`pimm_tui.views.common`).
"""

from __future__ import annotations

import os
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.widgets import DataTable, Footer, Input, TabbedContent, TabPane, Tabs

from pimm_core.watch.snapshot import RunReader, RunSnapshot
from pimm_core.process.shell import resume_command
from pimm_core.process.stop import write_stop_file
from pimm_core.text import printable

from .fmt import error_line
from .runs_routing import RunsRouting
from .screens import ConfirmStop, stop_unavailable
from .views.checkpoints import CheckpointsView
from .views.common import OpenView, RefreshRun
from .views.export import ExportView
from .views.live import LiveView
from .views.topology import TopologyView
from .widgets import RunBar

TABS = ("live", "checkpoints", "topology", "export")


@dataclass
class Polled(Message):
    """A worker finished reading the run: the new snapshot, or None and why not."""

    snap: RunSnapshot | None
    error: str | None


class PimmConsole(RunsRouting, App[None]):
    """``pimm tui RUN``: watch a run, stop it, browse checkpoints, diff topology, export.

    Attributes:
        run_dir: the run directory shown (None while ``pimm tui ROOT`` has opened none).
        root: the root whose runs are listed (``pimm tui ROOT``), or None.
        snapshot: the newest :class:`~pimm_core.watch.snapshot.RunSnapshot` (None before the first read).
        polls: how many reads were applied (tests wait on it).
        states_seen: the run's displayed states, in order, without repeats.
    """

    CSS_PATH = "pimm.tcss"
    TITLE = "pimm"
    ENABLE_COMMAND_PALETTE = False
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("s", "stop", "Stop run"),
        Binding("r", "refresh", "Refresh"),
        Binding("p", "toggle_plot", "Loss/LR"),
        Binding("l", "toggle_log", "Log/lin"),
        # The Checkpoints view's keys, here so that they work wherever the focus is on that tab.
        Binding("v", "checkpoint('verify')", "Verify"),
        Binding("e", "checkpoint('export')", "Export"),
        Binding("t", "checkpoint('topology')", "Topology"),
        Binding("1", "tab('live')", "Live", show=False),
        Binding("2", "tab('checkpoints')", "Checkpoints", show=False),
        Binding("3", "tab('topology')", "Topology", show=False),
        Binding("4", "tab('export')", "Export", show=False),
        Binding("escape", "focus_tabs", "Leave field"),
    ]

    def __init__(self, run_dir: Path | None, *, refresh_s: float = 1.0, root: Path | None = None):
        super().__init__()
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.root = None if root is None else Path(root)
        if self.root is not None:  # Escape on a run's views goes back to the runs table
            self._bindings.key_to_bindings["escape"] = [Binding("escape", "back", "Runs")]
        self.refresh_s = refresh_s
        self.snapshot: RunSnapshot | None = None
        self.polls = 0
        self.states_seen: list[str] = []
        self.poll_error: str | None = None
        self._reader = None if self.run_dir is None else RunReader(self.run_dir)
        self._polling = False
        self._force_next = False
        self._stop_label: str | None = None
        self.stop_sent_at: float | None = None
        self.crash: BaseException | None = None  # the error that ended the app (pimm tui exits 1)
        self.crash_log: Path | None = None  # its traceback

    # ---------------------------------------------------------------- layout
    def compose(self) -> ComposeResult:
        yield RunBar("reading the run…", id="runbar")
        with TabbedContent(initial="live", id="tabs"):
            with TabPane("1 Live", id="live"):
                yield LiveView(id="live-view")
            with TabPane("2 Checkpoints", id="checkpoints"):
                yield CheckpointsView(id="ckpt-view")
            with TabPane("3 Topology", id="topology"):
                yield TopologyView(id="topo-view")
            with TabPane("4 Export", id="export"):
                yield ExportView(id="export-view")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = printable(self.run_dir or self.root)
        self._update_stop_binding()
        self.set_interval(self.refresh_s, self.poll)
        if self.root is not None:
            self.show_runs()
        self.poll()

    # --------------------------------------------------------------- polling
    def poll(self, force: bool = False) -> None:
        """Start a background read unless one is running (reads are coalesced)."""
        if self._reader is None or self.runs_showing():  # no run open, or the runs table covers it
            return
        if self._polling:
            self._force_next = self._force_next or force
            return
        self._polling = True
        self._read(force)

    @work(thread=True, group="poll", exit_on_error=False)
    def _read(self, force: bool) -> None:
        try:
            snap, error = self._reader.poll(force_checkpoints=force), None
        except Exception as e:  # a reader bug must not take the console down
            snap, error = None, f"reading the run failed: {error_line(e)}"
        self.post_message(Polled(snap, error))

    def on_polled(self, message: Polled) -> None:
        self._polling = False
        if message.snap is not None and message.snap.run_dir != self.run_dir:  # read before another run was opened
            self.poll(force=True)
            return
        self.poll_error = message.error
        snap = message.snap or self.snapshot
        if message.snap is not None:
            self.snapshot = message.snap
            state = message.snap.status.display_state
            if not self.states_seen or self.states_seen[-1] != state:
                self.states_seen.append(state)
        self.polls += 1
        try:
            self.query_one(RunBar).show(snap, message.error)
            if snap is not None:
                self.query_one(LiveView).show(snap)
                self.query_one(CheckpointsView).show(snap)
                self.query_one(TopologyView).show(snap)
                self.query_one(ExportView).show(snap)
        except Exception as e:  # drawing must never crash the console (nor a late read at exit)
            try:
                self.query_one(RunBar).show(snap, f"display error: {error_line(e)}")
            except Exception:
                return
        self._update_stop_binding()
        if snap is not None and isinstance(self.screen, ConfirmStop):
            self.screen.set_step(snap.step)  # the question shows the step the run is at now
        if self._force_next:
            self._force_next = False
            self.poll(force=True)

    # --------------------------------------------------------------- actions
    def can_stop(self) -> bool:
        return stop_unavailable(self.snapshot) is None

    def _update_stop_binding(self) -> None:
        why = stop_unavailable(self.snapshot)
        label = "Stop run" if why is None else printable(f"Stop: {why}")
        if label != self._stop_label:
            self._stop_label = label
            self._bindings.key_to_bindings["s"] = [Binding("s", "stop", label)]
            self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action != "quit" and self.runs_showing():  # the runs screens have their own keys
            return False
        if action == "stop":
            return True if self.can_stop() else None  # None: shown, but disabled
        if action == "focus_tabs":  # shown only while typing in a field (the other keys type there)
            return isinstance(self.focused, Input)
        if action == "checkpoint":  # shown on the Checkpoints tab only
            try:
                return self.query_one(TabbedContent).active == "checkpoints"
            except Exception:
                return False
        if action == "toggle_log":
            try:
                return self.query_one(TabbedContent).active == "live"
            except Exception:
                return True
        if action == "toggle_plot":  # narrow terminals show one plot at a time
            try:
                return self.query_one(TabbedContent).active == "live" and not self.screen.has_class("-wide")
            except Exception:
                return True
        return True

    def action_stop(self) -> None:
        if not self.can_stop():
            s = self.snapshot
            why = "the run is not live" if s is None else (s.status.note or f"the run is {s.status.display_state}")
            self.notify(printable(f"cannot stop: {why}"), severity="warning", markup=False)
            return
        name = "/".join(self.run_dir.absolute().parts[-2:])
        self.push_screen(ConfirmStop(name, self.snapshot.step if self.snapshot else None, resume_command(self.run_dir)),
                         self._stop_confirmed)

    def _stop_confirmed(self, confirmed: bool | None) -> None:
        if not confirmed:
            return
        if not self.can_stop():  # the run ended (or went quiet) while the question was open
            state = self.snapshot.status.display_state if self.snapshot else "unknown"
            self.notify(printable(f"not sent: the run is no longer live ({state})"), severity="warning", markup=False)
            return
        self._write_stop()

    @work(thread=True, group="stop")
    def _write_stop(self) -> None:
        try:
            path = write_stop_file(self.run_dir, "operator")
        except Exception as e:
            self.call_from_thread(self.notify, printable(f"could not write the stop request: {error_line(e)}"),
                                  severity="error", markup=False)
            return
        self.call_from_thread(self._stop_written, path)

    def _stop_written(self, path: Path) -> None:
        import time

        self.stop_sent_at = time.time()
        self.notify(printable(f"stop requested: wrote {path}; the run saves last and exits"), title="stopping",
                    markup=False)
        self.poll(force=True)

    def on_resize(self) -> None:
        self.refresh_bindings()

    def action_refresh(self) -> None:
        self.poll(force=True)

    def action_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab

    def action_focus_tabs(self) -> None:
        self.query_one(TabbedContent).query_one(Tabs).focus()

    def action_toggle_plot(self) -> None:
        self.query_one(LiveView).toggle_class("-show-lr")

    def action_checkpoint(self, what: str) -> None:
        view = self.query_one(CheckpointsView)
        {"verify": view.action_verify, "export": view.action_export, "topology": view.action_topology}[what]()

    def action_toggle_log(self) -> None:
        log = self.query_one(LiveView).toggle_log()
        self.notify(f"loss plot: {'log' if log else 'linear'} y axis", timeout=2)

    def on_open_view(self, message: OpenView) -> None:
        if message.tab == "export":
            self.query_one(TabbedContent).active = "export"
            self.query_one(ExportView).prefill(message.name)
        elif message.tab == "topology":
            self.query_one(TabbedContent).active = "topology"
            self.query_one(TopologyView).select(message.name)

    def on_refresh_run(self, message: RefreshRun) -> None:
        self.poll(force=True)

    @on(TabbedContent.TabActivated)
    def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        if event.pane is not None and event.pane.id == "checkpoints":
            self.query_one("#ckpt-table", DataTable).focus()
        else:
            self.query_one(TabbedContent).query_one(Tabs).focus()
        self.refresh_bindings()

    # ---------------------------------------------------------------- errors
    def _handle_exception(self, error: Exception) -> None:
        """An error nothing caught ends the console: keep it for ``pimm tui``'s one-line
        report and exit status 1, and its traceback in a file (not on the terminal)."""
        if self.crash is None:
            self.crash = error
            try:
                fd, name = tempfile.mkstemp(prefix="pimm-tui-crash-", suffix=".log")
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(f"pimm tui {self.run_dir or self.root}\n")
                    f.write("".join(traceback.format_exception(error)))
                self.crash_log = Path(name)
            except OSError:
                self.crash_log = None
        super()._handle_exception(error)

    def _print_error_renderables(self) -> None:
        if self.crash is not None:  # pimm tui prints one `error:` line instead of the traceback
            self._exit_renderables.clear()
            return
        super()._print_error_renderables()

    def crash_message(self) -> str:
        """One line about the error that ended the console."""
        what = error_line(self.crash) if self.crash is not None else f"exit status {self.return_code}"
        where = f" (traceback in {self.crash_log})" if self.crash_log else ""
        return f"the console stopped on an error: {what}{where}"


def build_app(run_dir: str | Path, *, refresh_s: float = 1.0) -> PimmConsole:
    """The console for ``run_dir`` (not started; call ``.run()`` or ``.run_test()``).

    Never raises for a damaged or incomplete run directory: what cannot be read is
    shown as a problem line.
    """
    return PimmConsole(Path(run_dir), refresh_s=refresh_s)


def build_runs_app(root: str | Path, *, refresh_s: float = 1.0) -> PimmConsole:
    """The console on the runs under ``root`` (a run root or a group): the runs table first,
    Enter opens a run in the one-run views, Escape comes back (not started)."""
    return PimmConsole(None, refresh_s=refresh_s, root=Path(root))
