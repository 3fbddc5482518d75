"""Where pimm may write an output the user names, and how it replaces one (torch-free).

An output (an export directory, an exported weights file) goes to the path the user
named and nowhere else: its temporary and set-aside names are created fresh
(``mkstemp``-fresh beside it, a ``.<name>.pimm-*`` prefix only pimm uses), so no file
that happens to be called ``<out>.tmp`` or ``<out>.old`` is touched. It is never written
into a checkpoint or a run's ``model/`` directory, and replacing an existing directory
(``--force``) is allowed only for a previous export, recognised by its own files.

Each hidden directory comes with a held owner file (:mod:`.scratch`): what an export killed midway
left (``kill -9``, the OOM killer) is cleaned by the next export to the same output, and a previous
export it had set aside for ``--force`` goes back into place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from filelock import FileLock

from ...errors import UsageError
from ...faults import point, register
from ...fsio import fsync_dir
from ...run.layout import MODEL, is_run_dir
from .foreign import EXPORT_FILES
from .manifest import COMPLETE, MANIFEST
from .scratch import make_owned_dir, release, remove_stale

register("export.set_aside")

EXPORT_JSON = "export.json"
CONFIG_JSON = "config.json"  # an export's training config, or a library model's own config
#: The files an export directory holds (``export.json`` names it one).
EXPORT_DIR_FILES = (*EXPORT_FILES, CONFIG_JSON, EXPORT_JSON)
PIMM_CONFIG_JSON = "pimm_config.json"  # the training config beside a library model's own config.json
LIBRARY_FILES = ("config.json", "generation_config.json")
_CHECKPOINT_MARKS = (MANIFEST, COMPLETE, "trainer.dcp")


def _is_checkpoint_dir(d: Path) -> bool:
    return any(os.path.lexists(d / n) for n in _CHECKPOINT_MARKS)


def _is_model_dir(d: Path) -> bool:
    return d.name == MODEL and is_run_dir(d.parent)


def inside_checkpoints(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is in a place a run keeps checkpoints (a checkpoint directory, or a run's
    ``model/``), or ``None``. Symlinks are followed (their target is what a write changes)."""
    p = Path(os.path.realpath(path))
    for d in p.parents:
        if _is_checkpoint_dir(d):
            return f"it is inside the checkpoint {d}"
        if _is_model_dir(d):
            return f"it is in {d}, where a run keeps its checkpoints"
    return None


