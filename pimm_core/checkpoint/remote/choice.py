"""Which checkpoint a resume of a run with ``checkpoint.remote`` takes: local or remote (torch-free).

A run's ``model/`` and its remote mirror can disagree: a requeued job may land on a node whose
scratch disk holds an earlier copy of the run (``last`` at step 45) while the remote holds a
newer complete ``step_90/``. A resume (``--train.auto-resume``, ``pimm resume``) takes the newest
complete checkpoint of the two, by step; on a tie, or when the local one has no step to compare
(a legacy file), the local one. :func:`resume_choice` is that decision and its one-line reason,
shared by the restore (:func:`pimm_core.launch.rundir.restore_from_remote`), ``pimm resume
--dry-run`` and ``pimm checkpoints ls`` (:func:`~.store.remote_choice`), so all three say the same thing. An explicit
``--train.resume PATH`` never asks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..select.candidate import Candidate
    from .candidate import RemoteCandidate


@dataclass
class ResumeChoice:
    """The decision of :func:`resume_choice`.

    Attributes:
        remote: the remote candidate to restore as ``model/last``, or None (resume the local one).
        reason: one line saying which one and why.
    """

    remote: RemoteCandidate | None
    reason: str


def newest_complete(cands: list[RemoteCandidate]) -> RemoteCandidate | None:
    """The newest complete remote ``step_<N>/`` of ``cands`` (:func:`~.store.remote_candidates`)."""
    done = [c for c in cands if c.kind == "standard" and c.complete and c.step is not None]
    return max(done, key=lambda c: c.step or 0, default=None)


def resume_choice(local: Candidate | None, remote: RemoteCandidate | None) -> ResumeChoice:
    """Local ``model/`` candidate (what :func:`~..select.selection.select_resume` chose) or the newest complete
    remote one: the newer by step; on a tie, or a local one without a step, the local one."""
    if remote is None:
        what = f"model/{local.name} at step {local.step}" if local is not None else "nothing"
        return ResumeChoice(None, f"the remote holds no complete checkpoint: resuming from {what}")
    if local is None:
        return ResumeChoice(remote, f"model/ holds no intact checkpoint; the remote holds step {remote.step} "
                                    f"({remote.name}): restoring it")
    if local.step is None:
        return ResumeChoice(None, f"model/{local.name} records no step to compare with the remote's step "
                                  f"{remote.step}: resuming from model/{local.name}")
    if remote.step is not None and remote.step > local.step:
        return ResumeChoice(remote, f"the remote holds step {remote.step}, newer than model/{local.name} at "
                                    f"step {local.step}: restoring it")
    same = "as new as" if remote.step == local.step else "newer than"
    return ResumeChoice(None, f"model/{local.name} at step {local.step} is {same} the remote's newest "
                              f"(step {remote.step}): resuming from it")

