"""Where pimm may write an output the user names, and how it replaces one (torch-free).

An output (an export directory, an exported weights file) goes to the path the user
named and nowhere else: its temporary and set-aside names are created fresh
(``tempfile.mkdtemp`` beside it, a ``.<name>.pimm-*`` prefix only pimm uses), so no file
that happens to be called ``<out>.tmp`` or ``<out>.old`` is touched. It is never written
into a checkpoint or a run's ``model/`` directory, and replacing an existing directory
(``--force``) is allowed only for a previous export, recognised by its own files.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ...errors import UsageError
from ...fsio import fsync_dir, remove_tree
from ...run.layout import MODEL, is_run_dir
from .foreign import EXPORT_FILES
from .manifest import COMPLETE, MANIFEST

EXPORT_JSON = "export.json"
CONFIG_JSON = "config.json"
#: The files an export directory holds (``export.json`` names it one).
EXPORT_DIR_FILES = (*EXPORT_FILES, CONFIG_JSON, EXPORT_JSON)
PIMM_CONFIG_JSON = "pimm_config.json"  # the run's config in an export (config.json: the model's own)
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
    nothing but :data:`EXPORT_DIR_FILES`, the weight files it lists, ``pimm_config.json`` and, for
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


def new_temp_dir(out: Path, role: str) -> Path:
    """A fresh empty directory beside ``out`` (``.<name>.pimm-<role>-XXXXXXXX.tmp``), its
    parents created; a ``*.tmp`` name, so a crash leftover is recognisable."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.pimm-{role}-", suffix=".tmp", dir=out.parent))


def replace_dir(tmp: Path, out: Path) -> None:
    """Put directory ``tmp`` in place as ``out``; an existing ``out`` (checked by
    :func:`check_output_dir`) is set aside under a fresh name first and removed after.

    Raises:
        OSError: a rename failed (``out`` is put back when it had been set aside).
    """
    parent = out.parent
    aside = None
    if out.exists():
        aside = new_temp_dir(out, "old")
        os.rename(out, aside)  # over the fresh, empty directory
        fsync_dir(parent)
    try:
        os.rename(tmp, out)
    except OSError:
        if aside is not None and not out.exists():
            os.rename(aside, out)
        raise
    fsync_dir(parent)
    if aside is not None:
        remove_tree(aside)
