"""Going back to an earlier point: a resume from a kept checkpoint older than the run's newest
branches the run (torch-free).

With ``checkpoint.keep_full = k`` the standard format keeps ``last`` and ``full_<step>/``
generations; ``--train.resume-from model/full_<step>`` continues from one of them. The
checkpoints of the line it leaves (``last``, ``last.prev``, ``full_<N>`` with a later step) are
moved, whole, to ``model/abandoned-<time>/`` before training starts: nothing is deleted, and
from then on a resume (also one that falls back past a damaged checkpoint of the branch) picks
only checkpoints of the branch and its past, never a higher step of the abandoned line.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ...fsio import fsync_dir
from .selection import Candidate, is_model_dir, list_candidates

BRANCH_KINDS = ("last", "last.prev", "full")
ABANDONED_PREFIX = "abandoned-"


def later_checkpoints(chosen: Candidate) -> list[Candidate]:
    """The standard checkpoints beside ``chosen`` (``last``, ``last.prev``, ``full_<N>``) with a later
    step: the line a resume from ``chosen`` leaves. Empty when ``chosen`` is not in a model directory."""
    model_dir = Path(chosen.path).parent
    if chosen.kind not in BRANCH_KINDS or not is_model_dir(model_dir):
        return []
    return [c for c in list_candidates(model_dir) if c.kind in BRANCH_KINDS and c.path != chosen.path
            and c.step is not None and chosen.step is not None and c.step > chosen.step]


def describe_branch(chosen: Candidate, later: list[Candidate], dest: Path | str) -> str:
    names = ", ".join(f"{c.name} (step {c.step})" for c in later)
    return (f"resuming from {chosen.name} (step {chosen.step}) branches the run: the later checkpoints {names} "
            f"move to {dest} (kept; a resume never picks them)")


def set_aside_later(chosen: Candidate) -> list[str]:
    """Rank 0, before a resume from ``chosen`` trains: move :func:`later_checkpoints` to
    ``model/abandoned-<time>/``; returns the warning line (none when nothing is later).

    Raises:
        OSError: a rename failed (what was moved stays moved; nothing is deleted).
    """
    later = later_checkpoints(chosen)
    if not later:
        return []
    model_dir = Path(chosen.path).parent
    dest = model_dir / f"{ABANDONED_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}"
    k = 1
    while dest.exists():
        dest, k = dest.with_name(f"{dest.name.split('.')[0]}.{k}"), k + 1
    dest.mkdir()
    for c in later:
        os.rename(c.path, dest / c.name)
    fsync_dir(model_dir)
    return [describe_branch(chosen, later, dest)]
