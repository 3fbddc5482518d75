"""The newest checkpoint of each tier (memory, disk, remote) and the run's latest recovery, as a watcher shows them (torch-free).

- memory: what every rank publishes in ``memory/<rank>.json`` (:mod:`pimm_core.run.memory_index`):
  its own snapshot in node-local shared memory and the copy of its buddy's; :func:`memory_steps`
  groups the copies by step and says which steps every rank can reach.
- disk: ``model/last`` (its manifest's ``created`` time and step).
- remote: the newest complete ``step_<N>/`` on ``checkpoint.remote`` (listed at most every
  :data:`REMOTE_EVERY_S`, off the event loop: a store may be slow).
- recovery: ``status.json``'s ``recovery`` (``{"tier", "step", "restart"}``), written when
  ``pimm launch --max-restarts K`` restarted the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

from ..run.values import finite_number, json_int
from .fmt import human_duration

#: Seconds between two listings of a run's remote store by the console.
REMOTE_EVERY_S = 30.0
#: The tiers, fastest first.
TIERS = ("memory", "disk", "remote")


@dataclass(frozen=True)
class MemoryCopy:
    """One copy of one rank's trainer state in node-local shared memory.

    Attributes:
        owner: the rank whose state it is.
        holder: the rank whose shared memory holds it (``owner`` for its own snapshot, else its buddy).
        host: the holder's host name.
        step: the global step of the state.
        time: when it was taken (UNIX seconds), None if not recorded.
        bytes: its size in bytes, None if not recorded.
    """

    owner: int
    holder: int
    host: str | None
    step: int
    time: float | None
    bytes: int | None

    @property
    def kind(self) -> str:
        """``own`` (the rank's own snapshot) or ``buddy`` (a copy another rank holds)."""
        return "own" if self.owner == self.holder else "buddy"

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.owner, "holder": self.holder, "kind": self.kind, "host": self.host,
                "time": self.time, "bytes": self.bytes}


@dataclass(frozen=True)
class MemoryStep:
    """The copies of one step in the memory tier.

    Attributes:
        step: the global step.
        copies: every copy of this step, by owner then holder.
        ranks: the ranks that published an index (the world the step is reachable for).
    """

    step: int
    copies: tuple[MemoryCopy, ...]
    ranks: tuple[int, ...]

    @property
    def time(self) -> float | None:
        """When the step was taken (the earliest copy's time; UNIX seconds)."""
        times = [c.time for c in self.copies if c.time is not None]
        return min(times) if times else None

    @property
    def bytes(self) -> int:
        """Bytes all copies of this step take in shared memory."""
        return sum(c.bytes or 0 for c in self.copies)

    @property
    def missing(self) -> tuple[int, ...]:
        """The ranks with no copy of this step (empty: every rank can take it)."""
        have = {c.owner for c in self.copies}
        return tuple(r for r in self.ranks if r not in have)

    def holders(self, owner: int) -> tuple[MemoryCopy, ...]:
        return tuple(c for c in self.copies if c.owner == owner)

    def to_json(self, now: float) -> dict[str, Any]:
        t = self.time
        return {"step": self.step, "time": t, "age_s": None if t is None else round(max(0.0, now - t), 3),
                "bytes": self.bytes, "reachable": not self.missing, "missing": list(self.missing),
                "copies": [c.to_json() for c in self.copies]}


def _copy(owner: Any, holder: int, host: Any, entry: Any) -> MemoryCopy | None:
    """The copy an index's ``own`` or ``buddy`` entry describes; None for null or a damaged entry."""
    if not isinstance(entry, dict):
        return None
    step, owner = json_int(entry.get("step")), json_int(owner)
    if step is None or owner is None:
        return None
    return MemoryCopy(owner=owner, holder=holder, host=host if isinstance(host, str) else None, step=step,
                      time=finite_number(entry.get("time")), bytes=json_int(entry.get("bytes")))


def memory_steps(records: Iterable[dict[str, Any]]) -> list[MemoryStep]:
    """Every step some copy in the memory tier holds, newest first.

    Args:
        records: the ranks' ``memory/<rank>.json`` objects (``{"rank", "host", "own": {"step",
            "time", "bytes", ...} | null, "buddy": {"rank", "step", ...} | null}``); a record or
            entry with a missing or wrong-typed rank or step is skipped.
    """
    copies: list[MemoryCopy] = []
    ranks: set[int] = set()
    for rec in records:
        holder = json_int(rec.get("rank")) if isinstance(rec, dict) else None
        if holder is None:
            continue
        ranks.add(holder)
        own = _copy(holder, holder, rec.get("host"), rec.get("own"))
        buddy = rec.get("buddy")
        held = _copy(buddy.get("rank"), holder, rec.get("host"), buddy) if isinstance(buddy, dict) else None
        copies += [c for c in (own, held) if c is not None]
    by_step: dict[int, list[MemoryCopy]] = {}
    for c in copies:
        by_step.setdefault(c.step, []).append(c)
    world = tuple(sorted(ranks))
    return [MemoryStep(s, tuple(sorted(cs, key=lambda c: (c.owner, c.holder != c.owner, c.holder))), world)
            for s, cs in sorted(by_step.items(), reverse=True)]


