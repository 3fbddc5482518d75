"""Checkpoint candidates as a watcher shows them: age, which generation a row is, and verifying one (torch-free).

A save rotates ``model/last`` while the console looks at it, so a row is identified by
its generation (:func:`candidate_identity`), and a verification that a save overtook is
reported as ``changed``, never as a mismatch that is not there (:func:`verify_checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

# Looked up on the module at each call: the console runs exactly the check resume applies, and a
# replacement of it (a test simulating a save that rotates `last` mid-hash) reaches both.
from ..checkpoint.select import selection
from ..checkpoint.select.selection import Candidate


def candidate_age(c: Candidate, now: float | None = None) -> float | None:
    """Seconds since the candidate was written (manifest ``created``, else the file's mtime)."""
    now = time.time() if now is None else now
    when = None
    if c.created:
        try:
            when = datetime.fromisoformat(c.created).timestamp()
        except ValueError:
            when = None
    if when is None:
        try:
            when = Path(c.path).lstat().st_mtime
        except OSError:
            return None
    return max(0.0, now - when)


def candidate_identity(c: Candidate) -> tuple[Any, ...]:
    """Which checkpoint a row shows: its name and the generation written under that name.

    ``last`` names a new checkpoint after every save; its manifest's ``created`` time, step
    and files table (sizes and sha256) tell the generations apart. A candidate without a manifest (a legacy file without
    its sidecar, a temporary leftover) is told apart by its file's inode and mtime (this
    stats the file: call it off the event loop).
    """
    if c.manifest is not None and (c.created is not None or c.step is not None):
        files = c.manifest.get("files")
        digest = hashlib.sha256(json.dumps(files, sort_keys=True, default=str).encode()).hexdigest()[:16] \
            if isinstance(files, dict) else None
        return (c.name, c.created, c.step, digest)
    try:
        st = os.stat(c.path)
        return (c.name, None, c.step, st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        return (c.name, None, c.step, None, c.size, None)


def _generation(c: Candidate) -> tuple[Any, ...]:
    """What must not change while a candidate is hashed: its manifest, and what its path
    (and its sidecar manifest) are on disk."""
    p = Path(c.path)

    def stat(q: Path) -> tuple[int, int, int] | None:
        try:
            st = os.stat(q)
        except OSError:
            return None
        return st.st_ino, st.st_size if not os.path.isdir(q) else 0, st.st_mtime_ns

    try:
        link = os.readlink(p) if p.is_symlink() else None
    except OSError:
        link = None
    manifest = json.dumps(c.manifest, sort_keys=True, default=str) if c.manifest is not None else None
    return (c.name, link, stat(p), stat(p.with_name(p.name + ".json")), manifest)


@dataclass
class VerifyResult:
    """The outcome of :func:`verify_checkpoint` for one generation of one candidate.

    Attributes:
        name: the candidate's name (``last``, ``iter_40.pth``, ...).
        identity: :func:`candidate_identity` of the generation that was hashed.
        step: its global step.
        outcome: ``ok``; ``failed`` (``problems`` says why); ``changed``: a save replaced it
            on every try (not a verdict on any checkpoint: check again).
        problems: one line per problem.
        tries: how many generations were read.
    """

    name: str
    identity: tuple[Any, ...]
    step: int | None
    outcome: str
    problems: list[str]
    tries: int = 1

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def find_candidate(model_dir: Path, name: str) -> Candidate | None:
    """The candidate named ``name`` in ``model_dir`` as it is now (None if there is none)."""
    return next((c for c in selection.list_candidates(Path(model_dir)) if c.name == name), None)


def verify_checkpoint(model_dir: Path, name: str, *, tries: int = 3, settle_s: float = 0.3) -> VerifyResult:
    """Verify the current generation of candidate ``name``: its files against its own manifest.

    The candidate is listed afresh (a snapshot's manifest may be older than the files now
    under ``model/last``), hashed, and listed again: if a save rotated it in between (the
    path, its manifest or sidecar changed) the result is discarded and the new generation is
    checked, up to ``tries`` times; then the outcome is ``changed``, never a mismatch that
    is not there. A mismatch is confirmed after ``settle_s`` (a file replaced just before
    its sidecar manifest). Hashes are cached per file inode, size and mtime
    (:func:`pimm_core.checkpoint.select.selection.verify_candidate`).
    """
    seen: Candidate | None = None
    for attempt in range(1, tries + 1):
        c = find_candidate(model_dir, name)
        if c is None:  # between the two renames of a rotation, or deleted
            time.sleep(settle_s)
            continue
        seen = c
        before = _generation(c)
        try:
            problems = candidate_problems(c)
        except OSError as e:  # a file went away under the hash (a rotation), or cannot be read
            problems = [f"{Path(e.filename).name if e.filename else name}: {e.strerror or e.__class__.__name__}"]
        if problems:
            time.sleep(settle_s)
        again = find_candidate(model_dir, name)
        if again is not None and _generation(again) == before:
            return VerifyResult(name, candidate_identity(c), c.step, "failed" if problems else "ok", problems, attempt)
    if seen is None:
        return VerifyResult(name, (name,), None, "changed",
                            [f"{name} is no longer in {model_dir} (removed or being replaced); press v again"], tries)
    return VerifyResult(name, candidate_identity(seen), seen.step, "changed",
                        [f"{name} changed while it was checked (a save replaced it {tries} times); press v again"],
                        tries)


def candidate_problems(c: Candidate) -> list[str]:
    """What an operator is told is wrong with a candidate; one line per problem (empty: ok).

    Sizes and sha256 against its manifest
    (:func:`pimm_core.checkpoint.select.selection.verify_candidate`, the check resume applies), plus
    what that check lets pass: no manifest to verify against, or an incomplete candidate.
    """
    if c.manifest is None:
        return [c.reason or "no manifest: nothing to verify against"]
    if not isinstance(c.manifest.get("files"), dict):
        return ["manifest has no files table"]
    problems = selection.verify_candidate(c)  # the same check resume applies before loading
    if not c.complete:
        problems.insert(0, c.reason or "incomplete")
    return problems

