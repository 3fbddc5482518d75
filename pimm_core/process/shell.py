"""Commands pimm prints for the user to run, spelled so that pasting them works.

Every "resume with: ..." or "to continue: ..." line goes through :func:`command`: the
program is named the way this process was started (``uv run pimm`` under ``uv run``,
``pimm`` when that is the script on ``PATH``, the script's absolute path when it is not,
else ``<python> -m pimm_core.cli``), and
every argument is shell-quoted with :func:`shlex.join`, so run names holding ``[``,
spaces or ``$`` paste safely into a POSIX shell. Torch-free.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from pathlib import Path


# Ranks started by `pimm launch --nproc-per-node` run `python -m pimm_core.cli`; the launcher
# hands them the words the user typed (JSON list) so that their printed commands match.
PROGRAM_ENV = "PIMM_PROGRAM"


def program() -> list[str]:
    """The words that start pimm the way this process (or its launcher) was started."""
    if os.environ.get(PROGRAM_ENV):
        try:
            return [str(w) for w in json.loads(os.environ[PROGRAM_ENV])]
        except (ValueError, TypeError):
            pass
    if os.environ.get("UV"):  # set by `uv run`: the user's shell may not have the venv on PATH
        return ["uv", "run", *_uv_project(), "pimm"]
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    found = shutil.which("pimm")
    if script is not None and script.name == "pimm":
        on_path = found is not None and Path(found).resolve() == script.resolve()
        return ["pimm"] if on_path else [str(script.resolve())]
    return [sys.executable, "-m", "pimm_core.cli"]


def _uv_project() -> list[str]:
    """``--project ROOT`` when the current directory is outside the project ``uv run`` used
    (its ``.venv``'s parent), so that the printed ``uv run pimm ...`` finds it from here."""
    venv = os.environ.get("VIRTUAL_ENV")
    if not venv:
        return []
    root = Path(venv).resolve().parent
    cwd = Path.cwd().resolve()
    if not (root / "pyproject.toml").is_file() or cwd == root or root in cwd.parents:
        return []
    return ["--project", str(root)]


def command(*args: str | Path) -> str:
    """``pimm ARGS`` as one shell-quoted line, e.g. ``command("resume", run_dir)``."""
    return shlex.join([*program(), *map(str, args)])


def resume_command(run_dir: Path | str) -> str:
    """The command that resumes ``run_dir`` with its recorded config and launch topology."""
    return command("resume", run_dir)
