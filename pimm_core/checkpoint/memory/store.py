"""Node-local shared memory of the memory tier: ``/dev/shm/pimm-<run-id>/<rank>/step_<S>/`` (torch-free).

Each rank owns ``<root>/<rank>/``; in it a step directory holds the copies of that step it has:
its own state (``rank_<rank>.pt``) and its buddy's (``rank_<b>.pt``), each with a sidecar
``rank_<r>.json`` (``step``, ``epoch``, ``time``, ``bytes``, ``sha256``) written after the bytes,
atomically: a copy without its sidecar is incomplete and never used. ``/dev/shm`` is a tmpfs: the
copies are in host memory, outlive the rank's process (a ``kill -9``, torchrun's restart) and go
with the node (a reboot).

Ownership, as :mod:`~pimm_core.checkpoint.records.scratch` does for ``$TMPDIR``: the rank holds an
exclusive ``flock`` on ``<root>/<rank>.lock`` for as long as it runs (the kernel drops it when the
process dies, however it dies), and ``<root>/owner.json`` names the process that started the ranks
(torchrun's agent: the parent of the ranks). A run directory in ``/dev/shm`` whose rank locks are
all free and whose agent is dead is stale: the next run on the node removes it
(:func:`remove_stale`). A restart keeps it: the agent lives on while it restarts its ranks, and each
new rank takes its own directory back.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from ...faults import point, register
from ...fsio import remove_tree
from ...run.memory_index import MemoryCopy
from ...run.pids import pid_alive

#: Where the memory tier lives ($PIMM_SHM_ROOT overrides it: a node whose /dev/shm is small).
SHM_ROOT_ENV = "PIMM_SHM_ROOT"
PREFIX = "pimm-"
_STEP_RE = re.compile(r"^step_(\d+)$")
_COPY_RE = re.compile(r"^rank_(\d+)\.json$")

register("memory.copy_writing", "memory.copy_written")


def shm_root() -> Path:
    return Path(os.environ.get(SHM_ROOT_ENV) or "/dev/shm")


def run_id(run_dir: Path) -> str:
    """A name for the run, the same for every rank and restart of it: its directory's name and a
    hash of its absolute path (two runs of one name elsewhere do not share memory)."""
    path = os.path.abspath(run_dir)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(path))[:64]
    return f"{name}-{hashlib.sha256(path.encode()).hexdigest()[:12]}"


def run_root(run_dir: Path) -> Path:
    return shm_root() / f"{PREFIX}{run_id(run_dir)}"


@dataclass(frozen=True)
class Held:
    """A complete copy in this rank's directory: whose state, which step, where."""

    copy: MemoryCopy
    path: Path


