"""``pimm tui``: the operator console (Textual is imported only when it runs)."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import PimmError, UsageError
from ._common import Command

app = typer.Typer()


@app.command(cls=Command)
def tui(run_dir: Path = typer.Argument(..., help="A run directory (exp/<group>/<run>), or a root or group "
                                      "(exp, exp/digits) to list its runs.")) -> None:
    """Operator console: watch a run live, stop it, browse checkpoints, diff topology, export.

    Given a root or a group, it opens on a live table of its runs (as `pimm runs ls` lists them):
    Enter opens a run, Escape comes back, s stops a live run, m marks, c compares marked runs.
    """
    _run(run_dir, root=opens_runs_table(run_dir))


def opens_runs_table(path: Path) -> bool:
    """True when ``pimm tui PATH`` opens the runs table: ``path`` has no ``status.json`` nor
    ``config.toml`` and holds run directories one or two levels below; False for a run directory.

    Raises:
        UsageError: ``path`` does not exist, is a file, or is neither a run directory nor holds runs.
    """
    from ..run.layout import check_run_dir, was_started

    if path.is_dir() and not was_started(path):
        from ..watch.runs import find_runs

        runs = find_runs(path)
        if runs and runs != [path]:
            return True
        if not runs:
            raise UsageError(f"{path} is neither a run directory nor a directory of runs (no config.toml, "
                             "status.json, metrics.jsonl or model/ in it or in the two levels below); pass "
                             "exp/<group>/<run>, a group such as exp/digits or a root such as exp")
    check_run_dir(path)
    return False


def _run(path: Path, *, root: bool) -> None:
    from pimm_tui import build_app, build_runs_app  # Textual is imported here only

    console = build_runs_app(path) if root else build_app(path)
    console.run()
    if console.crash is not None or console.return_code:  # never exit 0 after an error in the console
        raise PimmError(console.crash_message())
