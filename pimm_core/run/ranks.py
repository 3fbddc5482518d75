"""``ranks/<rank>.json``: each rank's heartbeat, its reader, and who of the ranks is stuck (torch-free).

Every rank of a run (not only rank 0) keeps one small JSON object in ``<run>/ranks/``, replaced
atomically by :class:`~pimm_core.run.heartbeat.Heartbeat` at most about once a second::

    {"rank": 1, "world_size": 2, "pid": 4242, "host": "node3", "step": 17,
     "phase": "callback", "detail": "on_step_end",
     "since": 1764650000.1, "progress": 1764650000.1, "updated": 1764650001.2}

``phase`` is what the rank is doing (:data:`PHASES`), ``since`` when it entered it and
``progress`` (UNIX seconds) when it last moved on: a new phase or a new step. ``updated`` is when
the file was written: when something changed, and every few seconds anyway, so a rank stuck in
one phase keeps an old ``progress`` under a fresh ``updated`` (:func:`ranks_alive`).

A hang shows as ranks waiting in a ``collective`` for a peer that stays in another phase:
:func:`lagging_ranks` names that peer, the same rule for the console's Live view and the error
line of a run that ``dist.timeout`` ended.
"""

from __future__ import annotations

import os
import socket
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .jsonfile import read_json
from .values import finite_number, json_int

#: The directory of the ranks' heartbeat files in a run directory.
RANKS_DIR = "ranks"

#: What a rank can be doing. ``callback``: a user ``[[callbacks]]`` moment; ``end``: the rank's
#: ``train()`` returned or failed (the file stays, with the last step).
PHASES = ("start", "data", "forward/backward", "collective", "callback", "save", "evaluation", "end")

#: A rank with no progress for at least this long (seconds) can be named as lagging.
LAG_MIN_S = 10.0

#: A straggler's steps take at least this many times the median rank's (:func:`stragglers`)...
STRAGGLER_RATIO = 1.5
#: ...over this many of its latest optimizer steps (``work_s``)...
STRAGGLER_WINDOW = 20
#: ...and at least this much longer (seconds per step), so that noise in millisecond steps is not one.
STRAGGLER_MIN_GAP_S = 0.005


def rank_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / f"{rank}.json"


@dataclass(frozen=True)
class RankBeat:
    """One ``ranks/<rank>.json`` record (times in UNIX seconds; None where the file lacks them)."""

    rank: int
    world_size: int | None = None
    pid: int | None = None
    host: str | None = None
    step: int | None = None
    phase: str | None = None
    detail: str | None = None
    since: float | None = None
    progress: float | None = None
    updated: float | None = None
    #: seconds per optimizer step this rank spends before it can communicate (waiting for its
    #: batches and its forward passes), the mean of its last :data:`STRAGGLER_WINDOW` steps; None
    #: before it has that many
    work_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankBeat | None:
        rank = json_int(data.get("rank"))
        if rank is None or rank < 0:
            return None
        text = lambda k: data.get(k) if isinstance(data.get(k), str) else None  # noqa: E731
        return cls(rank=rank, world_size=json_int(data.get("world_size")), pid=json_int(data.get("pid")),
                   host=text("host"), step=json_int(data.get("step")), phase=text("phase"), detail=text("detail"),
                   since=finite_number(data.get("since")), progress=finite_number(data.get("progress")),
                   updated=finite_number(data.get("updated")), work_s=finite_number(data.get("work_s")))

    @property
    def doing(self) -> str:
        """The phase with its detail, e.g. ``callback (on_step_end)``."""
        phase = self.phase or "unknown phase"
        return f"{phase} ({self.detail})" if self.detail else phase

    def idle_s(self, now: float) -> float | None:
        """Seconds since this rank last made progress (None: not recorded)."""
        return None if self.progress is None else max(0.0, now - self.progress)

    def gone(self) -> bool:
        """Its process no longer exists (only known on this host)."""
        if self.pid is None or self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False


def read_rank_beats(run_dir: Path, world_size: int | None = None) -> list[RankBeat]:
    """The ranks' heartbeat records in rank order (never raises: a missing, torn or foreign file is
    left out). ``world_size``: only ranks below it (files an earlier, larger session left)."""
    folder = Path(run_dir) / RANKS_DIR
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    out = []
    for name in names:
        stem, dot, ext = name.partition(".")
        if not (stem.isdigit() and dot and ext == "json"):
            continue
        data = read_json(folder / name)
        beat = RankBeat.from_json(data) if data is not None else None
        if beat is not None and beat.rank == int(stem) and (world_size is None or beat.rank < world_size):
            out.append(beat)
    return sorted(out, key=lambda b: b.rank)


