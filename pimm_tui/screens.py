"""Stopping the run from the console: when the stop key works, and the question it asks first."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from pimm_core.text import plain_text
from pimm_core.watch.snapshot import RunSnapshot


def stop_unavailable(snap: RunSnapshot | None) -> str | None:
    """Why the stop key does nothing now (shown in the footer), or None when it works.

    ``snap`` is the console's newest read of the run (None before the first one).
    """
    if snap is None:
        return "reading the run"
    st = snap.status
    if st.stoppable:
        return "requested" if st.stop_request is not None else None
    if st.state in ("finished", "stopped", "failed"):
        return f"run {st.state}"
    if st.pid_alive is False:
        return "process gone"
    if st.stale:
        return "no heartbeat"
    if st.state == "stopping" or st.stop_request is not None:
        return "already stopping"
    if st.state is None:
        return "no status.json"
    return f"run {st.display_state}"


class ConfirmStop(ModalScreen[bool]):
    """Ask before writing the stop request: ``y``/Enter on "Stop" confirms, ``n``/Escape cancels."""

    BINDINGS = [
        Binding("y", "confirm", "Stop the run"),
        Binding("n,escape", "cancel", "Cancel"),
    ]

    def __init__(self, run_name: str, step: int | None, resume: str):
        super().__init__()
        self.run_name = run_name
        self.step = step
        self.resume = resume  # the command that resumes the run, as `pimm launch` prints it

    def _title(self) -> str:
        at = f" (now at step {self.step})" if self.step is not None else ""
        return f"Stop {self.run_name}{at}?"

    def set_step(self, step: int | None) -> None:
        """The run's current step (the console calls this on every read while the question is open)."""
        if step is not None and step != self.step:
            self.step = step
            if self.is_mounted:
                self.query_one("#confirm-title", Static).update(plain_text(self._title()))

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box"):
            yield Static(plain_text(self._title()), id="confirm-title")  # the run's name is never markup
            yield Static(plain_text("The trainer finishes the current accumulation window, saves model/last, "
                                    f"and exits; resume later with: {self.resume}"), id="confirm-text")
            with Horizontal(id="confirm-buttons"):
                yield Button("Stop (y)", variant="error", id="confirm-yes", compact=True)
                yield Button("Cancel (n)", variant="default", id="confirm-no", compact=True)

    def on_mount(self) -> None:
        self.query_one("#confirm-no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm-yes")

    def action_confirm(self) -> None:
        self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)