class RankStore:
    """This rank's directory in the memory tier; :meth:`open` before use, :meth:`close` at the end.

    Args:
        run_dir: the run (names the tier: :func:`run_id`).
        rank: this rank.
    """

    def __init__(self, run_dir: Path, rank: int):
        self.root = run_root(run_dir)
        self.rank = rank
        self.dir = self.root / str(rank)
        self._lock = FileLock(str(self.root / f"{rank}.lock"), thread_local=False, fallback_to_soft=False)

    def open(self, *, agent_pid: int) -> None:
        """Create (or take back, after a restart) this rank's directory and hold its lock.

        Raises:
            OSError: shared memory cannot be written; Timeout: another live process holds it.
        """
        self.root.mkdir(mode=0o700, exist_ok=True)
        owner = self.root / "owner.json"
        data = {"host": socket.gethostname(), "agent_pid": agent_pid}
        if _read(owner) != data:
            tmp = owner.with_name(f".owner.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, owner)
        self._lock.acquire(timeout=30)  # a killed predecessor's lock is free at once
        self.dir.mkdir(mode=0o700, exist_ok=True)

    def write(self, owner: int, step: int, data: bytes | memoryview, *, epoch: int | None = None,
              world: int | None = None) -> MemoryCopy:
        """Write a copy of rank ``owner``'s state at ``step`` (taken by ``world`` ranks): the bytes, then the
        sidecar that makes it complete.

        Raises:
            OSError: the write failed (out of shared memory: ENOSPC); the copy stays incomplete.
        """
        folder = self.dir / f"step_{step}"
        folder.mkdir(exist_ok=True)
        digest = hashlib.sha256(data).hexdigest()
        target = folder / f"rank_{owner}.pt"
        tmp = folder / f".rank_{owner}.pt.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            point("memory.copy_writing", target)  # (tests: a rank killed in the middle of a copy)
        os.replace(tmp, target)
        copy = MemoryCopy(rank=owner, step=step, time=time.time(), bytes=len(data), sha256=digest, epoch=epoch,
                          world=world)
        side = folder / f"rank_{owner}.json"
        side_tmp = folder / f".rank_{owner}.json.tmp"
        side_tmp.write_text(json.dumps(copy.to_json(own=True) | {"rank": owner}))
        os.replace(side_tmp, side)
        point("memory.copy_written", target)
        return copy

    def held(self) -> list[Held]:
        """Every complete copy in this rank's directory (sidecar present, size as it says), oldest step first."""
        return _held_in(self.dir)

    def held_on_node(self) -> dict[int, list[Held]]:
        """Every complete copy on this node, by the rank directory holding it: this rank's and those of the
        run's other ranks on this node, of this world or of a previous one (a restart may number the ranks
        of a node anew, or run fewer of them)."""
        try:
            dirs = sorted((int(p.name), p) for p in self.root.iterdir() if p.name.isdigit() and p.is_dir())
        except OSError:
            return {}
        return {rank: held for rank, path in dirs if (held := _held_in(path))}

    def read(self, held: Held) -> bytes:
        """The bytes of a copy, checked against its sha256.

        Raises:
            OSError: it cannot be read. ValueError: its bytes are not what was written (checksum).
        """
        data = held.path.read_bytes()
        if len(data) != held.copy.bytes or hashlib.sha256(data).hexdigest() != held.copy.sha256:
            raise ValueError(f"{held.path}: sha256 differs from the one written with it")
        return data

    def keep_only(self, step: int, *, world: int | None = None) -> None:
        """Remove the step directories other than ``step`` (a newer complete round replaced them); with
        ``world``, also the directories of ranks ``world`` and above that no process holds: a previous,
        larger world's, which a restart with fewer ranks recovered from (no rank of this world owns them)."""
        try:
            folders = [p for p in self.dir.iterdir() if (m := _STEP_RE.match(p.name)) and int(m.group(1)) != step]
            if world is not None:
                folders += [p for p in self.root.iterdir() if p.name.isdigit() and int(p.name) >= world
                            and _all_free(p.with_name(f"{p.name}.lock"))]
        except OSError:
            return
        for folder in folders:
            try:
                remove_tree(folder)
                if folder.parent == self.root:  # (a rank directory: its lock file goes with it)
                    folder.with_name(f"{folder.name}.lock").unlink(missing_ok=True)
            except OSError:
                pass

    def close(self, *, remove: bool) -> None:
        """Let the lock go; with ``remove`` first delete this rank's directory (and the run's, when
        no other rank of it is left on this node)."""
        try:
            if remove:
                remove_tree(self.dir)
                Path(self._lock.lock_file).unlink(missing_ok=True)
                _remove_if_unused(self.root)
        except OSError:
            pass
        finally:
            if self._lock.is_locked:
                self._lock.release(force=True)


def _held_in(directory: Path) -> list[Held]:
    """The complete copies in one rank directory, oldest step first."""
    out: list[Held] = []
    try:
        steps = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_RE.match(p.name)))
    except OSError:
        return out
    for step, folder in steps:
        try:
            names = sorted(folder.iterdir())
        except OSError:
            continue
        for side in names:
            m = _COPY_RE.match(side.name)
            copy = MemoryCopy.from_json(_read(side), None) if m else None
            data = folder / f"rank_{m.group(1)}.pt" if m else None
            if copy is None or copy.step != step or copy.rank != int(m.group(1)):
                continue
            try:
                if data.stat().st_size != copy.bytes:
                    continue
            except OSError:
                continue
            out.append(Held(copy, data))
    return out


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _all_free(root: Path) -> bool:
    """No rank of the run in ``root`` is alive on this node (each rank lock can be taken at once; ``root``
    a lock file: that one)."""
    for path in [root] if root.suffix == ".lock" else root.glob("*.lock"):
        if not path.exists():
            continue
        lock = FileLock(str(path), thread_local=False, fallback_to_soft=False)
        try:
            lock.acquire(blocking=False)
        except (Timeout, OSError):
            return False
        lock.release()
    return True


def _remove_if_unused(root: Path) -> None:
    if not any(p.name.endswith(".lock") or p.name.isdigit() for p in root.iterdir()):
        remove_tree(root)


def remove_stale(*, keep: Path | None = None) -> list[Path]:
    """Remove the memory tiers in :func:`shm_root` whose ranks are all gone and whose agent process
    (``owner.json``) is dead, except ``keep``; returns what was removed. Never raises."""
    removed: list[Path] = []
    try:
        roots = [p for p in shm_root().iterdir() if p.name.startswith(PREFIX) and p.is_dir() and not p.is_symlink()]
    except OSError:
        return removed
    for root in roots:
        if keep is not None and root == keep:
            continue
        owner = _read(root / "owner.json") or {}
        agent = owner.get("agent_pid")
        if owner.get("host") == socket.gethostname() and isinstance(agent, int) and pid_alive(agent):
            continue  # its launcher is alive: a run between a failure and its restart, or still running
        if not (root / "owner.json").exists() and not any(root.glob("*.lock")):
            continue  # not a memory tier pimm made
        try:
            if _all_free(root):
                remove_tree(root)
                removed.append(root)
        except OSError:
            continue
    return removed


def remove_run(run_dir: Path) -> bool:
    """Remove the run's memory tier on this node when none of its ranks holds it (the launcher, once its
    ranks are gone); True when removed. Never raises."""
    root = run_root(run_dir)
    try:
        if root.is_dir() and _all_free(root):
            remove_tree(root)
            return True
    except OSError:
        pass
    return False
