"""The run directory: naming, layout, and the small files a run keeps up to date.

Layout (``exp/<group>/<name>/``)::

    config.toml       resolved config (tomli-w)
    provenance.json   code/torch version, host, topology, data fingerprint, one entry per start
    metrics.jsonl     append-only, one JSON object per logged step / evaluation
    status.json       atomically replaced heartbeat (state, step, epoch, pids, stop_reason)
    train.log         the rank-0 log
    control/          requests to the trainer (control/stop)
    model/            checkpoints

Everything here is torch-free so readers (CLI, console) stay fast. Only rank 0 writes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .fsio import atomic_write_bytes

CONFIG = "config.toml"
PROVENANCE = "provenance.json"
METRICS = "metrics.jsonl"
STATUS = "status.json"
LOG = "train.log"
MODEL = "model"
CONTROL = "control"

STATES = ("starting", "running", "stopping", "stopped", "finished", "failed")


def now_iso() -> str:
    """Current UTC time, ISO 8601 with offset (e.g. ``2026-11-29T12:00:00+00:00``)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_name(base: str, *, timestamp: bool, when: float | None = None) -> str:
    """``base`` plus a ``-YYYYmmdd-HHMMSS`` local-time suffix unless ``timestamp`` is False.

    Two launches in the same second get ``<base>-<stamp>`` and ``<base>-<stamp>-2`` (see
    :func:`claim_run_dir`)."""
    if not timestamp:
        return base
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(when))}"


def run_dir_for(root: str | Path, group: str, name: str) -> Path:
    """``<root>/<group>/<name>``."""
    return Path(root) / group / name


def numbered(run_dir: Path, n: int) -> Path:
    """``run_dir`` itself for ``n == 1``, else ``<run_dir>-<n>`` (a second launch in the same second)."""
    return run_dir if n <= 1 else run_dir.with_name(f"{run_dir.name}-{n}")


def free_run_dir(run_dir: Path) -> Path:
    """The first of ``run_dir``, ``run_dir-2``, ``run_dir-3``... that does not exist (nothing is created)."""
    n = 1
    while numbered(run_dir, n).exists() or numbered(run_dir, n).is_symlink():
        n += 1
    return numbered(run_dir, n)


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
        empty ``model/`` or ``control/``. Anything else is left where it is.
        """
        if not self.created or not self.path.is_dir() or (self.path / CONFIG).exists():
            return False
        for entry in self.path.iterdir():
            if entry.name in _UNSTARTED_FILES and entry.is_file() and not entry.is_symlink():
                continue
            if entry.name in (MODEL, CONTROL) and entry.is_dir() and not entry.is_symlink() and not any(entry.iterdir()):
                continue
            return False
        import shutil

        shutil.rmtree(self.path, ignore_errors=True)
        for d in reversed(self.made[:-1]):
            try:
                d.rmdir()  # a parent this launch created, if nothing else has appeared in it since
            except OSError:
                break
        return not self.path.exists()


_UNSTARTED_FILES = (".lock", ".ranks.lock", "lock.json", LOG, STATUS)


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
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        cand = numbered(run_dir, n) if numbered_names else run_dir
        try:
            cand.mkdir()
        except FileExistsError:
            if not numbered_names:
                return RunDirClaim(cand, made)
            n += 1
            continue
        return RunDirClaim(cand, [*made, cand])


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


def write_status(run_dir: Path, state: str, **fields: Any) -> None:
    """Atomically replace ``status.json``.

    Args:
        state: one of :data:`STATES`.
        fields: extra keys (``step``, ``epoch``, ``stop_reason``, ...).
    """
    record = {"state": state, "host": socket.gethostname(), "pid": os.getpid(), "updated": now_iso(),
              "heartbeat": time.time(), **fields}
    atomic_write_bytes(run_dir / STATUS, (json.dumps(record) + "\n").encode(), durable=False)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None if missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class MetricsWriter:
    """Append-only ``metrics.jsonl``; each record is one line, flushed at once.

    Records carry ``step`` (global step), ``epoch``, ``iter`` (iteration in epoch),
    ``split`` (``train``/``val``), ``time`` (UNIX seconds) plus metric values
    (``loss``, ``lr``, ``samples_per_s``, ``acc``...).
    """

    def __init__(self, path: Path):
        self._f = open(path, "a", encoding="utf-8", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All complete records of a ``metrics.jsonl`` (a truncated last line is skipped)."""
    out = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


# `pimm launch --nproc-per-node/--nnodes` hands its launcher flags to the ranks in this
# variable (JSON); rank 0 records them in provenance.json so `pimm resume` can start the same ranks.
LAUNCH_ENV = "PIMM_LAUNCH"


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


def recorded_launch(run_dir: Path) -> dict[str, Any]:
    """The launch of the run's latest start (``provenance.json``): ``launcher`` (``pimm`` or
    ``external``), ``nproc_per_node`` and the multi-node flags ``pimm launch`` was given."""
    prov = read_json(run_dir / PROVENANCE) or {}
    for entry in reversed(prov.get("starts") or []):
        if isinstance(entry, dict) and isinstance(entry.get("launch"), dict):
            return entry["launch"]
    # runs written before pimm recorded the launch: one node with the recorded world size
    return {"launcher": "pimm", "nproc_per_node": int(prov.get("world_size") or 1)}


def recorded_world_size(record: dict[str, Any]) -> int:
    """Ranks in all of a recorded launch (the largest node count for ``MIN:MAX``)."""
    if record.get("world_size"):
        return int(record["world_size"])
    nodes = str(record.get("nnodes") or "1").split(":")[-1]
    return int(record.get("nproc_per_node") or 1) * (int(nodes) if nodes.isdigit() else 1)


def append_provenance(run_dir: Path, base: dict[str, Any], entry: dict[str, Any]) -> None:
    """Merge ``base`` into ``provenance.json`` and append ``entry`` to its ``starts`` list."""
    path = run_dir / PROVENANCE
    data = read_json(path) or {}
    data.update(base)
    data.setdefault("starts", []).append(entry)
    atomic_write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())
