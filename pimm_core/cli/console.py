"""``pimm tui``: the operator console (Textual is imported only when it runs)."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import PimmError
from ._common import Command

app = typer.Typer()


@app.command(cls=Command)
def tui(run_dir: Path = typer.Argument(..., help="The run directory (exp/<group>/<run>).")) -> None:
    """Operator console: watch a run live, stop it, browse checkpoints, diff topology, export."""
    from ..run.layout import check_run_dir

    check_run_dir(run_dir)
    from pimm_tui import build_app  # Textual is imported here only

    console = build_app(run_dir)
    console.run()
    if console.crash is not None or console.return_code:  # never exit 0 after an error in the console
        raise PimmError(console.crash_message())
