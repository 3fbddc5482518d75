"""``pimm runs ls``: every run under a root at a glance, for people and scripts (torch-free)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import typer

from ..errors import PimmError, UsageError
from ..text import printable
from ._common import Command

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="List runs without importing torch.")

SORT_KEYS = ("name", "age", "state", "step", "best")


def _cell(v) -> str:
    return "-" if v is None else str(v)


@app.command("ls", cls=Command)
def runs_ls(
    root: Path = typer.Argument(Path("exp"), help="A run root (exp), a group (exp/digits) or one run directory."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (stable schema)."),
    state: Optional[list[str]] = typer.Option(None, "--state", help="Only runs in this state (repeatable): "
                                              "live, stopping, starting, stale, stopped, failed, finished, unknown."),
    sort: str = typer.Option("name", "--sort", help="Order: name, age (newest first), state, step, best."),
) -> None:
    """List the runs under ROOT: state, position, last loss, best metric, what a resume would load.

    Exit codes: 0 runs listed; 1 no run matched; 2 ROOT is not a directory or an option is invalid.
    """
    from ..watch.fmt import fmt_age, fmt_value
    from ..watch.runs import STATES, find_runs, sort_rows, summarize

    if not root.is_dir():
        raise UsageError(f"{root} is not a directory; pass a run root such as exp (the default run.root), "
                         "a group such as exp/digits, or a run directory")
    if sort not in SORT_KEYS:
        raise UsageError(f"--sort {sort!r} is not one of {', '.join(SORT_KEYS)}")
    bad = [s for s in state or [] if s not in STATES]
    if bad:
        raise UsageError(f"--state {bad[0]!r} is not one of {', '.join(STATES)}")
    rows = [summarize(p, root) for p in find_runs(root)]
    if state:
        rows = [r for r in rows if r.state in state]
    rows = sort_rows(rows, sort)
    if not rows and not as_json:
        raise PimmError(f"no run directories under {root}" + (" in the states asked" if state else ""))
    if as_json:
        print(json.dumps({"schema_version": 1, "root": str(root), "runs": [r.to_json() for r in rows]}, indent=2))
    else:
        table = [("RUN", "STATE", "STEP", "EPOCH", "LOSS", "BEST", "RESUME", "AGE", "HOST", "RANKS")]
        for r in rows:
            step = _cell(r.step) + (f"/{r.total_steps}" if r.total_steps is not None else "")
            epoch = _cell(r.epoch) + (f"/{r.epochs}" if r.epochs is not None else "")
            best = "-" if r.best is None else f"{r.best['metric']} {fmt_value(r.best['value'])}"
            resume = "-" if r.resume is None else f"{r.resume}@{_cell(r.resume_step)}"
            # names, hosts and notes are user text: never markup or terminal control
            table.append(tuple(printable(v) for v in (r.name, r.state, step, epoch, r.loss_text(), best, resume,
                                                      fmt_age(r.age_s), _cell(r.host), _cell(r.world_size))))
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        if sum(widths) + 2 * len(widths) > shutil.get_terminal_size((100, 24)).columns:
            widths[8] = 0  # a narrow terminal: the host column goes first
        for row in table:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths) if w).rstrip())
        for r in rows:
            if r.note:
                print(printable(f"{r.name}: {r.note}"))
    if not rows:
        raise PimmError(f"no run directories under {root}" + (" in the states asked" if state else ""))
