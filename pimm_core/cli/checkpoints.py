"""``pimm checkpoints ls|latest|verify|diff``: inspect a run's checkpoints for scripts.

Torch-free (a test checks that these commands never import torch): the checkpoint
modules they use are imported inside each command.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import PimmError, UsageError
from ..process.shell import command
from ..text import printable
from ._common import Command

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Inspect checkpoints without importing torch.")

NO_VERIFY_HELP = ("Skip the sha256 pass: pick by completeness only (faster on large checkpoints; "
                  "a resume still verifies and may pick another).")


def _model_dir(path: Path) -> Path:
    """Accept a run directory or its model/ directory."""
    from ..run.layout import model_dir_of

    if not path.exists():
        raise UsageError(f"{path} does not exist; pass a run directory (exp/<group>/<run>) or its model/ directory")
    if not path.is_dir():
        raise UsageError(f"{path} is a file; pass a run directory (exp/<group>/<run>) or its model/ directory")
    return model_dir_of(path)


@app.command("latest", cls=Command)
def checkpoints_latest(
    model_dir: Path = typer.Argument(..., help="A run's model/ directory (or the run directory)."),
    explain: bool = typer.Option(False, "--explain", help="List every candidate, accepted or rejected, and why."),
    no_verify: bool = typer.Option(False, "--no-verify", help=NO_VERIFY_HELP),
) -> None:
    """Print the checkpoint a resume would load (exit 1 if there is none)."""
    from ..checkpoint.select.selection import explain as explain_lines
    from ..checkpoint.select.selection import select_resume

    chosen, cands = select_resume(_model_dir(model_dir), verify=not no_verify)
    if explain:
        for line in explain_lines(cands, chosen) or ["(no candidates)"]:
            print(printable(line), file=sys.stderr)
    if chosen is None:
        raise PimmError(f"no complete checkpoint in {model_dir}; run `{command('checkpoints', 'ls', model_dir)}` "
                        "to see what is there")
    print(chosen.path)


@app.command("ls", cls=Command)
def checkpoints_ls(
    run_dir: Path = typer.Argument(..., help="A run directory (or its model/ directory)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (stable schema)."),
    no_verify: bool = typer.Option(False, "--no-verify", help=NO_VERIFY_HELP),
) -> None:
    """List every checkpoint candidate and leftover, and which one resume would pick.

    With `checkpoint.memory_every_steps`, also the memory tier the ranks publish (memory/<rank>.json):
    each step held in shared memory, its age and bytes, which ranks hold it (own copy, a buddy's copy),
    and the newest step every rank reaches (under --json: "memory").
    """
    from ..checkpoint.select.selection import list_candidates, select_resume
    from ..run.layout import MODEL, is_run_dir
    from ..watch.fmt import fmt_size

    model_dir = _model_dir(run_dir)
    if not (is_run_dir(run_dir) or (run_dir.name == MODEL and is_run_dir(run_dir.parent))
            or list_candidates(model_dir)):
        raise UsageError(f"{run_dir} is not a run directory (no config.toml, status.json, metrics.jsonl or "
                         "model/) nor a model/ directory with checkpoints; pass exp/<group>/<run>")
    chosen, cands = select_resume(model_dir, verify=not no_verify)
    from ..checkpoint.remote.store import describe_remote

    last = next((c for c in cands if c.name == "last" and c.complete and c.format == "standard"), None)
    run = run_dir if is_run_dir(run_dir) and model_dir == run_dir else model_dir.parent  # (model/ may be gone)
    remote = describe_remote(run, last.step if last is not None else None, chosen)
    import time

    from ..watch.tiers import describe_memory, memory_lines

    memory = describe_memory(run, time.time())  # (None: no memory/ directory)
    if as_json:
        rows = [{**c.to_json(), "selected": chosen is not None and c.path == chosen.path} for c in cands]
        print(json.dumps({"schema_version": 1, "model_dir": str(model_dir),
                          "selected": chosen.name if chosen else None, "candidates": rows,
                          **({"remote": remote} if remote is not None else {}),
                          **({"memory": memory} if memory is not None else {})}, indent=2))
        return
    from rich.console import Console
    from rich.text import Text

    from ..text import plain_text

    console = Console()
    rows = []
    for c in cands:
        mark = "*" if chosen is not None and c.path == chosen.path else ""
        status = "complete" if c.complete else f"incomplete: {c.reason}"
        sel = (c.manifest or {}).get("selection_metric")
        if c.complete and c.kind == "best" and isinstance(sel, dict) and isinstance(sel.get("value"), (int, float)):
            status += f"; {sel.get('name')} {sel['value']:.4g}"  # the value model_best / keep_best ranked it by
        if c.verify_problems:
            status = f"corrupt: {'; '.join(c.verify_problems)}"
        # names and reasons are user text (a leftover can be named anything): never markup or control
        rows.append(tuple(printable(v) for v in (mark, c.name, c.format, _s(c.step), _s(c.epoch), _s(c.iter),
                                                 fmt_size(c.size), status)))
    if console.width < 100:
        print(printable(model_dir))
        for line in _narrow_table(rows, console.width):
            print(line)
    else:
        from rich.table import Table

        table = Table(title=plain_text(model_dir))
        for col in ("", "name", "format", "step", "epoch", "iter", "size", "status"):
            # Names are never cut; a long status wraps in its column.
            table.add_column(col, no_wrap=col != "status", overflow="fold" if col == "status" else "ellipsis",
                             justify="right" if col in ("step", "epoch", "iter", "size") else "left")
        for row in rows:
            table.add_row(*(Text(v) for v in row))  # a Text is never parsed as markup
        console.print(table)
    print(f"resume would select: {printable(chosen.name) if chosen else 'nothing (no complete candidate)'}")
    if remote is not None:
        _print_remote(remote)
    for line in memory_lines(memory) if memory is not None else ():
        print(printable(line))  # host names are what the ranks wrote: never terminal control


def _print_remote(remote: dict) -> None:
    """The run's ``checkpoint.remote`` candidates, one line each, and what is not there yet."""
    print(f"remote {printable(remote['url'])}:")
    if remote["error"]:
        print(f"  cannot be listed: {printable(remote['error'])}")
        return
    for c in remote["candidates"]:
        state = "complete" if c["complete"] else "incomplete (no marker: never selected)"
        print(f"  {printable(c['name'])}  step {_s(c['step'])}  {state}")
    if not remote["candidates"]:
        print("  no checkpoints yet")
    for what in remote["uploading"]:
        print(f"  not on the remote yet: {printable(what)}")
    if remote.get("resume"):
        print(f"  resume: {printable(remote['resume'])}")


@app.command("verify", cls=Command)
def checkpoints_verify(
    target: Path = typer.Argument(..., help="A run directory, model/ directory, or one candidate."),
) -> None:
    """Check sizes and sha256 of checkpoint files against their manifests (exit 1 on mismatch).

    Beside a live run each candidate is checked against the manifest of the generation its
    files belong to; one that saves kept replacing is reported as changed, never as corrupt
    (exit 75: try again).
    """
    from ..errors import CHANGED_EXIT_CODE

    cands, one = _verify_targets(target)
    failed = changed = 0
    for c in cands:
        line, verdict = _verify_one(c, named=one)
        print(printable(line))  # names and reasons are user text: never terminal control
        failed += verdict == "failed"
        changed += verdict == "changed"
    if failed:
        raise typer.Exit(1)
    if changed:
        raise typer.Exit(CHANGED_EXIT_CODE)


def _verify_targets(target: Path) -> tuple[list, bool]:
    """``(candidates, one)``: what ``verify TARGET`` checks, and whether TARGET names one candidate.

    ``last`` is absent for an instant in each rotation (between its two renames): a target
    that a rotation is replacing is waited for, and looked at again, never called missing.

    Raises:
        UsageError: TARGET does not exist (and no rotation is replacing it), or holds no checkpoint.
        GenerationChanged: saves kept replacing TARGET while it was looked at (exit 75).
    """
    from ..checkpoint.records.generation import READ_TRIES, GenerationChanged, changed_message, rotating, wait_for_rotation
    from ..checkpoint.select.selection import describe_entry, list_candidates
    from ..faults import point

    for _ in range(READ_TRIES):
        siblings = _siblings(target)
        wait_for_rotation(target)  # `last` between a save's two renames
        if not os.path.lexists(target):
            if rotating(target) and (_siblings(target) != siblings or _recently_changed(target.parent)):
                continue  # (a live rotation slower than the wait: once more)
            if rotating(target):  # nothing moved for a while: a rotation a crash interrupted
                raise UsageError(f"{target} does not exist: a save was interrupted between its two renames and "
                                 f"{target}.prev holds the newest complete checkpoint; verify that, or resume the "
                                 "run (its next save finishes the rotation)")
            raise UsageError(f"{target} does not exist; pass a run directory or a checkpoint")
        point("checkpoints.verify.located", target)  # (tests: a rotation lands here)
        one = (target / "manifest.json").exists() or target.is_file()
        if not one and not os.path.lexists(target):
            continue  # rotated away between the two looks: `one` is unknown
        if one:
            found = describe_entry(target)
            if found is None and not os.path.lexists(target):
                continue
            cands = [found] if found is not None and found.kind != "tmp" else []
        else:
            cands = [c for c in list_candidates(_model_dir(target)) if c.kind != "tmp"]
        if not cands:
            raise UsageError(f"no checkpoint found at {target}")
        return cands, one
    raise GenerationChanged(changed_message(str(target), READ_TRIES))


def _siblings(target: Path) -> tuple:
    """What ``<target>.prev`` and ``<target>.tmp`` hold now (a live rotation changes them)."""
    from ..checkpoint.records.generation import identity

    return tuple(identity(target.with_name(target.name + s)) for s in (".prev", ".tmp")) if target.name else ()


def _recently_changed(folder: Path, within_s: float = 30.0) -> bool:
    """Whether an entry of ``folder`` was renamed, added or removed in the last ``within_s`` seconds."""
    import time

    try:
        return time.time() - os.stat(folder).st_mtime < within_s
    except OSError:
        return False


def _verify_one(c, *, named: bool) -> tuple[str, str]:
    """``(line, verdict)`` for one candidate, checked on one generation (a changed one is read
    again); ``verdict`` is ``ok``, ``failed`` (damaged, incomplete or unverifiable) or
    ``changed`` (saves kept replacing it, or one removed the candidate named: no verdict)."""
    from ..checkpoint.records.generation import READ_TRIES, changed_message, wait_for_rotation
    from ..checkpoint.select.selection import describe_entry, verify_stable
    from ..faults import point

    path = Path(c.path)
    for _ in range(READ_TRIES):
        point("checkpoints.verify.described", path)  # (tests: a rotation lands here)
        if c.manifest is None and not _sidecar_arrived(c):
            if _identity_now(c):  # still this file, still no manifest: a verdict
                return f"{c.name}: cannot verify ({c.reason or 'no manifest'})", "failed"
            problems = None  # removed (retention) or replaced meanwhile: described again below
        else:
            problems = None if c.manifest is None else verify_stable(c)
        if problems is not None:
            if not c.complete:
                problems.insert(0, c.reason or "incomplete")
            return f"{c.name}: {'ok' if not problems else 'FAILED: ' + '; '.join(problems)}", \
                "failed" if problems else "ok"
        wait_for_rotation(path)
        fresh = describe_entry(path)  # the generation a save put there
        if fresh is None:
            return (f"{c.name}: removed by a save while it was checked (nothing left to verify)",
                    "changed" if named else "ok")
        c = fresh
    return f"{c.name}: {changed_message('it', READ_TRIES)}", "changed"


def _identity_now(c) -> bool:
    """Whether ``c.path`` still holds the generation ``c`` was described from."""
    from ..checkpoint.records.generation import identity

    return c.generation is None or identity(c.path) == c.generation


def _sidecar_arrived(c, recent_s: float = 2.0, wait_s: float = 1.0) -> bool:
    """For a file without its sidecar manifest that was replaced in the last ``recent_s``
    seconds (a save writes the sidecar just after the file): whether it changed within
    ``wait_s`` (the sidecar arrived, or the file was replaced again)."""
    import os
    import time

    from ..checkpoint.records.generation import identity

    try:
        if time.time() - os.stat(c.path).st_ctime > recent_s:
            return False
    except OSError:
        return True  # gone: described again by the caller
    deadline = time.monotonic() + wait_s
    while identity(c.path) == c.generation and time.monotonic() < deadline:
        time.sleep(0.01)
    return identity(c.path) != c.generation


@app.command("diff", cls=Command)
def checkpoints_diff(
    run_dir: Path = typer.Argument(..., help="The run directory (exp/<group>/<run>)."),
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", help="Planned world size (ranks) of the resume (default: as the run was launched)."),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="Candidate name (default: resume's choice)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    overrides: Optional[list[str]] = typer.Argument(None, help="Planned config overrides after --, e.g. -- data.num_workers=2"),
) -> None:
    """What the checkpoint a resume would load recorded vs. the planned resume, and the policy that applies."""
    from ..watch.resume_diff import resume_diff

    diff = resume_diff(run_dir, world_size=nproc_per_node, overrides=overrides or [], candidate=checkpoint)
    print(json.dumps(diff.to_json(), indent=2) if as_json else "\n".join(printable(line) for line in diff.lines()))


def _narrow_table(rows: list[tuple[str, ...]], width: int) -> list[str]:
    """``checkpoints ls`` for a terminal under 100 columns: plain aligned columns, names never
    cut, epoch and iter as one ``ep:iter`` column; the status follows on the row when it fits
    in one line, else on the lines below it, indented and wrapped at words."""
    import textwrap

    head = ("", "name", "format", "step", "ep:iter", "size")
    cells = [(m, n, f, st, f"{e}:{i}", sz) for m, n, f, st, e, i, sz, _ in rows]
    widths = [max(len(r[k]) for r in [head, *cells]) for k in range(len(head))]
    right = (False, False, False, True, False, True)

    def line(r: tuple[str, ...]) -> str:
        return " ".join(v.rjust(w) if rj else v.ljust(w) for v, w, rj in zip(r, widths, right))

    out = [line(head) + "  status"]
    indent = " " * (widths[0] + 5)
    for r, row in zip(cells, rows):
        text, status = line(r), row[-1]
        if len(text) + 2 + len(status) <= width:
            out.append(f"{text}  {status}")
        else:
            out.append(text.rstrip())
            out += textwrap.wrap(status, max(20, width - len(indent)), initial_indent=indent,
                                 subsequent_indent=indent, break_on_hyphens=False)
    return out


def _s(v: object) -> str:
    return "-" if v is None else str(v)
