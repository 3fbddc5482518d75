"""Modal screens of the console."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static


class ConfirmStop(ModalScreen[bool]):
    """Ask before writing the stop request: ``y``/Enter on "Stop" confirms, ``n``/Escape cancels."""

    BINDINGS = [
        Binding("y", "confirm", "Stop the run"),
        Binding("n,escape", "cancel", "Cancel"),
    ]

    def __init__(self, run_name: str, step: int | None):
        super().__init__()
        self.run_name = run_name
        self.step = step

    def compose(self) -> ComposeResult:
        at = f" (now at step {self.step})" if self.step is not None else ""
        with Vertical(id="confirm-box"):
            yield Static(f"Stop {self.run_name}{at}?", id="confirm-title")
            yield Static("The trainer finishes the current accumulation window, saves model/last, "
                         "and exits; resume later with --train.resume.", id="confirm-text")
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