def is_previous_export(d: Path) -> bool:
    """True for a directory pimm's export wrote: ``export.json`` (with ``export_version``) and
    nothing but :data:`EXPORT_DIR_FILES` (``config.json``: the training config), the weight files it
    lists, ``pimm_config.json`` (the training config beside a library's ``config.json``) and, for
    a library's model, what its ``save_pretrained`` writes (:data:`LIBRARY_FILES`)."""
    try:
        names = {e.name for e in d.iterdir()}
        record = json.loads((d / EXPORT_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return is_export_listing(names, record)


def is_export_listing(names: set[str], record: object) -> bool:
    """True when a directory holding exactly ``names`` with ``record`` (its parsed ``export.json``)
    is a previous export (:func:`is_previous_export`; a remote one's listing too)."""
    if not (isinstance(record, dict) and "export_version" in record):
        return False
    files = record.get("files") if isinstance(record.get("files"), dict) else {}
    own = {*EXPORT_DIR_FILES, PIMM_CONFIG_JSON, *files}
    if record.get("library"):  # what the library's save_pretrained writes beside the weights
        own |= set(LIBRARY_FILES)
    return names <= own


def _what_it_holds(d: Path) -> str:
    if is_run_dir(d):
        return "it is a run directory"
    if _is_checkpoint_dir(d):
        return "it is a checkpoint"
    subdirs = [e for e in d.iterdir() if e.is_dir()]
    if any(_is_checkpoint_dir(e) for e in subdirs):
        return "it holds checkpoints"
    if any(is_run_dir(e) or any(is_run_dir(g) for g in e.iterdir() if g.is_dir()) for e in subdirs):
        return "it holds run directories"
    names = sorted(e.name for e in d.iterdir() if e.name not in EXPORT_DIR_FILES)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"it holds files an export does not write ({shown})" if names else "it has no export.json"


def check_output_dir(out_dir: str | os.PathLike[str], *, force: bool) -> Path:
    """Check that an export may be written to ``out_dir``; returns it as an absolute path.

    Raises:
        UsageError: (exit code 2) ``out_dir`` is a file or a link; it is inside a checkpoint
            or a run's ``model/``; it is the working directory or holds it; it exists and is
            not empty, without ``force``; with ``force``, it is not a previous export.
    """
    shown = os.fspath(out_dir)
    out = Path(os.path.abspath(out_dir))
    if out.parent.is_dir():
        remove_stale_temps(out)  # a killed export's leftovers first: a set-aside previous export is back
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UsageError(f"{shown} exists and is not a directory; choose a directory for the export")
    where = inside_checkpoints(out)
    if where is not None:
        raise UsageError(f"cannot export to {shown}: {where}; choose a directory outside the run's checkpoints")
    if not out.is_dir():
        return out
    cwd = Path(os.path.abspath(os.getcwd()))
    if out == cwd or out in cwd.parents:
        raise UsageError(f"cannot export to {shown}: it is the current directory or holds it, and an export "
                         "replaces its directory; choose another OUT_DIR")
    if not any(out.iterdir()):
        return out
    if not force:
        raise UsageError(f"{shown} already exists and is not empty; use --force to replace a previous export")
    if not is_previous_export(out):
        raise UsageError(f"--force replaces only a previous export, and {shown} is not one: {_what_it_holds(out)}; "
                         "choose another OUT_DIR, or move it away yourself")
    return out


def check_output_file(path: str | os.PathLike[str]) -> None:
    """Check that a weights file may be written to ``path`` (it replaces a file there).

    Raises:
        UsageError: (exit code 2) ``path`` is a directory, or it is inside a checkpoint or
            a run's ``model/`` (a file there is a checkpoint a resume or warm start reads).
    """
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{p} is a directory; name a file to write the weights to")
    where = inside_checkpoints(p)
    if where is not None:
        raise UsageError(f"will not write weights to {p}: {where}; choose a path outside the run's checkpoints")


def new_temp_dir(out: Path, role: str) -> tuple[Path, FileLock]:
    """A fresh empty directory beside ``out`` (``.<name>.pimm-<role>-XXXXXXXX.tmp``), its parents
    created, with its held owner file (``<that>.lock``, :mod:`.scratch`); returns both, for
    :func:`~.scratch.release`. Those a killed export left are cleaned first
    (:func:`remove_stale_temps`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    # (renamed into place as the user's output: the umask's permissions, as any directory they make)
    return make_owned_dir(f".{out.name}.pimm-{role}-", parent=out.parent, suffix=".tmp", mode=0o777)


def remove_stale_temps(out: Path) -> list[str]:
    """Clean what an export to ``out`` killed midway left beside it: its hidden directories
    (``.<name>.pimm-export-*.tmp``, ``.<name>.pimm-old-*.tmp``) whose owner process is gone
    (their owner file's lock is free: :mod:`.scratch`). A previous export set aside for a
    ``--force`` replacement that never came into place (``out`` is missing) is moved back to
    ``out``; the rest is removed. Returns the names dealt with. Never raises."""

    def settle(directory: Path) -> bool:
        if ".pimm-old-" not in directory.name or os.path.lexists(out):
            return False
        try:
            os.rename(directory, out)  # the previous export, back where it was
            fsync_dir(out.parent)
        except OSError:
            return False
        return True

    roles = tuple(f".{out.name}.pimm-{role}-" for role in ("export", "old"))
    return remove_stale(out.parent, roles, settle=settle)


def replace_dir(tmp: Path, out: Path) -> None:
    """Put directory ``tmp`` in place as ``out``; an existing ``out`` (checked by
    :func:`check_output_dir`) is set aside under a fresh owned name first and removed after (a
    kill in between: :func:`remove_stale_temps` moves it back).

    Raises:
        OSError: a rename failed (``out`` is put back when it had been set aside).
    """
    parent = out.parent
    aside = None
    if out.exists():
        aside = new_temp_dir(out, "old")
        os.rename(out, aside[0])  # over the fresh, empty directory
        fsync_dir(parent)
    try:
        point("export.set_aside")
        os.rename(tmp, out)
        fsync_dir(parent)
    except OSError:
        if aside is not None and not out.exists():
            os.rename(aside[0], out)
        raise
    finally:
        if aside is not None:
            release(*aside)  # (a directory moved back is no longer there to remove)
