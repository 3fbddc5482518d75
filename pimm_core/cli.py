"""The ``pimm`` command line (Typer).

Commands: ``launch`` (train), ``checkpoints ls|latest|verify`` (torch-free scripting).

Errors a person can fix print one line, ``error: <what> ...<how to fix>``, and exit
with 2 (usage, input) or 1 (an operation failed); never a traceback. Heavy modules
(torch) are imported inside the commands that need them, so the scripting commands
answer in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
import typer.core

from .errors import RANK_ERRORS_ENV, PimmError, UsageError, is_peer_loss, report
from .shell import command

class Command(typer.core.TyperCommand):
    """Usage lines in the usual style (``RUN_DIR``, ``[OVERRIDES]...``), not Typer's ``{run_dir}``."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, typer.core.TyperArgument):
                name = (param.metavar or param.name or "").upper()
                pieces.append((name if param.required else f"[{name}]") + ("..." if param.nargs != 1 else ""))
        return pieces


# Plain (click) help: flags without a <bool> placeholder, choices as [a|b], pipe-friendly.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="pimm: a PyTorch training engine that never loses a run.")
checkpoints_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                              help="Inspect checkpoints without importing torch.")
app.add_typer(checkpoints_app, name="checkpoints")
from .cli_export import register as _register_export
_register_export(app, Command)

_ARGV: list[str] = []


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"pimm {version('pimm')}")
        raise typer.Exit(0)


