"""``pimm tui ROOT``: the screens of many runs and how the console moves between them.

The runs table (:class:`~.views.runs.RunsScreen`) is installed once and pushed over the
one-run views: Enter opens the highlighted run in those views (the console reads that run
from then on), Escape there brings the table back with the same run highlighted. ``s`` on
the table stops a live run after the one-run console's question
(:class:`~.screens.ConfirmStop`); ``c`` pushes :class:`~.views.compare.CompareScreen` for the
marked runs. :class:`RunsRouting` is mixed into :class:`~.app.PimmConsole`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual import work

from pimm_core.process.shell import resume_command
from pimm_core.process.stop import write_stop_file
from pimm_core.text import printable
from pimm_core.watch.snapshot import RunReader
from pimm_core.watch.status import liveness

from .fmt import error_line
from .screens import ConfirmStop
from .views.compare import CompareScreen
from .views.runs import CompareRuns, OpenRun, RunsScreen, StopRun

RUNS = "runs"


class RunsRouting:
    """The console's moves between the runs table, one run, and the compare view.

    Expects of the app it is mixed into: ``root`` (None: one run only), ``run_dir``,
    ``_reader``, ``snapshot``, ``states_seen``, ``stop_sent_at``, ``refresh_s``, ``poll()``,
    ``_update_stop_binding()`` and Textual's ``App`` API.
    """

    root: Path | None

    def runs_showing(self: Any) -> bool:
        """The runs table or the compare view is on the screen stack (the one run is not shown)."""
        return any(isinstance(s, (RunsScreen, CompareScreen)) for s in self.screen_stack)

    def runs_screen(self: Any) -> RunsScreen | None:
        """The installed runs table (None for ``pimm tui RUN``)."""
        return self.get_screen(RUNS) if self.root is not None and self.is_screen_installed(RUNS) else None

    def show_runs(self: Any) -> None:
        """Show the runs table (installed on first use: its highlight and marks are kept)."""
        if not self.is_screen_installed(RUNS):
            # the table reads every run: half as often as the one-run views read theirs
            self.install_screen(RunsScreen(self.root, refresh_s=self.refresh_s * 2), RUNS)
        if not self.runs_showing():
            self.push_screen(RUNS)

    def action_back(self: Any) -> None:
        """Escape on the one-run views: leave a field being typed in, else back to the runs table."""
        from textual.widgets import Input

        if isinstance(self.focused, Input):
            self.action_focus_tabs()
        elif self.screen is self.screen_stack[0]:
            self.show_runs()

    async def on_open_run(self: Any, message: OpenRun) -> None:
        if isinstance(self.screen, RunsScreen):
            await self.pop_screen()
        if self.run_dir is None or Path(message.run_dir) != self.run_dir:
            self.run_dir = Path(message.run_dir)
            self._reader = RunReader(self.run_dir)
            self.snapshot, self.states_seen, self.stop_sent_at, self.poll_error = None, [], None, None
            await self.recompose()  # fresh views: nothing of the previous run stays on them
        self.sub_title = printable(self.run_dir)
        self._update_stop_binding()
        self.poll(force=True)

    def on_compare_runs(self: Any, message: CompareRuns) -> None:
        self.push_screen(CompareScreen(message.run_dirs, message.names))

    def on_stop_run(self: Any, message: StopRun) -> None:
        run_dir = Path(message.run_dir)
        name = "/".join(run_dir.absolute().parts[-2:])
        self.push_screen(ConfirmStop(name, message.step, resume_command(run_dir)),
                         lambda ok: self._runs_stop(run_dir) if ok else None)

    @work(thread=True, group="stop")
    def _runs_stop(self: Any, run_dir: Path) -> None:
        # The row may be seconds old: the run must still be live now (the verdict `pimm stop` uses).
        view = liveness(run_dir)
        if not view.stoppable:
            why = view.note or f"the run is {view.display_state}"
            self.call_from_thread(self.notify, printable(f"not sent: {why}"), severity="warning", markup=False)
            return
        try:
            path = write_stop_file(run_dir, "operator")
        except Exception as e:
            self.call_from_thread(self.notify, printable(f"could not write the stop request: {error_line(e)}"),
                                  severity="error", markup=False)
            return
        self.call_from_thread(self.notify, printable(f"stop requested: wrote {path}; the run saves last and exits"),
                              title="stopping", markup=False)
        screen = self.runs_screen()
        if screen is not None:
            self.call_from_thread(screen.poll)
