"""The ``pimm`` command line (Typer).

Commands: ``launch`` (train), ``checkpoints ls|latest|verify`` and ``runs ls`` (torch-free scripting).

Errors a person can fix print one line, ``error: <what> ...<how to fix>``, and exit
with 2 (usage, input) or 1 (an operation failed); never a traceback. Heavy modules
(torch) are imported inside the commands that need them, so the scripting commands
answer in a fraction of a second.

One module per command group, each a Typer sub-app joined to the root app here with
``add_typer``: :mod:`.train` (``launch``, ``resume``, ``stop``), :mod:`.checkpoints`
(``checkpoints ls|latest|verify|diff``, torch-free), :mod:`.runs` (``runs ls``, torch-free), :mod:`.export` (``export``) and
:mod:`.console` (``tui``). This module holds the root app and the entry points :func:`main` and
:func:`run`; what the command modules share (``Command``: plain help and
usage lines; ``ARGV``) is in :mod:`._common`, so that they never import this package.
"""

from __future__ import annotations

import errno
import os
import sys

import typer
import typer.core

from ..errors import RANK_ERRORS_ENV, PimmError, is_peer_loss, report, restarts_left
from ._common import ARGV

# Plain (click) help: flags without a <bool> placeholder, choices as [a|b], pipe-friendly.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="pimm: a PyTorch training engine that never loses a run.")

# The command groups. Unnamed sub-apps add their commands to the root; the order here is the
# order of `pimm --help`.
from . import checkpoints, config_cmd, console, export, runs, train  # noqa: E402

app.add_typer(export.app)
app.add_typer(train.app)
app.add_typer(console.app)
app.add_typer(checkpoints.app, name="checkpoints")
app.add_typer(runs.app, name="runs")
app.add_typer(config_cmd.app, name="config")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"pimm {version('pimm')}")
        raise typer.Exit(0)


@app.callback()
def _main(_: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print pimm's version and exit.")) -> None:
    """pimm: a PyTorch training engine that never loses a run."""


#: Errors of the disk itself (full, over quota, failing): one line, not a traceback.
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO)


def _trains(argv: list[str]) -> bool:
    """``argv`` is a ``launch`` or ``resume`` that trains (not ``--dry-run``, not ``--help``)."""
    flags = argv[:argv.index("--")] if "--" in argv else argv
    return bool(argv) and argv[0] in ("launch", "resume") and not {"--dry-run", "--help"} & set(flags)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pimm`` console script; returns the exit code."""
    import contextlib

    from ..process.stop import stop_signals

    ARGV[:] = sys.argv[1:] if argv is None else argv
    try:
        # A command that trains catches the stop signals from here on: a stop asked during
        # start-up is kept and honoured (pimm_core.process.stop).
        with stop_signals() if _trains(ARGV) else contextlib.nullcontext():
            # With standalone_mode=False Typer returns (not raises) the code of typer.Exit.
            rc = app(args=ARGV, prog_name="pimm", standalone_mode=False)
    except PimmError as e:
        report(e)  # one line; a rank under `pimm launch --nproc-per-node` hands it to the launcher
        return e.exit_code
    except typer.Exit as e:
        return e.exit_code
    except typer.TyperException as e:  # Typer's usage errors (unknown option, bad value)
        ctx = getattr(e, "ctx", None)  # click's UsageError knows the sub-command it came from
        where = ctx.command_path if ctx is not None and ctx.command_path else "pimm"
        print(f"error: {e.format_message()}; see `{where} --help`", file=sys.stderr)
        return 2
    except typer.Abort:
        print("error: aborted", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno not in _DISK_ERRNOS:
            raise
        # A full or failing disk outside a save (which reports its own failure): one line.
        where = f" writing {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or e}{where}; free space (or fix the device) and run the command again; "
              "checkpoints already published are intact", file=sys.stderr)
        return 1
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
    """Console-script entry: :func:`main`, then exit ignoring further stop signals (SIGINT/SIGTERM/
    SIGHUP and ``train.stop_signals``), so a repeated Ctrl-C (or a scheduler's second SIGUSR1) after
    a clean stop cannot turn the exit (DataLoader worker shutdown) into a traceback or a signal exit code."""
    import signal

    from ..process.stop import caught_signals

    try:
        code = main()
    except Exception:
        if not restarts_left():
            raise
        import traceback

        traceback.print_exc()  # (what the interpreter would print), then the prompt exit below
        code = 1
    for sig in caught_signals():
        signal.signal(sig, signal.SIG_IGN)
    if code and restarts_left():
        # a failed rank that torchrun's agent restarts (pimm launch --max-restarts): its state is in the
        # memory tier and on disk, its report and status written; the interpreter's teardown (collecting
        # the trainer's objects, joining gloo's threads) would only delay the new ranks' start
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