@app.callback()
def _main(_: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print pimm's version and exit.")) -> None:
    """pimm: a PyTorch training engine that never loses a run."""
NO_VERIFY_HELP = ("Skip the sha256 pass: pick by completeness only (faster on large checkpoints; "
                  "a resume still verifies and may pick another).")


@app.command(cls=Command, context_settings={"allow_interspersed_args": False})
def launch(
    config: Optional[Path] = typer.Option(None, "--train.config", help="TOML config file (required)."),
    name: Optional[str] = typer.Option(None, "--run.name", help="Run name (default: the config file's stem)."),
    no_timestamp: bool = typer.Option(False, "--run.no-timestamp", help="Do not add -YYYYmmdd-HHMMSS to the name."),
    root: Optional[str] = typer.Option(None, "--run.root", help="Root of run directories (default: exp)."),
    resume: bool = typer.Option(False, "--train.resume", help="Resume this run from its newest complete checkpoint."),
    auto_resume: bool = typer.Option(False, "--train.auto-resume",
                                     help="Resume if the run has an intact checkpoint, else start it fresh "
                                          "(the command a cluster job repeats on every requeue)."),
    resume_from: Optional[str] = typer.Option(None, "--train.resume-from",
                                              help="Resume from this checkpoint directory (implies --train.resume)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what a (resumed) launch would do, then exit."),
    weight: Optional[str] = typer.Option(None, "--train.weight",
                                         help="Warm start: load model weights (only) from this path or hf://org/repo."),
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", help="Ranks on this node (torchrun)."),
    nnodes: Optional[str] = typer.Option(None, "--nnodes", help="Nodes, or MIN:MAX (torchrun)."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="This node's rank (torchrun)."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous (torchrun)."),
    rdzv_backend: Optional[str] = typer.Option(None, "--rdzv-backend", help="Rendezvous backend, e.g. c10d (torchrun)."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Rank-0 host for static rendezvous (torchrun)."),
    master_port: Optional[int] = typer.Option(None, "--master-port", help="Rank-0 port for static rendezvous (torchrun)."),
    overrides: Optional[list[str]] = typer.Argument(None, help="Config overrides after --, e.g. -- train.epochs=3"),
) -> None:
    """Train a model from a config (one process, or many through torchrun)."""
    from .config import load_config
    from .launch import LaunchOptions, auto_resume as auto_resume_cfg, dry_run as plan_only, resolve_run_dir, spawn
    from .launch import strip_launcher_flags, train_here

    if config is None:
        raise UsageError("pimm launch needs --train.config FILE (e.g. --train.config configs/digits.toml); "
                         "to continue a run, use pimm resume RUN_DIR")
    extra: dict[str, object] = {}
    if name is not None:
        extra["run.name"] = name
    if no_timestamp:
        extra["run.no_timestamp"] = True
    if root is not None:
        extra["run.root"] = root
    if resume or resume_from:
        extra["train.resume"] = True
    if weight is not None:
        extra["train.weight"] = weight
    cfg = load_config(config, overrides or [], extra)
    opts = LaunchOptions(nproc_per_node, nnodes, node_rank, rdzv_endpoint, rdzv_backend, master_addr, master_port)
    opts.check()
    from .dist import under_launcher

    is_rank0 = not under_launcher() or os.environ.get("RANK", "0") == "0"
    if auto_resume and not (resume or resume_from):
        cfg = auto_resume_cfg(cfg, resolve_run_dir(cfg, config), is_main=is_rank0 and not dry_run)
    if dry_run:
        raise typer.Exit(plan_only(cfg, config, resume_from, opts.world_size()))
    if opts.wants_spawn() and not under_launcher():
        argv = strip_launcher_flags(_ARGV[_ARGV.index("launch") + 1:] if "launch" in _ARGV else [])
        if auto_resume:  # decided here, once, for every rank
            argv = [a for a in argv if a != "--train.auto-resume"]
            if cfg.train.resume:
                argv.insert(argv.index("--") if "--" in argv else len(argv), "--train.resume")
        raise typer.Exit(spawn(cfg, config, argv, opts))
    raise typer.Exit(train_here(cfg, config, resume_from, leftovers_ok=auto_resume))


@app.command(cls=Command, context_settings={"allow_interspersed_args": True})
def resume(
    run_dir: Path = typer.Argument(..., help="The run directory (exp/<group>/<run>)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what the resume would do, then exit."),
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node",
                                                 help="Ranks on this node (default: as the run was launched)."),
    nnodes: Optional[str] = typer.Option(None, "--nnodes", help="Nodes, or MIN:MAX (default: as recorded)."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="This node's rank (torchrun)."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous."),
    rdzv_backend: Optional[str] = typer.Option(None, "--rdzv-backend", help="Rendezvous backend, e.g. c10d."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Rank-0 host for static rendezvous."),
    master_port: Optional[int] = typer.Option(None, "--master-port", help="Rank-0 port for static rendezvous."),
    overrides: Optional[list[str]] = typer.Argument(None, help="Config changes after --, e.g. -- train.epochs=40"),
) -> None:
    """Resume a run from its own directory: its config.toml and recorded launch, plus explicit overrides."""
    from .dist import under_launcher
    from .launch import LaunchOptions, dry_run as plan_only, recorded_launch, resume_config, spawn, train_here

    cfg = resume_config(run_dir, overrides or [])
    config_path = run_dir / "config.toml"
    if under_launcher():  # a rank (of our own spawn below, or of the user's torchrun/srun)
        raise typer.Exit(train_here(cfg, config_path))
    given = LaunchOptions(nproc_per_node, nnodes, node_rank, rdzv_endpoint, rdzv_backend, master_addr, master_port)
    given.check()
    record = recorded_launch(run_dir)
    if record.get("launcher") == "external" and nproc_per_node is None:
        raise UsageError(f"{run_dir} was launched by an external launcher (torchrun/srun, world size "
                         f"{record.get('world_size')}); run `{command('resume', run_dir)}` under that launcher again, "
                         "or pass --nproc-per-node N to start the ranks here")
    opts = LaunchOptions.recorded(record, given)
    if dry_run:
        print(f"launch: {opts.describe()}")
        raise typer.Exit(plan_only(cfg, config_path, None, opts.world_size()))
    if opts.wants_spawn():
        worker_args = ["resume", str(run_dir), *(["--"] + list(overrides) if overrides else [])]
        raise typer.Exit(spawn(cfg, config_path, [], opts, worker_args=worker_args))
    raise typer.Exit(train_here(cfg, config_path))


@app.command(cls=Command)
def stop(
    run_dir: Path = typer.Argument(..., help="The run directory (exp/<group>/<run>)."),
    reason: str = typer.Option("operator", "--reason", help="Recorded as the run's stop_reason."),
) -> None:
    """Ask a live run to stop cleanly: it saves `last` at the next accumulation window and exits 0."""
    from .run import STATUS, read_json
    from .stop import write_stop_file

    if not run_dir.is_dir() or not ((run_dir / STATUS).exists() or (run_dir / "config.toml").exists()):
        raise UsageError(f"{run_dir} is not a run directory (no status.json or config.toml); pass exp/<group>/<run>")
    status = read_json(run_dir / STATUS) or {}
    state = status.get("state")
    if state in ("finished", "stopped", "failed"):
        raise PimmError(f"{run_dir} is not live (state {state}); nothing to stop")
    path = write_stop_file(run_dir, reason)
    print(f"stop requested ({reason}): wrote {path}; the run saves last and exits at its next step")


def _model_dir(path: Path) -> Path:
    """Accept a run directory or its model/ directory."""
    if not path.exists():
        raise UsageError(f"{path} does not exist; pass a run directory (exp/<group>/<run>) or its model/ directory")
    if not path.is_dir():
        raise UsageError(f"{path} is a file; pass a run directory (exp/<group>/<run>) or its model/ directory")
    return path / "model" if (path / "model").is_dir() else path


@checkpoints_app.command("latest", cls=Command)
def checkpoints_latest(
    model_dir: Path = typer.Argument(..., help="A run's model/ directory (or the run directory)."),
    explain: bool = typer.Option(False, "--explain", help="List every candidate, accepted or rejected, and why."),
    no_verify: bool = typer.Option(False, "--no-verify", help=NO_VERIFY_HELP),
) -> None:
    """Print the checkpoint a resume would load (exit 1 if there is none)."""
    from .checkpoint.selection import explain as explain_lines
    from .checkpoint.selection import select_resume

    chosen, cands = select_resume(_model_dir(model_dir), verify=not no_verify)
    if explain:
        for line in explain_lines(cands, chosen) or ["(no candidates)"]:
            print(line, file=sys.stderr)
    if chosen is None:
        raise PimmError(f"no complete checkpoint in {model_dir}; run `{command('checkpoints', 'ls', model_dir)}` "
                        "to see what is there")
    print(chosen.path)


@checkpoints_app.command("ls", cls=Command)
def checkpoints_ls(
    run_dir: Path = typer.Argument(..., help="A run directory (or its model/ directory)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (stable schema)."),
    no_verify: bool = typer.Option(False, "--no-verify", help=NO_VERIFY_HELP),
) -> None:
    """List every checkpoint candidate and leftover, and which one resume would pick."""
    from .checkpoint.selection import list_candidates, select_resume
    from .runview import run_markers

    model_dir = _model_dir(run_dir)
    if not (run_markers(run_dir) or (run_dir.name == "model" and run_markers(run_dir.parent))
            or list_candidates(model_dir)):
        raise UsageError(f"{run_dir} is not a run directory (no config.toml, status.json, metrics.jsonl or "
                         "model/) nor a model/ directory with checkpoints; pass exp/<group>/<run>")
    chosen, cands = select_resume(model_dir, verify=not no_verify)
    if as_json:
        rows = [{**c.to_json(), "selected": chosen is not None and c.path == chosen.path} for c in cands]
        print(json.dumps({"schema_version": 1, "model_dir": str(model_dir),
                          "selected": chosen.name if chosen else None, "candidates": rows}, indent=2))
        return
    from rich.console import Console

    console = Console()
    rows = []
    for c in cands:
        mark = "*" if chosen is not None and c.path == chosen.path else ""
        status = "complete" if c.complete else f"incomplete: {c.reason}"
        if c.verify_problems:
            status = f"corrupt: {'; '.join(c.verify_problems)}"
        rows.append((mark, c.name, c.format, _s(c.step), _s(c.epoch), _s(c.iter), _size(c.size), status))
    if console.width < 100:
        print(str(model_dir))
        for line in _narrow_table(rows, console.width):
            print(line)
    else:
        from rich.table import Table

        table = Table(title=str(model_dir))
        for col in ("", "name", "format", "step", "epoch", "iter", "size", "status"):
            # Names are never cut; a long status wraps in its column.
            table.add_column(col, no_wrap=col != "status", overflow="fold" if col == "status" else "ellipsis",
                             justify="right" if col in ("step", "epoch", "iter", "size") else "left")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    print(f"resume would select: {chosen.name if chosen else 'nothing (no complete candidate)'}")


@checkpoints_app.command("verify", cls=Command)
def checkpoints_verify(
    target: Path = typer.Argument(..., help="A run directory, model/ directory, or one candidate."),
) -> None:
    """Check sizes and sha256 of checkpoint files against their manifests (exit 1 on mismatch)."""
    from .checkpoint.manifest import verify_files
    from .checkpoint.selection import list_candidates

    if not target.exists():
        raise UsageError(f"{target} does not exist; pass a run directory or a checkpoint")
    if (target / "manifest.json").exists() or target.is_file():
        cands = [c for c in list_candidates(target.parent) if Path(c.path) == target]
    else:
        cands = [c for c in list_candidates(_model_dir(target)) if c.kind != "tmp"]
    if not cands:
        raise UsageError(f"no checkpoint found at {target}")
    bad = 0
    for c in cands:
        if c.manifest is None:
            print(f"{c.name}: cannot verify ({c.reason or 'no manifest'})")
            bad += 1
            continue
        root = Path(c.path) if Path(c.path).is_dir() else Path(c.path).parent
        problems = verify_files(root, c.manifest.get("files", {}))
        if not c.complete:
            problems.insert(0, c.reason or "incomplete")
        print(f"{c.name}: {'ok' if not problems else 'FAILED: ' + '; '.join(problems)}")
        bad += bool(problems)
    if bad:
        raise typer.Exit(1)


@checkpoints_app.command("diff", cls=Command)
def checkpoints_diff(
    run_dir: Path = typer.Argument(..., help="The run directory (exp/<group>/<run>)."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", help="Planned world size (ranks) of the resume."),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="Candidate name (default: resume's choice)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    overrides: Optional[list[str]] = typer.Argument(None, help="Planned config overrides after --, e.g. -- data.num_workers=2"),
) -> None:
    """What the checkpoint a resume would load recorded vs. the planned resume, and the policy that applies."""
    from .runview import resume_diff

    diff = resume_diff(run_dir, world_size=nproc_per_node, overrides=overrides or [], candidate=checkpoint)
    print(json.dumps(diff.to_json(), indent=2) if as_json else "\n".join(diff.lines()))


@app.command(cls=Command)
def tui(run_dir: Path = typer.Argument(..., help="The run directory (exp/<group>/<run>).")) -> None:
    """Operator console: watch a run live, stop it, browse checkpoints, diff topology, export."""
    from .runview import check_run_dir

    check_run_dir(run_dir)
    from pimm_tui import build_app  # Textual is imported here only

    console = build_app(run_dir)
    console.run()
    if console.crash is not None or console.return_code:  # never exit 0 after an error in the console
        raise PimmError(console.crash_message())


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


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pimm`` console script; returns the exit code."""
    global _ARGV
    _ARGV = list(sys.argv[1:] if argv is None else argv)
    try:
        # With standalone_mode=False Typer returns (not raises) the code of typer.Exit.
        rc = app(args=_ARGV, prog_name="pimm", standalone_mode=False)
    except PimmError as e:
        report(e)  # one line; a rank under `pimm launch --nproc-per-node` hands it to the launcher
        return e.exit_code
    except typer.Exit as e:
        return e.exit_code
    except typer.TyperException as e:  # Typer's usage errors (unknown option, bad value)
        print(f"error: {e.format_message()}; see `pimm --help`", file=sys.stderr)
        return 2
    except typer.Abort:
        print("error: aborted", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:
        # A rank under `pimm launch` whose peer died: the collective it was in fails here. Hand
        # the launcher a one-line note (it reports the rank that died) instead of a traceback.
        if os.environ.get(RANK_ERRORS_ENV) and is_peer_loss(e):
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            report(PimmError(f"lost contact with another rank ({first[:200]})"), secondary=True)
            return 1
        raise
    return rc if isinstance(rc, int) else 0


def run() -> None:
    """Console-script entry: :func:`main`, then exit ignoring further SIGINT/SIGTERM, so a
    repeated Ctrl-C after a clean stop cannot turn the exit (DataLoader worker shutdown)
    into a traceback or a signal exit code."""
    import signal

    code = main()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    run()
