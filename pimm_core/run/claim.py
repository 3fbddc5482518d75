"""Creating a run directory: a free numbered name, and taking it back if the run never starts (torch-free)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from .entries import HOLDER, LOCK, RANKS, writable_error
from .layout import CONFIG, CONTROL, LOG, MODEL, STATUS
from .ranks import RANKS_DIR


def numbered(run_dir: Path, n: int) -> Path:
    """``run_dir`` itself for ``n == 1``, else ``<run_dir>-<n>`` (a second launch in the same second)."""
    return run_dir if n <= 1 else run_dir.with_name(f"{run_dir.name}-{n}")


def free_run_dir(run_dir: Path) -> Path:
    """The first of ``run_dir``, ``run_dir-2``, ``run_dir-3``... that does not exist (nothing is created)."""
    n = 1
    while numbered(run_dir, n).exists() or numbered(run_dir, n).is_symlink():
        n += 1
    return numbered(run_dir, n)


#: What a launch creates in a run directory before the trainer writes config.toml.
_UNSTARTED_FILES = (LOCK, RANKS, HOLDER, LOG, STATUS)


class RunDirClaim:
    """A run directory this launch made, to be removed again if the run never starts.

    Attributes:
        path: the run directory.
        created: this launch created it (it did not exist), else it was there already.
        made: the directories created for it, outermost first (missing parents included).
    """

    def __init__(self, path: Path, made: list[Path]):
        self.path = path
        self.made = made

    @property
    def created(self) -> bool:
        return bool(self.made) and self.made[-1] == self.path

    def discard_if_unstarted(self) -> bool:
        """Remove what the claim created when the run never started; True if removed.

        "Never started" means no ``config.toml`` was written (the trainer writes it once
        the model, the warm start and the resume source are in place) and the directory
        holds only what a launch creates before that: the lock files, ``train.log``, an
        empty ``model/`` or ``control/``, the ranks' heartbeat files (``ranks/``). Anything
        else is left where it is.
        """
        if not self.created or not self.path.is_dir() or (self.path / CONFIG).exists():
            return False
        for entry in self.path.iterdir():
            if entry.name in _UNSTARTED_FILES and entry.is_file() and not entry.is_symlink():
                continue
            if entry.name in (MODEL, CONTROL) and entry.is_dir() and not entry.is_symlink() and not any(entry.iterdir()):
                continue
            if entry.name == RANKS_DIR and entry.is_dir() and not entry.is_symlink() and all(
                    f.is_file() and not f.is_symlink() and f.name.lstrip(".").split(".")[0].isdigit()
                    for f in entry.iterdir()):
                continue  # only heartbeats (and their temporaries) of ranks that started
            return False
        shutil.rmtree(self.path, ignore_errors=True)
        for d in reversed(self.made[:-1]):
            try:
                d.rmdir()  # a parent this launch created, if nothing else has appeared in it since
            except OSError:
                break
        return not self.path.exists()


def _first_existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (the directory a failed ``mkdir`` could not write)."""
    for p in (path, *path.parents):
        if p.exists():
            return p
    return path


def claim_run_dir(run_dir: Path, *, numbered_names: bool) -> RunDirClaim:
    """Create the run directory (and missing parents); return the claim.

    Args:
        numbered_names: the name is timestamped and this process alone chooses it (one
            process, or the ``pimm launch --nproc-per-node`` launcher): a name that exists
            already (another launch in the same second) is passed over for ``<name>-2``,
            ``-3``... Each try is one ``mkdir``, which only one process can win, so two
            launches never share a directory. Without it an existing directory is used as
            it is (``--run.no-timestamp``, a resume, ranks told the name by their launcher).
    """
    run_dir = Path(run_dir)
    made = [p for p in reversed(run_dir.parents) if str(p) not in ("", ".") and not p.exists()]
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise writable_error(_first_existing(run_dir.parent), e) from None
        raise
    n = 1
    while True:
        cand = numbered(run_dir, n) if numbered_names else run_dir
        try:
            cand.mkdir()
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise writable_error(cand.parent, e) from None
            if not isinstance(e, FileExistsError):
                raise
            if not numbered_names:
                return RunDirClaim(cand, made)
            n += 1
            continue
        return RunDirClaim(cand, [*made, cand])
