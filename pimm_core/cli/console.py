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
    from ..run.layout import check_run_dir, was_started

    if run_dir.is_dir() and not was_started(run_dir):  # no status.json nor config.toml: a root of runs?
        from ..watch.runs import find_runs

        runs = find_runs(run_dir)
        if runs and runs != [run_dir]:
            return _run(run_dir, root=True)
        if not runs:
            raise UsageError(f"{run_dir} is neither a run directory nor a directory of runs (no config.toml, "
                             "status.json, metrics.jsonl or model/ in it or in the two levels below); pass "
                             "exp/<group>/<run>, a group such as exp/digits or a root such as exp")
    check_run_dir(run_dir)
    _run(run_dir, root=False)


def _run(path: Path, *, root: bool) -> None:
    from pimm_tui import build_app, build_runs_app  # Textual is imported here only

    console = build_runs_app(path) if root else build_app(path)
    console.run()
    if console.crash is not None or console.return_code:  # never exit 0 after an error in the console
        raise PimmError(console.crash_message())
