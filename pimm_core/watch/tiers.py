"""The newest checkpoint of each tier (memory, disk, remote) and the run's latest recovery, as a watcher shows them (torch-free).

- memory: what every rank publishes in ``memory/<rank>.json`` (:func:`pimm_core.run.memory_index.read_memory_tier`):
  its own snapshot in node-local shared memory and the copy of its buddy's; :func:`memory_steps`
  groups the copies by step and says which steps every rank can reach.
- disk: ``model/last`` (its manifest's ``created`` time and step).
- remote: the newest complete ``step_<N>/`` on ``checkpoint.remote`` (listed at most every
  :data:`REMOTE_EVERY_S`, off the event loop: a store may be slow).
- recovery: ``status.json``'s ``recovery`` (``{"tier", "step", "restart", "message", "saved_world_size",
  "world_size"}``), written when ``pimm launch --max-restarts K`` restarted the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

from ..run.memory_index import MemoryTier, RankMemory
from ..run.values import json_int
from .fmt import human_duration

#: Seconds between two listings of a run's remote store by the console.
REMOTE_EVERY_S = 30.0


@dataclass(frozen=True)
class HeldCopy:
    """One copy of one rank's trainer state in node-local shared memory, and who holds it.

    Attributes:
        owner: the rank whose state it is.
        holder: the rank whose shared memory holds it (``owner`` for its own snapshot, else its buddy).
        host: the holder's host name.
        step: the global step of the state.
        time: when it became complete (UNIX seconds).
        bytes: its size in bytes.
    """

    owner: int
    holder: int
    host: str | None
    step: int
    time: float
    bytes: int

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
        copies: every copy of this step, by owner (its own snapshot first, then the buddy's copy).
        world: the ranks that must reach a step (every rank an index file names).
    """

    step: int
    copies: tuple[HeldCopy, ...]
    world: tuple[int, ...]

    @property
    def time(self) -> float:
        """When the step's newest copy became complete (UNIX seconds)."""
        return max(c.time for c in self.copies)

    @property
    def bytes(self) -> int:
        """Bytes all copies of this step take in shared memory."""
        return sum(c.bytes for c in self.copies)

    @property
    def missing(self) -> tuple[int, ...]:
        """The ranks with no copy of this step (empty: every rank can take it)."""
        have = {c.owner for c in self.copies}
        return tuple(r for r in self.world if r not in have)

    def to_json(self, now: float) -> dict[str, Any]:
        return {"step": self.step, "time": self.time, "age_s": round(max(0.0, now - self.time), 3),
                "bytes": self.bytes, "reachable": not self.missing, "missing": list(self.missing),
                "copies": [c.to_json() for c in self.copies]}


def memory_steps(ranks: dict[int, RankMemory]) -> list[MemoryStep]:
    """Every step some copy in the memory tier holds, newest first.

    Args:
        ranks: the ranks' index records (:func:`pimm_core.run.memory_index.read_rank_indexes`); the
            world is every rank a record names, as :func:`~pimm_core.run.memory_index.common_step` counts it.
    """
    copies = [HeldCopy(c.rank, r.rank, r.host, c.step, c.time, c.bytes)
              for r in ranks.values() for c in (r.own, r.buddy) if c is not None]
    named = set(ranks) | {c.owner for c in copies}
    world = tuple(range(max(named) + 1)) if named else ()
    by_step: dict[int, list[HeldCopy]] = {}
    for c in copies:
        by_step.setdefault(c.step, []).append(c)
    return [MemoryStep(s, tuple(sorted(cs, key=lambda c: (c.owner, c.kind != "own", c.holder))), world)
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
    saved, world = json_int(recovery.get("saved_world_size")), json_int(recovery.get("world_size"))
    text = f"recovered from {recovery['tier']}" + (f" at step {step}" if step is not None else "")
    notes = ([f"restart {restart}"] if restart is not None else []) + \
        ([f"world size {saved} -> {world}"] if None not in (saved, world) and saved != world else [])
    return text + (f" ({'; '.join(notes)})" if notes else "")


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


def memory_tier(tier: MemoryTier, now: float, on: bool) -> TierAge:
    """The memory tier: the newest step every rank can reach (:class:`~pimm_core.run.memory_index.MemoryTier`)."""
    if not on and not tier.ranks:
        return TierAge("memory", False)
    if tier.step is None:
        return TierAge("memory", True, note="no step every rank reaches" if tier.ranks else None)
    return TierAge("memory", True, tier.step, None if tier.time is None else max(0.0, now - tier.time))


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


def describe_memory(run_dir: Path, now: float) -> dict[str, Any] | None:
    """What ``pimm checkpoints ls`` shows of the run's memory tier: ``{"step": the newest step every
    rank reaches, "time", "live", "on_this_host": some rank runs here (else ``live`` cannot be known),
    "ranks": [each rank's index record], "steps": [MemoryStep.to_json]}``,
    or None when the run has no ``memory/`` directory (never raises)."""
    from ..run.memory_index import MEMORY_DIR, read_memory_tier

    if not (Path(run_dir) / MEMORY_DIR).is_dir():
        return None
    import socket

    tier = read_memory_tier(run_dir)
    here = any(r.host == socket.gethostname() for r in tier.ranks.values())
    return {"step": tier.step, "time": tier.time, "live": tier.live, "on_this_host": here,
            "ranks": [r.to_json() for _, r in sorted(tier.ranks.items())],
            "steps": [s.to_json(now) for s in memory_steps(tier.ranks)]}


def memory_lines(memory: dict[str, Any]) -> list[str]:
    """:func:`describe_memory` as lines of text: a head line, then one line per step with its age,
    bytes and, per rank, where its copies are (``rank 1: own on node-b, copy on rank 0``)."""
    from .fmt import fmt_size

    n = len(memory["ranks"])
    state = ("live" if memory["live"] else "no rank process alive: these copies are gone or going"
             if memory["on_this_host"] or not n else "its ranks run on other hosts")
    newest = memory["step"]
    head = f"memory tier ({n} rank{'s' if n != 1 else ''}, {state}): " + (
        f"every rank reaches step {newest}" if newest is not None else "no step every rank reaches")
    out = [head]
    if not memory["steps"]:
        out.append("  no copies yet")
    for s in memory["steps"]:
        where: dict[int, list[str]] = {}
        for c in s["copies"]:
            at = f"own on {c['host']}" if c["kind"] == "own" else f"copy on rank {c['holder']}"
            where.setdefault(c["rank"], []).append(at)
        ranks = " · ".join(f"rank {r}: {', '.join(w)}" for r, w in sorted(where.items()))
        missing = f" · missing: rank{'s' if len(s['missing']) > 1 else ''} {', '.join(map(str, s['missing']))}" \
            if s["missing"] else ""
        out.append(f"  step {s['step']}  {human_duration(s['age_s'])} ago  {fmt_size(s['bytes'])}  {ranks}{missing}")
    return out
