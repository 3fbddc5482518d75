"""A collective that waited past ``dist.timeout``: the error that names the rank it waited for.

The process group's timeout (``dist.timeout``, :func:`pimm_core.process.dist.init`) makes a collective
raise in the ranks that wait (gloo) instead of waiting forever. The rank that was waited for is
found in the ranks' heartbeat files (:func:`pimm_core.run.ranks.lagging_ranks`): the one that
made no progress while not in a collective itself.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import TrainingError, first_line
from ..process.dist import DistInfo
from ..process.shell import resume_command
from ..run.ranks import LAG_MIN_S, describe_lag, lagging_ranks, read_rank_beats

# How a collective reports its timeout: gloo (the wait, then the pair it closed), NCCL's watchdog.
_TIMED_OUT = ("Timed out waiting", "Application timeout caused pair closure",
              "Watchdog caught collective operation timeout")


class CollectiveTimeoutError(TrainingError):
    """A collective waited past ``dist.timeout`` for another rank (exit code 1)."""


def is_collective_timeout(e: BaseException) -> bool:
    """``e`` (or an error it was raised from) is a collective's timeout."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RuntimeError) and any(s in str(e) for s in _TIMED_OUT):
            return True
        e = e.__cause__ or e.__context__
    return False


def name_the_hang(e: BaseException, run_dir: Path | None, info: DistInfo, timeout_min: float,
                  step: int) -> BaseException:
    """For a collective's timeout ``e`` in this rank, the one-line error that says which rank it waited
    for and in what phase (from the heartbeats under ``run_dir``), and how to go on (a
    :class:`CollectiveTimeoutError`, shown without ``e``'s traceback); any other error: ``e``.

    Args:
        timeout_min: ``dist.timeout`` (minutes).
        step: this rank's global step.
    """
    if not is_collective_timeout(e):
        return e
    now = time.time()
    timeout_s = timeout_min * 60
    beats = read_rank_beats(run_dir, info.world_size) if run_dir is not None else []
    stuck = lagging_ranks(beats, now, min_s=min(LAG_MIN_S, timeout_s / 2), exclude=info.rank)
    if stuck:
        who = "; ".join(describe_lag(b, now) for b in stuck)
    else:
        who = f"a collective failed after waiting for another rank ({first_line(e)[:200]})"
    resume = f"resume with: {resume_command(run_dir)}" if run_dir is not None else "resume from the last checkpoint"
    named = CollectiveTimeoutError(
        f"{who}; rank {info.rank} waited for it past dist.timeout ({timeout_min:g} min) at step {step} and the run "
        f"stopped; checkpoints already published are intact; {resume} (a rank that is only slow: raise dist.timeout)")
    named.__suppress_context__ = True  # (raised in e's handler: its gloo traceback would bury the line)
    return named