#: A rank file not rewritten for this long (seconds) is of a process that is gone or frozen.
ALIVE_S = 30.0


def ranks_alive(beats: list[RankBeat], now: float) -> bool:
    """Some rank that has not ended rewrote its file within :data:`ALIVE_S`: the ranks' processes
    are alive, even when ``status.json`` (written at logged steps) has gone quiet in a hang."""
    return any(b.phase != "end" and b.updated is not None and now - b.updated < ALIVE_S for b in beats)


def lagging_ranks(beats: list[RankBeat], now: float, *, min_s: float = LAG_MIN_S,
                  exclude: int | None = None) -> list[RankBeat]:
    """The ranks the others wait for: no progress for at least ``min_s`` seconds, not in a
    collective themselves, while a peer waits in one (or has moved on ``min_s`` more recently).
    Ranks blocked in a collective made no progress either, but they wait for someone; ranks all
    busy in a long step wait for nobody. A step's own collectives (DDP's gradient all-reduce,
    FSDP's all-gathers) run inside ``forward/backward``: ranks stalled there wait for a peer
    stalled in another phase (``data``, ``callback``, ``save``, ``evaluation``). When every stalled
    rank is in a collective, a rank whose process is gone. ``exclude``: the rank asking, itself
    waiting in a collective.

    Returns:
        The lagging ranks' records, longest without progress first; [] when every rank moves.
    """
    live = [b for b in beats if b.phase != "end" and b.rank != exclude]
    idle = {b.rank: b.idle_s(now) or 0.0 for b in live}
    stalled = [b for b in live if idle[b.rank] >= min_s]
    waited_on = exclude is not None or any(b.phase == "collective" for b in live)
    freshest = min(idle.values(), default=0.0)
    elsewhere = [b for b in stalled if b.phase not in ("collective", "forward/backward")]
    if elsewhere and (waited_on or any(b.phase == "forward/backward" for b in live)):
        stuck = elsewhere
    else:
        stuck = [b for b in stalled if b.phase != "collective" and (waited_on or idle[b.rank] - freshest >= min_s)]
    stuck = stuck or [b for b in stalled if b.gone()]
    return sorted(stuck, key=lambda b: b.progress or 0.0)


def describe_lag(beat: RankBeat, now: float) -> str:
    """``rank 1 made no progress for 42 s (phase callback (on_step_end), step 17)``."""
    idle = beat.idle_s(now)
    for_s = f" for {idle:.0f} s" if idle is not None else ""
    step = f", step {beat.step}" if beat.step is not None else ""
    gone = "; its process is gone" if beat.gone() else ""
    return f"rank {beat.rank} made no progress{for_s} (phase {beat.doing}{step}){gone}"


def stragglers(beats: list[RankBeat], *, ratio: float = STRAGGLER_RATIO) -> list[tuple[RankBeat, float]]:
    """The ranks whose steps take at least ``ratio`` times the median rank's, over a window.

    A step's own time is what a rank spends before it can communicate: waiting for its batches
    and running its forward passes (``work_s``, the mean over its last :data:`STRAGGLER_WINDOW`
    steps). The whole step cannot tell: the ranks wait for each other in its collectives (DDP's
    gradient all-reduce), so each takes as long as the slowest. The median is the lower median of
    the ranks that have a window (with two ranks, the faster one's); a straggler is also at least
    :data:`STRAGGLER_MIN_GAP_S` slower per step. Ranks that ended are left out.

    Returns:
        ``(record, median work_s)`` of each straggler, slowest first.
    """
    timed = [b for b in beats if b.phase != "end" and b.work_s is not None]
    if len(timed) < 2:
        return []
    median = statistics.median_low([b.work_s for b in timed])
    slow = [b for b in timed if b.work_s >= ratio * median and b.work_s - median >= STRAGGLER_MIN_GAP_S]
    return [(b, median) for b in sorted(slow, key=lambda b: -(b.work_s or 0.0))]


def describe_straggler(beat: RankBeat, median: float) -> str:
    """``rank 3 is a straggler: its steps take 2.1x the median rank's (batches and forward: 0.412 s vs
    0.196 s per step over its last 20 steps)``."""
    work = beat.work_s or 0.0
    times = f"{work / median:.1f}x" if median > 0 else "far longer than"
    return (f"rank {beat.rank} is a straggler: its steps take {times} the median rank's (batches and forward: "
            f"{work:.3f} s vs {median:.3f} s per step over its last {STRAGGLER_WINDOW} steps)")
