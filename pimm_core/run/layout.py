"""Where a run's files are and what counts as a run directory (torch-free).

Layout (``exp/<group>/<name>/``)::

    config.toml       resolved config (tomli-w), written once the run is set up
    provenance.json   code/torch version, host, topology, data fingerprint, one entry per start
    metrics.jsonl     append-only, one JSON object per logged step / evaluation
    status.json       atomically replaced heartbeat (state, step, epoch, pids, stop_reason)
    train.log         the rank-0 log
    ranks/<rank>.json each rank's heartbeat: step, phase, time of its last progress (run/ranks.py)
    control/          requests to the trainer (control/stop)
    model/            checkpoints

"Is this a run directory" has three meanings, each with its own name here:

- :func:`is_run_dir` / :func:`check_run_dir`: something of a run is there (any of
  :data:`RUN_MARKERS`): what a watcher (console, ``checkpoints ls``/``diff``) accepts.
- :func:`was_started`: a trainer has started there (``config.toml`` or ``status.json``):
  what ``pimm stop`` accepts.
- :func:`find_run_dir`: the nearest directory at or above a path that holds
  ``config.toml`` (a run pimm launched, whose config can be read back).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..errors import UsageError

CONFIG = "config.toml"
PROVENANCE = "provenance.json"
METRICS = "metrics.jsonl"
#: The records of ``metrics.jsonl`` a resume replaced (:func:`~.metrics.supersede_after`), kept aside.
SUPERSEDED = "metrics.superseded.jsonl"
STATUS = "status.json"
LOG = "train.log"
MODEL = "model"
CONTROL = "control"

#: A directory is a run directory when it holds at least one of these.
RUN_MARKERS = (CONFIG, STATUS, METRICS, MODEL)


#: The longest file name (bytes) Linux file systems take (``NAME_MAX``).
NAME_MAX = 255
#: What ``run_name`` and ``claim_run_dir`` may add to a name: ``-YYYYmmdd-HHMMSS-NNN``.
NAME_SUFFIX_MAX = 20


def name_problem(name: str, *, suffix: int = 0) -> str | None:
    """Why ``name`` cannot be one path component of a run directory (a run name or group), or None.

    Valid: a non-empty name that is not ``.`` or ``..``, holds no ``/``, no NUL and no other
    control character, and fits in :data:`NAME_MAX` bytes (UTF-8) with ``suffix`` bytes added
    (the timestamp pimm appends).
    """
    if not name:
        return "is empty"
    if name in (".", ".."):
        return f"is {name!r}, which names a directory that already exists, not a new one"
    if "/" in name:
        return "holds '/': a name is one directory name, not a path"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "holds a control character (NUL, newline, escape ...)"
    size = len(name.encode("utf-8", "surrogateescape")) + suffix
    if size > NAME_MAX:
        extra = f" with the {suffix}-byte timestamp pimm adds" if suffix else ""
        return f"is {size} bytes long{extra}; file names take at most {NAME_MAX}"
    return None


def run_name(base: str, *, timestamp: bool, when: float | None = None) -> str:
    """``base`` plus a ``-YYYYmmdd-HHMMSS`` local-time suffix unless ``timestamp`` is False.

    Two launches in the same second get ``<base>-<stamp>`` and ``<base>-<stamp>-2`` (see
    :func:`pimm_core.run.claim.claim_run_dir`)."""
    if not timestamp:
        return base
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(when))}"


def run_dir_for(root: str | Path, group: str, name: str) -> Path:
    """``<root>/<group>/<name>``."""
    return Path(root) / group / name


def model_dir_of(path: Path) -> Path:
    """``path/model`` when ``path`` is a run directory with one, else ``path`` itself (a model/ directory)."""
    path = Path(path)
    return path / MODEL if (path / MODEL).is_dir() else path


def run_markers(path: Path) -> list[str]:
    """The :data:`RUN_MARKERS` present in ``path``."""
    p = Path(path)
    return [m for m in RUN_MARKERS if (p / m).exists()]


def is_run_dir(path: Path) -> bool:
    """True when ``path`` is a directory holding config.toml, status.json, metrics.jsonl or model/."""
    p = os.fspath(path)  # (strings, and the first marker found: `pimm runs ls` asks this of every directory)
    return os.path.isdir(p) and any(os.path.exists(os.path.join(p, m)) for m in RUN_MARKERS)


def check_run_dir(path: Path) -> Path:
    """``path`` if it is a run directory (:func:`is_run_dir`).

    Raises:
        UsageError: it does not exist, is not a directory, or has none of :data:`RUN_MARKERS`.
    """
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p} does not exist; pass a run directory such as exp/<group>/<run>")
    if not p.is_dir():
        raise UsageError(f"{p} is a file, not a run directory; pass exp/<group>/<run>")
    if not run_markers(p):
        raise UsageError(f"{p} is not a run directory (no config.toml, status.json, metrics.jsonl or model/); "
                         "pass exp/<group>/<run>")
    return p


def was_started(path: Path) -> bool:
    """A trainer has started in directory ``path``: it holds ``config.toml`` or ``status.json``."""
    p = Path(path)
    return p.is_dir() and ((p / STATUS).exists() or (p / CONFIG).exists())


def find_run_dir(path: Path) -> Path | None:
    """The nearest directory at or above ``path`` that holds ``config.toml`` (a run directory)."""
    p = Path(path).absolute()
    for d in (p, *p.parents) if p.is_dir() else p.parents:
        if (d / CONFIG).is_file():
            return d
    return None
