"""``memory/<rank>.json``: what each rank holds in the memory tier, its writer and reader (torch-free).

With ``checkpoint.memory_every_steps = N`` every rank keeps its complete trainer state of every
N-th step in node-local shared memory (``/dev/shm/pimm-<run-id>/<rank>/``) and a copy of its
buddy's (:mod:`pimm_core.checkpoint.memory`). After each copy it holds is complete (written and
checksummed) the rank replaces its index file atomically::

    {"rank": r, "host": "<hostname>", "pid": <pid>, "shm": "<its shm dir>",
     "own": {"step": S, "epoch": E, "time": <unix s>, "bytes": B, "sha256": "<hex>", "world": W} | null,
     "buddy": {"rank": b, "step": S, "time": <unix s>, "bytes": B, "sha256": "<hex>", "world": W} | null}

``buddy`` is the copy of rank ``b``'s state this rank holds. :func:`read_memory_tier` joins the
files into :class:`MemoryTier`: the newest step every rank can reach (its own copy, or the one
its buddy holds) and whether any owner is alive on this host. Readers (``pimm checkpoints ls``,
the console) never raise on a missing or torn file: it reads as absent.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .jsonfile import read_json, write_json
from .pids import pid_alive
from .values import finite_number, json_int

#: The directory of the index files in a run directory.
MEMORY_DIR = "memory"


@dataclass(frozen=True)
class MemoryCopy:
    """One complete copy of a rank's trainer state in shared memory.

    Attributes:
        rank: whose state it is (the holder's own rank for ``own``).
        step: the global step (optimizer steps) it holds.
        epoch: the epoch at that step (``own`` only; None for a buddy copy).
        time: when it became complete (UNIX seconds).
        bytes: its size in bytes.
        sha256: the hex sha256 of its bytes (checked before it is loaded).
        world: the world size of the ranks that took it (None: not recorded, a copy written before
            the field existed; read as the current world size). A restart at another world size
            tells the previous world's copies by it.
    """

    rank: int
    step: int
    time: float
    bytes: int
    sha256: str
    epoch: int | None = None
    world: int | None = None

    def to_json(self, *, own: bool) -> dict[str, Any]:
        head = {"step": self.step, "epoch": self.epoch} if own else {"rank": self.rank, "step": self.step}
        tail = {"world": self.world} if self.world is not None else {}
        return {**head, "time": self.time, "bytes": self.bytes, "sha256": self.sha256, **tail}

    @classmethod
    def from_json(cls, data: Any, rank: int | None) -> MemoryCopy | None:
        """The copy of an index entry (``rank``: the holder's, for ``own``), None when malformed."""
        if not isinstance(data, dict):
            return None
        owner = rank if rank is not None else json_int(data.get("rank"))
        step, size = json_int(data.get("step")), json_int(data.get("bytes"))
        when, sha = finite_number(data.get("time")), data.get("sha256")
        if owner is None or step is None or size is None or when is None or not isinstance(sha, str):
            return None
        world = json_int(data.get("world"))
        return cls(rank=owner, step=step, time=float(when), bytes=size, sha256=sha, epoch=json_int(data.get("epoch")),
                   world=world if world is not None and world >= 1 else None)


@dataclass(frozen=True)
class RankMemory:
    """One ``memory/<rank>.json``: where the rank runs and the copies it holds."""

    rank: int
    host: str | None
    pid: int | None
    shm: str | None
    own: MemoryCopy | None
    buddy: MemoryCopy | None

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "shm": self.shm,
                "own": self.own.to_json(own=True) if self.own else None,
                "buddy": self.buddy.to_json(own=False) if self.buddy else None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankMemory | None:
        rank = json_int(data.get("rank"))
        if rank is None:
            return None
        host, shm = data.get("host"), data.get("shm")
        return cls(rank=rank, host=host if isinstance(host, str) else None, pid=json_int(data.get("pid")),
                   shm=shm if isinstance(shm, str) else None, own=MemoryCopy.from_json(data.get("own"), rank),
                   buddy=MemoryCopy.from_json(data.get("buddy"), None))

    def alive_here(self) -> bool:
        """Its process runs on this host (same hostname, the pid exists)."""
        return self.host == socket.gethostname() and self.pid is not None and pid_alive(self.pid)


@dataclass(frozen=True)
class MemoryTier:
    """The memory tier of a run as its ranks published it.

    Attributes:
        ranks: each rank's record, by rank.
        step: the newest step every rank ``0..W-1`` can reach (its own copy, or a buddy's copy of
            it); None when some rank has none or no record was found.
        time: when the newest copy of ``step`` became complete (UNIX seconds), None with ``step``.
        live: some record's process is alive on this host (the tier is in use; a dead run's tier
            is removed by the next run on the node).
    """

    ranks: dict[int, RankMemory] = field(default_factory=dict)
    step: int | None = None
    time: float | None = None
    live: bool = False


def index_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / MEMORY_DIR / f"{rank}.json"


def write_rank_index(run_dir: Path, record: RankMemory | dict[str, Any]) -> None:
    """Replace ``<run_dir>/memory/<rank>.json`` atomically with ``record`` (not fsynced: it is
    rewritten at every snapshot, and the copies it names live in memory anyway).

    Raises:
        OSError: the write failed (the old file is untouched).
    """
    data = record.to_json() if isinstance(record, RankMemory) else record
    path = index_path(run_dir, int(data["rank"]))
    path.parent.mkdir(exist_ok=True)
    write_json(path, data, durable=False)


def remove_rank_index(run_dir: Path, rank: int) -> None:
    """Remove this rank's index file (its copies are gone); never raises."""
    path = index_path(run_dir, rank)
    try:
        path.unlink(missing_ok=True)
        path.parent.rmdir()  # the last rank's removal takes the empty directory with it
    except OSError:
        pass


def remove_rank_indexes_from(run_dir: Path, first: int) -> list[int]:
    """Remove the index files of ranks ``first`` and above (ranks of a larger world that a restart at
    ``first`` ranks left behind); the ranks removed. Never raises."""
    removed = []
    for rank in sorted(read_rank_indexes(run_dir)):
        if rank >= first:
            try:
                index_path(run_dir, rank).unlink(missing_ok=True)
                removed.append(rank)
            except OSError:
                pass
    return removed


def read_rank_indexes(run_dir: Path) -> dict[int, RankMemory]:
    """Every readable ``memory/<rank>.json`` of the run, by rank (never raises)."""
    out: dict[int, RankMemory] = {}
    try:
        paths = sorted((Path(run_dir) / MEMORY_DIR).glob("*.json"))
    except OSError:
        return out
    for path in paths:
        data = read_json(path)
        record = RankMemory.from_json(data) if data is not None else None
        if record is not None and path.stem == str(record.rank):
            out[record.rank] = record
    return out


def common_step(ranks: dict[int, RankMemory], world_size: int | None = None) -> tuple[int | None, float | None]:
    """The newest step every rank ``0..world_size-1`` (default: the world size the copies record, else
    up to the highest rank named) can reach, its own copy or a buddy's, and when its newest copy became complete."""
    if not ranks:
        return None, None
    named = set(ranks) | {r.buddy.rank for r in ranks.values() if r.buddy}
    recorded = [c.world for r in ranks.values() for c in (r.own, r.buddy) if c is not None and c.world]
    world = world_size if world_size is not None else max(recorded) if recorded else max(named) + 1
    reach: dict[int, dict[int, float]] = {r: {} for r in range(world)}
    for record in ranks.values():
        for copy in (record.own, record.buddy):
            if copy is not None and copy.rank in reach:
                steps = reach[copy.rank]
                steps[copy.step] = max(steps.get(copy.step, 0.0), copy.time)
    common = set.intersection(*(set(s) for s in reach.values())) if reach else set()
    if not common:
        return None, None
    step = max(common)
    return step, max(s[step] for s in reach.values())


def read_memory_tier(run_dir: Path, world_size: int | None = None) -> MemoryTier:
    """The run's memory tier from its ranks' index files (:class:`MemoryTier`; never raises).

    Args:
        world_size: the ranks that must reach a step (default: every rank a file names).
    """
    ranks = read_rank_indexes(run_dir)
    step, when = common_step(ranks, world_size)
    return MemoryTier(ranks=ranks, step=step, time=when, live=any(r.alive_here() for r in ranks.values()))
