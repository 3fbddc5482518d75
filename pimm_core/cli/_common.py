"""What every command module of the CLI shares (kept apart from the package's ``__init__``,
which imports the command modules: no import cycle)."""

from __future__ import annotations

import typer
import typer.core

#: This process's command line, set by :func:`pimm_core.cli.main` (``launch`` hands it on to
#: the ranks it spawns). One list, filled in place, so that every importer sees it.
ARGV: list[str] = []


class Command(typer.core.TyperCommand):
    """Usage lines in the usual style (``RUN_DIR``, ``[OVERRIDES]...``), not Typer's ``{run_dir}``."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, typer.core.TyperArgument):
                name = (param.metavar or param.name or "").upper()
                pieces.append((name if param.required else f"[{name}]") + ("..." if param.nargs != 1 else ""))
        return pieces