@dataclass(frozen=True)
class TierAge:
    """The newest checkpoint of one tier.

    Attributes:
        tier: ``memory``, ``disk`` or ``remote``.
        on: whether the run uses this tier (``checkpoint.memory_every_steps``, always for disk,
            ``checkpoint.remote``).
        step: the newest checkpoint's global step (memory: the newest step every rank can reach).
        age_s: seconds since it was taken.
        note: why there is none, or why it cannot be known (an unreachable store).
    """

    tier: str
    on: bool
    step: int | None = None
    age_s: float | None = None
    note: str | None = None

    def text(self) -> str:
        """``memory 4 s (step 120)``, ``remote —`` (none yet), ``memory off``."""
        if not self.on:
            return f"{self.tier} off"
        if self.step is None:
            return f"{self.tier} —" + (f" ({self.note})" if self.note else "")
        return f"{self.tier} {human_duration(self.age_s)} (step {self.step})"


def recovery_text(recovery: Any) -> str | None:
    """``recovered from memory at step 120 (restart 1)`` for ``status.json``'s ``recovery``; None when
    there is none or it is damaged."""
    if not isinstance(recovery, dict) or not isinstance(recovery.get("tier"), str):
        return None
    step, restart = json_int(recovery.get("step")), json_int(recovery.get("restart"))
    text = f"recovered from {recovery['tier']}" + (f" at step {step}" if step is not None else "")
    return text + (f" (restart {restart})" if restart is not None else "")


def created_time(created: Any) -> float | None:
    """A manifest's ``created`` (ISO 8601) as UNIX seconds; None if absent or not a time."""
    if not isinstance(created, str):
        return None
    try:
        return datetime.fromisoformat(created).timestamp()
    except ValueError:
        return None


def disk_tier(candidates: Iterable[Any], now: float) -> TierAge:
    """The disk tier from ``model/``'s candidates: ``last`` when complete."""
    last = next((c for c in candidates if c.name == "last" and c.complete), None)
    if last is None:
        return TierAge("disk", True)
    when = created_time(last.created)
    return TierAge("disk", True, last.step, None if when is None else max(0.0, now - when))


def memory_tier(steps: list[MemoryStep], now: float, on: bool) -> TierAge:
    """The memory tier: the newest step every rank can reach."""
    if not on and not steps:
        return TierAge("memory", False)
    best = next((s for s in steps if not s.missing), None)
    if best is None:
        return TierAge("memory", True, note="no step every rank reaches" if steps else None)
    t = best.time
    return TierAge("memory", True, best.step, None if t is None else max(0.0, now - t))


class RemoteTier:
    """The newest complete checkpoint on a run's ``checkpoint.remote``, listed at most every
    ``every_s`` seconds (call :meth:`poll` from a worker thread: listing a store may take seconds)."""

    def __init__(self, run_dir: Path, every_s: float = REMOTE_EVERY_S):
        self.run_dir = Path(run_dir)
        self.every_s = every_s
        self._at = float("-inf")
        self._found: tuple[int | None, float | None, str | None] = (None, None, None)
        self._remote: Any = None

    def poll(self, now: float, config: dict[str, Any] | None) -> TierAge:
        table = (config or {}).get("checkpoint") or {}
        url = table.get("remote") if isinstance(table, dict) else None
        if not isinstance(url, str) or not url:
            return TierAge("remote", False)
        if now - self._at >= self.every_s or self._remote != url:
            self._at, self._remote = now, url
            self._found = self._list(url, table.get("remote_options"))
        step, when, note = self._found
        return TierAge("remote", True, step, None if when is None else max(0.0, now - when), note)

    def _list(self, url: str, options: Any) -> tuple[int | None, float | None, str | None]:
        from ..checkpoint.remote.store import describe_remote, remote_manifest

        listed = describe_remote(self.run_dir, None)  # (None: the run's config says no remote any more)
        if listed is None:
            return None, None, None
        if listed["error"] is not None:
            return None, None, f"cannot list the store: {listed['error']}"
        done = [c for c in listed["candidates"] if c["kind"] == "standard" and c["complete"] and c["step"] is not None]
        newest = max(done, key=lambda c: c["step"], default=None)
        if newest is None:
            return None, None, None
        manifest = remote_manifest(url, options if isinstance(options, dict) else None, self.run_dir, newest["name"])
        return newest["step"], created_time((manifest or {}).get("created")), None


def tiers_line(tiers: Iterable[TierAge]) -> str:
    """``checkpoints: memory 4 s (step 120) · disk 1 min 2 s (step 100) · remote —``."""
    return "checkpoints: " + " · ".join(t.text() for t in tiers)



def read_memory(run_dir: Path) -> list[MemoryStep]:
    """The memory tier's steps, newest first, from ``<run_dir>/memory/<rank>.json`` (never raises:
    a missing directory is no steps, a damaged file is skipped)."""
    import json

    records = []
    try:
        paths = sorted((Path(run_dir) / "memory").glob("*.json"))
    except OSError:
        return []
    for p in paths:
        try:
            records.append(json.loads(p.read_bytes()))
        except (OSError, ValueError):
            continue
    return memory_steps(r for r in records if isinstance(r, dict))
