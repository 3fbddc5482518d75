"""``provenance.json``: what the run was made from and one entry per start, stop or set-aside (torch-free).

The top level holds the run's base record (code and torch version, host, topology, data
fingerprint, Python); ``starts`` is a list of entries, each with its ``time`` and ``kind``
and, for a start, the ``launch`` that started it (:func:`launch_record`), which ``pimm
resume`` reads back (:func:`recorded_launch`) to start the same ranks.

The file is history pimm keeps: one that is not such a record (not JSON, truncated, a
list, ``starts`` not a list of objects) is never overwritten: the next start moves it
aside to ``provenance.json.corrupt-<n>``, warns once, and begins a new record. Readers
treat it as missing, and take each recorded value only when it has the right type.
"""

from __future__ import annotations

import functools
import json
import os
import logging
import subprocess
from pathlib import Path
from typing import Any

from ..fsio import keep_aside
from .values import json_int
from .jsonfile import write_json
from .layout import PROVENANCE

# `pimm launch --nproc-per-node/--nnodes` hands its launcher flags to the ranks in this
# variable (JSON); rank 0 records them in provenance.json so `pimm resume` can start the same ranks.
LAUNCH_ENV = "PIMM_LAUNCH"


def code_version(start: Path | None = None) -> str | None:
    """``git describe --always --dirty`` of the checkout holding pimm, or None outside git."""
    start = start or Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            cwd=start, capture_output=True, text=True, timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def user_code(modules: list[str]) -> list[dict[str, Any]]:
    """The version of each user module a run trains with (its model, data, objective...).

    Args:
        modules: module names (``"userpkg.nets"``); pimm's own, the standard library's and
            those not imported are left out, as are repeats.

    Returns:
        One ``{"module", "file", "git_commit", "dirty"}`` per module, in order; ``git_commit``
        (full sha of ``HEAD``) and ``dirty`` (uncommitted changes in that work tree) are
        None when the file is not in a git work tree. A module of an installed distribution
        (not an editable install) has ``distribution`` and ``version`` instead (from
        :func:`importlib.metadata.packages_distributions`), and no git commit: the
        environment may sit inside some checkout that has nothing to do with it.
    """
    import sys

    out: list[dict[str, Any]] = []
    for name in dict.fromkeys(modules):
        mod = sys.modules.get(name)
        file = getattr(mod, "__file__", None)
        if not file or name.split(".")[0] in ("pimm_core", "torch", "builtins") or name in sys.stdlib_module_names:
            continue
        path = Path(file).resolve()
        installed = _installed_distribution(name.split(".")[0], path)
        if installed is not None:  # an installed package: its version, not the git tree it may sit in
            out.append({"module": name, "file": str(path), "distribution": installed[0], "version": installed[1],
                        "git_commit": None, "dirty": None})
            continue
        where = path.parent
        commit = _git(["rev-parse", "HEAD"], where)
        status = _git(["status", "--porcelain", "--untracked-files=no"], where) if commit else None
        out.append({"module": name, "file": str(path), "git_commit": commit, "dirty": bool(status) if commit else None})
    return out


def _installed_distribution(top: str, file: Path) -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed distribution whose files hold ``file`` (a
    module of top-level package ``top``), or None: not from a distribution, or an editable
    install (its files live in their own work tree, whose git commit says more)."""
    from importlib import metadata

    if not _may_be_installed(file):
        return None  # (without reading every distribution's file list: ~0.4 CPU-s, 1-2 s on a cold disk)
    for dist_name in _packages_distributions().get(top, ()):
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            continue
        root = Path(str(dist.locate_file(""))).resolve()
        if file.is_relative_to(root):
            return dist.metadata["Name"] or dist_name, dist.version
    return None


def _may_be_installed(file: Path) -> bool:
    """False when no installed distribution can hold ``file``: importlib.metadata finds distributions
    only as ``*.dist-info``/``*.egg-info`` in the entries of ``sys.path``, and a distribution's files
    lie under the entry that holds it, so one of ``file``'s ancestors on ``sys.path`` must hold such
    metadata (or be a zip file, whose listing is not read here: True)."""
    import sys

    for entry in sys.path:
        root = Path(entry or ".").resolve()
        if not file.is_relative_to(root):
            continue
        try:
            if any(name.endswith((".dist-info", ".egg-info")) for name in os.listdir(root)):
                return True
        except NotADirectoryError:
            return True
        except OSError:
            continue
    return False


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    from importlib import metadata

    return metadata.packages_distributions()


@functools.cache
def current_code_version() -> str | None:
    """:func:`code_version` of the pimm checkout, asked once per process (a watcher asks often)."""
    return code_version()


def launch_record(world_size: int) -> dict[str, Any]:
    """How this process's run was launched: ``pimm launch``'s flags, or an external launcher's shape.

    Returns:
        ``{"launcher": "pimm", "nproc_per_node": N, ...multi-node flags}`` under ``pimm launch``
        (one process: ``nproc_per_node`` 1), or ``{"launcher": "external", "world_size": W,
        "nproc_per_node": LOCAL_WORLD_SIZE}`` under torchrun/srun started by the user.
    """
    raw = os.environ.get(LAUNCH_ENV)
    if raw:
        try:
            return dict(json.loads(raw))
        except (ValueError, TypeError):
            pass
    if world_size > 1:
        local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or world_size
        return {"launcher": "external", "world_size": world_size, "nproc_per_node": int(str(local).split("(")[0])}
    return {"launcher": "pimm", "nproc_per_node": 1}


#: The Slurm variables a start's provenance entry records (``scheduler``), by key.
SLURM_VARS = {"job_id": "SLURM_JOB_ID", "restart_count": "SLURM_RESTART_COUNT", "array_job_id": "SLURM_ARRAY_JOB_ID",
              "array_task_id": "SLURM_ARRAY_TASK_ID", "end_time": "SLURM_JOB_END_TIME"}


def scheduler_record() -> dict[str, Any] | None:
    """The scheduler job this process runs in, from its environment: ``{"name": "slurm",
    "job_id": "123", "restart_count": 1, ...}`` (``restart_count`` 0 for a first start, an
    int; the others as Slurm writes them; unset ones left out), or None outside Slurm."""
    if not os.environ.get("SLURM_JOB_ID"):
        return None
    out: dict[str, Any] = {"name": "slurm"}
    for key, var in SLURM_VARS.items():
        if os.environ.get(var):
            out[key] = os.environ[var]
    try:
        out["restart_count"] = int(out.get("restart_count", 0))
    except ValueError:
        pass  # kept as Slurm wrote it
    return out


def read_provenance(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``provenance.json`` object, or None when it is missing or not a provenance
    record (:func:`provenance_problem`)."""
    data, problem = _load(Path(run_dir) / PROVENANCE)
    return None if problem else data


