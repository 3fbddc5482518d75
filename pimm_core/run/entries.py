"""The entries pimm writes in a run directory are its own: regular files and directories, never links (torch-free).

pimm appends to ``train.log`` and ``metrics.jsonl``, replaces ``status.json``,
``provenance.json``, ``config.toml`` and ``lock.json``, takes ``.lock`` and ``.ranks.lock``,
writes and removes ``control/stop``, keeps each rank's heartbeat in ``ranks/``, moves leftovers
to ``abandoned/``, writes TensorBoard events to ``tensorboard/`` and the ids of the MLflow and
W&B runs to ``mlflow.json`` and ``wandb.json`` (W&B's own files go to ``wandb/``). Any of them can
be something pimm did not put there: a symbolic link to a file outside the run (pimm's lines
would land in it, or a lock would truncate it), a link loop, a directory where a file goes or a
file where a directory goes. :func:`check_run_entries` refuses all of these, before anything is
written, with one line naming the path (:class:`RunEntryError`, exit 2); :func:`open_append`
opens a log without following a link even if one appears later. ``model/`` and the run
directory itself may be links (a checkpoint disk mounted elsewhere is a choice the user made).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import TextIO

from ..errors import UsageError
from .ranks import RANKS_DIR
from .layout import CONFIG, CONTROL, LOG, METRICS, PROVENANCE, STATUS, SUPERSEDED

LOCK = ".lock"
RANKS = ".ranks.lock"
HOLDER = "lock.json"
ABANDONED = "abandoned"
STOP_FILE = "stop"
#: The directory of the TensorBoard event files (``log.tensorboard``).
TENSORBOARD_DIR = "tensorboard"
#: The id of the tracked run the MLflow sink continues on resume (``[log.mlflow]``).
MLFLOW_ID = "mlflow.json"
#: The id of the W&B run the W&B sink continues on resume (``[log.wandb]``).
WANDB_ID = "wandb.json"
#: W&B's own files (``[log.wandb]`` without ``WANDB_DIR``), written by the ``wandb`` package.
WANDB_FILES = "wandb"

#: Entries of a run directory pimm writes, and what each must be when present.
RUN_ENTRIES: tuple[tuple[str, str], ...] = (
    (LOG, "file"), (METRICS, "file"), (SUPERSEDED, "file"), (STATUS, "file"), (PROVENANCE, "file"), (CONFIG, "file"), (HOLDER, "file"),
    (LOCK, "file"), (RANKS, "file"), (CONTROL, "dir"), (f"{CONTROL}/{STOP_FILE}", "file"), (ABANDONED, "dir"),
    (TENSORBOARD_DIR, "dir"), (MLFLOW_ID, "file"), (WANDB_ID, "file"), (WANDB_FILES, "dir"), (RANKS_DIR, "dir"),
)


class RunEntryError(UsageError):
    """A path pimm would write is a link, the wrong kind of entry, or in a directory pimm cannot
    write (exit code 2); the message names it and what to do."""


def check_entry(path: Path, kind: str) -> None:
    """Refuse ``path`` when it exists and is not a ``kind`` (``"file"``: a regular file, ``"dir"``: a
    directory) of its own: a symbolic link (even to the right kind, or a loop) is refused too.

    Raises:
        RunEntryError: names ``path`` and what it is.
    """
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise RunEntryError(f"{path.parent} is a file where pimm keeps a directory; move it away") from None
    except OSError as e:
        raise RunEntryError(f"cannot inspect {path} ({e.strerror}); pimm writes it") from None
    if stat.S_ISLNK(st.st_mode):
        raise RunEntryError(f"{path} is a symbolic link; pimm writes its run files only inside the run directory, "
                            "never through a link: remove the link (or move it away) and start again")
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise RunEntryError(f"{path} is {what}, where pimm writes a file; move it away and start again")
    if kind == "dir" and not stat.S_ISDIR(st.st_mode):
        raise RunEntryError(f"{path} is a file, where pimm keeps a directory; move it away and start again")


def check_run_entries(run_dir: Path) -> None:
    """:func:`check_entry` for each of :data:`RUN_ENTRIES` in ``run_dir`` (call before writing any).

    Raises:
        RunEntryError: the first entry that is a link or of the wrong kind.
    """
    for name, kind in RUN_ENTRIES:
        check_entry(Path(run_dir) / name, kind)


def writable_error(path: Path, e: OSError, *, hint: str = "choose another --run.root") -> RunEntryError:
    """The one-line error for an ``OSError`` writing in directory ``path`` (read-only, no permission)."""
    why = {errno.EROFS: "a read-only file system", errno.EACCES: "permission denied",
           errno.EPERM: "not permitted"}.get(e.errno, e.strerror or e.__class__.__name__)
    return RunEntryError(f"cannot write in {path} ({why}): make it writable or {hint}")


def ensure_dir(path: Path, *, hint: str = "choose another --run.root") -> Path:
    """``path`` as a directory of its own (created if missing, parents included), never a link.

    Args:
        hint: what the error for a directory that cannot be written suggests (:func:`writable_error`).

    Raises:
        RunEntryError: it is a link or a file, or it cannot be created (read-only, no permission).
    """
    path = Path(path)
    check_entry(path, "dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        check_entry(path, "dir")
        raise
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise writable_error(path.parent, e, hint=hint) from None
        raise
    return path


def open_append(path: Path) -> TextIO:
    """Open regular file ``path`` (created if missing) for appending text, line-buffered, UTF-8, without
    following a symbolic link (``O_NOFOLLOW``): pimm's lines never land in a file outside the run.

    Raises:
        RunEntryError: ``path`` is a link, a directory or another non-regular file, or its directory
            cannot be written.
        OSError: another failure to open it.
    """
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENOTDIR):
            check_entry(path, "file")
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise writable_error(path.parent, e) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RunEntryError(f"{path} is not a regular file, where pimm writes one; move it away and start again")
        return os.fdopen(fd, "a", encoding="utf-8", buffering=1)
    except BaseException:
        os.close(fd)
        raise
