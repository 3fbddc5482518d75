"""A collective that waited past ``dist.timeout``: the error that names the rank it waited for.

The process group's timeout (``dist.timeout``, :func:`pimm_core.process.dist.init`) makes a collective
raise in the ranks that wait (gloo) instead of waiting forever. The rank that was waited for is
found in the ranks' heartbeat files (:func:`pimm_core.run.ranks.lagging_ranks`): the one that
made no progress while not in a collective itself. Before failing, every rank's Python stack is
written to ``ranks/<rank>.stack`` (:mod:`pimm_core.run.stacks`) and the line names the frame each
rank waits in.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import TrainingError, first_line
from ..process.dist import DistInfo
from ..process.shell import resume_command
from ..run import stacks
from ..run.ranks import LAG_MIN_S, RANKS_DIR, describe_lag, lagging_ranks, read_rank_beats
from ..run.stacks import request_stacks, wait_for_stacks, write_error_stack

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
    """For a hang in this rank (a collective's timeout ``e``, or ``data.timeout``), the one-line error
    that says which rank it waited for, in what phase and in which frame (from the heartbeats and
    the stacks every rank writes to ``ranks/<rank>.stack`` first, :mod:`pimm_core.run.stacks`), and
    how to go on (a :class:`CollectiveTimeoutError`, shown without ``e``'s traceback); any other
    error: ``e``.

    Args:
        timeout_min: ``dist.timeout`` (minutes).
        step: this rank's global step.
    """
    from ..data.loaders import DataTimeoutError

    data_timeout = isinstance(e, DataTimeoutError)
    if not (data_timeout or is_collective_timeout(e)):
        return e
    now = time.time()
    frames = _stacks(e, run_dir, info)
    where = f"every rank's stack: {Path(run_dir) / RANKS_DIR}/<rank>.stack" if run_dir is not None else ""
    if data_timeout:
        named = DataTimeoutError(f"{e}" + (f"; rank {info.rank} waits in {frames[info.rank]}" if info.rank in frames
                                            else "") + (f"; {where}" if where else ""))
        named.__suppress_context__ = True
        return named
    timeout_s = timeout_min * 60
    beats = read_rank_beats(run_dir, info.world_size) if run_dir is not None else []
    stuck = lagging_ranks(beats, now, min_s=min(LAG_MIN_S, timeout_s / 2), exclude=info.rank)
    if stuck:
        who = "; ".join(describe_lag(b, now) + _waits_in(frames, b.rank) for b in stuck)
    else:
        who = f"a collective failed after waiting for another rank ({first_line(e)[:200]})"
    resume = f"resume with: {resume_command(run_dir)}" if run_dir is not None else "resume from the last checkpoint"
    own = f" in {frames[info.rank]}" if info.rank in frames else ""
    named = CollectiveTimeoutError(
        f"{who}; rank {info.rank} waited for it{own} past dist.timeout ({timeout_min:g} min) at step {step} and the "
        f"run stopped; {where + '; ' if where else ''}checkpoints already published are intact; {resume} "
        "(a rank that is only slow: raise dist.timeout)")
    named.__suppress_context__ = True  # (raised in e's handler: its gloo traceback would bury the line)
    return named


def _stacks(e: BaseException, run_dir: Path | None, info: DistInfo) -> dict[int, str]:
    """Write this rank's stack (``e``'s frames: where it waited), ask the others for theirs and wait
    for them (a few seconds at most); ``{rank: the frame it waits in}`` of those written."""
    if run_dir is None:
        return {}
    own = write_error_stack(run_dir, info.rank, e)
    mine = {info.rank: own} if own is not None else {}
    others = [r for r in range(info.world_size) if r != info.rank]
    if not others:
        return mine
    since = request_stacks(run_dir)
    return {**wait_for_stacks(run_dir, others, since), **mine}


def _waits_in(frames: dict[int, str], rank: int) -> str:
    if rank in frames:
        return f", waiting in {frames[rank]}"
    return (f", no stack from it in {stacks.WAIT_S:g} s (a main thread stuck in C code that holds the GIL cannot "
            "answer; py-spy dump --pid PID can)")