def provenance_problem(data: Any) -> str | None:
    """What makes parsed ``data`` not a provenance record, or None: not an object, or
    ``starts`` not a list of objects."""
    if not isinstance(data, dict):
        return f"is a JSON {type(data).__name__}, not an object"
    starts = data.get("starts", [])
    if not isinstance(starts, list) or not all(isinstance(e, dict) for e in starts):
        return '"starts" is not a list of objects'
    return None


def _load(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(record, None)``, ``(None, None)`` when missing, or ``(None, problem)``."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        return None, f"is not JSON ({e.__class__.__name__}: {str(e)[:80]})"
    problem = provenance_problem(data)
    return (None, problem) if problem else (data, None)


def recorded_launch(run_dir: Path) -> dict[str, Any]:
    """The launch of the run's latest start (``provenance.json``): ``launcher`` (``pimm`` or
    ``external``), ``nproc_per_node`` and the multi-node flags ``pimm launch`` was given."""
    prov = read_provenance(run_dir) or {}
    for entry in reversed(prov.get("starts") or []):
        if isinstance(entry.get("launch"), dict):
            return _launch_values(entry["launch"])
    # runs written before pimm recorded the launch: one node with the recorded world size
    return {"launcher": "pimm", "nproc_per_node": max(1, json_int(prov.get("world_size")) or 1)}


def _launch_values(record: dict[str, Any]) -> dict[str, Any]:
    """A recorded launch with the values of the wrong type dropped (a hand-edited file):
    counts are positive ints, the rest strings (``nnodes`` may be ``"MIN:MAX"``)."""
    out: dict[str, Any] = {}
    for key, v in record.items():
        if key in ("nproc_per_node", "world_size", "node_rank", "master_port", "max_restarts"):
            n = v if type(v) is int else None
            if n is not None and (n >= 1 or key == "node_rank" and n >= 0):
                out[key] = n
        elif key == "nnodes" and type(v) is int and v >= 1:
            out[key] = v
        elif isinstance(v, str) or isinstance(v, bool) or v is None:
            out[key] = v
    return out


def recorded_search_path(run_dir: Path) -> list[str]:
    """The directories the run's starts imported user code from (``code_search_path`` of each
    start in ``provenance.json``, in order, without repeats): ``pimm resume``, which reads the
    config from the run directory, searches them too."""
    prov = read_provenance(run_dir) or {}
    dirs: list[str] = []
    for entry in prov.get("starts") or []:
        paths = entry.get("code_search_path")
        for d in paths if isinstance(paths, list) else []:
            if isinstance(d, str) and d not in dirs:
                dirs.append(d)
    return dirs


def recorded_world_size(record: dict[str, Any]) -> int:
    """Ranks in all of a recorded launch (the largest node count for ``MIN:MAX``)."""
    if type(record.get("world_size")) is int and record["world_size"] >= 1:
        return record["world_size"]
    nodes = str(record.get("nnodes") or "1").split(":")[-1]
    per_node = record.get("nproc_per_node")
    return (per_node if type(per_node) is int and per_node >= 1 else 1) * (int(nodes) if nodes.isdigit() else 1)


def append_provenance(run_dir: Path, base: dict[str, Any], entry: dict[str, Any]) -> None:
    """Merge ``base`` into ``provenance.json`` and append ``entry`` to its ``starts`` list (fsynced).

    A ``provenance.json`` that is not a provenance record is first moved aside to
    ``provenance.json.corrupt-<n>`` (with a warning naming both), and a new record begun.

    Raises:
        OSError: the write failed (the old file is untouched).
    """
    path = Path(run_dir) / PROVENANCE
    data, problem = _load(path)
    if problem:
        kept = keep_aside(path)
        logging.getLogger("pimm").warning("warning: %s %s; kept it as %s and started a new record", path, problem,
                                          kept.name)
    data = data or {}
    data.update(base)
    data.setdefault("starts", []).append(entry)
    write_json(Path(run_dir) / PROVENANCE, data, indent=2)
