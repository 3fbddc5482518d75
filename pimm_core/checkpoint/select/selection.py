"""Find, describe and select checkpoints in a ``model/`` directory (torch-free).

One function, :func:`select_resume`, decides what a resume loads; every caller
(``pimm launch --train.resume``, ``pimm resume``, ``--dry-run``, ``pimm checkpoints
latest``/``ls``/``diff``, ``python -m pimm_core.utils.path latest-checkpoint``, the
console's resume marker) goes through it, sha256 verification included: a candidate
whose files do not match its manifest is passed over everywhere, not only by the real
resume. ``verify=False`` (``--no-verify`` on the scripting commands) is the explicit
opt-out of the hash pass. Results of the hash pass are cached per process, keyed by
each file's inode, size and mtime, so a console polling the same files hashes them once.

Preference order for resume: ``last``, then a complete ``last.prev`` (left by a
rotation interrupted between its two renames), then a legacy ``model_last.pth``, then
single-format ``step_<N>.pth`` files, newest first (when ``last`` is missing or damaged:
a crash before the first ``last`` pointer was set, or a corrupt target).
Temporary ``*.tmp`` entries and anything lacking its ``.complete`` marker, weights,
DCP metadata or manifest are rejected with the reason.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from ...faults import point
from ..records.generation import READ_TRIES, GenerationChanged, changed_message, identity, wait_for_rotation
from ..records.manifest import COMPLETE, MANIFEST, ManifestError, read_manifest
from .candidate import (BEST, BEST_K_RE, DCP_METADATA, FULL_RE, ITER_RE, LEGACY_LAST, POINTERS,  # noqa: F401 (re-exported)
                        RESUME_ORDER, SINGLE_RE, TRAINER_DCP, WEIGHTS, WEIGHTS_FIELD, Candidate)
from .verify import verify_candidate

def _tree_size(path: Path) -> int:
    """Bytes of the files at or under ``path`` (``os.scandir``: one stat per file, no ``Path``
    objects: a listing of many checkpoints calls this once for each)."""
    try:
        st = os.stat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total, stack = 0, [os.fspath(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
                    except OSError:
                        pass
        except OSError:
            pass
    return total


def _apply_manifest(c: Candidate, manifest_path: Path) -> str | None:
    """Fill step/epoch/metrics from a manifest; return a problem string or None.

    A manifest that is not the schema of :mod:`..records.manifest` is ``invalid manifest: <what>``
    and fills nothing (the candidate is then incomplete, and passed over by a resume).
    """
    try:
        m = read_manifest(manifest_path)  # (no stat first: one open tells a missing one)
    except ManifestError as e:
        c.manifest_problem = f"invalid manifest: {e}"
        return c.manifest_problem
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return f"missing {manifest_path.name}"
    except OSError as e:
        c.manifest_problem = f"unreadable {manifest_path.name} ({e.strerror or e.__class__.__name__})"
        return c.manifest_problem
    c.manifest = m
    c.step, c.epoch, c.iter = m.get("step"), m.get("epoch"), m.get("iter")
    c.created = m.get("created")
    c.metrics = m.get("metrics") or {}
    return None


def weights_in_dcp(manifest: dict[str, Any] | None) -> bool:
    """True when a standard checkpoint's manifest says its weights are only in ``trainer.dcp/``."""
    return isinstance(manifest, dict) and manifest.get(WEIGHTS_FIELD) == TRAINER_DCP


def _standard_dir(path: Path, kind: str, sized: bool = True) -> Candidate:
    c = Candidate(path.name, str(path), kind, "standard", resumable=True, complete=False,
                  size=_tree_size(path) if sized else 0)
    missing = []
    p = os.fspath(path)  # (os.path on strings: a listing of many runs calls this for each)
    problem = _apply_manifest(c, path / MANIFEST)
    if not os.path.isfile(os.path.join(p, WEIGHTS)) and not weights_in_dcp(c.manifest):
        missing.append(WEIGHTS)
    dcp = os.path.join(p, TRAINER_DCP)
    if not os.path.isfile(os.path.join(dcp, DCP_METADATA)):
        missing.append(f"{TRAINER_DCP}/{DCP_METADATA}")
    if not os.path.isfile(os.path.join(dcp, COMPLETE)):
        missing.append(f"{TRAINER_DCP}/{COMPLETE}")
    if problem and problem.startswith("missing"):
        missing.append(MANIFEST)
    if not os.path.isfile(os.path.join(p, COMPLETE)):
        missing.append(COMPLETE)
    reasons = (["missing " + ", ".join(missing)] if missing else []) + \
        ([problem] if problem and not problem.startswith("missing") else [])
    if reasons:
        c.reason = "; ".join(reasons)
    else:
        c.complete = True
    return c


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _weights_file(path: Path, kind: str, resumable: bool, fmt: str) -> Candidate:
    c = Candidate(path.name, str(path), kind, fmt, resumable=resumable, complete=True, size=_tree_size(path))
    problem = _apply_manifest(c, _sidecar(path))
    if problem and not problem.startswith("missing"):  # (no sidecar: the file is the authority)
        c.complete, c.reason = False, problem
    if c.size == 0:
        c.complete, c.reason = False, "empty file"
    return c


def _pointer(link: Path) -> Candidate:
    """A ``last``/``best``/``final`` symlink of the single format, described by its target."""
    target = link.parent / os.readlink(link)
    if not target.is_file():
        return Candidate(link.name, str(link), link.name, "single", True, False,
                         reason=f"points to missing {os.readlink(link)}")
    c = _weights_file(target, link.name, resumable=True, fmt="single")
    c.name, c.path = link.name, str(link)
    c.target = target.name
    return c


def describe_entry(entry: Path, *, sized: bool = True) -> Candidate | None:
    """The candidate one entry of a model directory is, read from one generation of it.

    ``sized=False``: a checkpoint directory's files are not summed (its ``size`` is 0), for a
    reader that does not show it (``pimm runs ls``).

    Returns ``None`` for an entry that is not a checkpoint (a sidecar manifest, another
    file), or that a save removed while it was read. An entry a save replaced while it was
    read (``last`` rotated) is read again, at most ``READ_TRIES`` times.
    """
    if entry.name.endswith(".json") and not entry.is_dir():
        return None  # a sidecar manifest: described with its file
    c = None
    for _ in range(READ_TRIES):
        before = identity(entry)
        try:
            c = _describe(entry, sized)
        except OSError:  # removed (or replaced) under the read: a live save
            c = None
        if c is not None and c.kind == "tmp":
            return c  # being written: no generation to keep
        if identity(entry) == before:
            if c is not None:
                c.generation = before
            return c if os.path.lexists(entry) else None
        if not wait_for_rotation(entry):  # gone, unless a rotation is putting a new one there
            return None
    return c


def _describe(entry: Path, sized: bool = True) -> Candidate | None:
    name = entry.name
    if name.endswith(".tmp") or (name.startswith(".") and ".tmp" in name):
        return Candidate(name, str(entry), "tmp", "unknown", False, False,
                         reason="temporary leftover of an interrupted save", size=_tree_size(entry))
    if name in POINTERS and entry.is_symlink():
        return _pointer(entry)
    if (m := SINGLE_RE.match(name)) and entry.is_file():
        c = _weights_file(entry, "single", resumable=True, fmt="single")
        c.step = c.step if c.step is not None else int(m.group(1))
        return c
    if name in ("last", "last.prev") and entry.is_dir():
        return _standard_dir(entry, name, sized)
    if (m := FULL_RE.match(name)) and entry.is_dir() and not entry.is_symlink():
        c = _standard_dir(entry, "full", sized)
        c.step = c.step if c.step is not None else int(m.group(1))
        return c
    if name == LEGACY_LAST and entry.is_file():
        return _weights_file(entry, "legacy", resumable=True, fmt="legacy")
    if name == BEST and entry.is_file():
        return _weights_file(entry, "best", resumable=False, fmt="weights")
    for kind, pattern in (("iter", ITER_RE), ("best", BEST_K_RE)):
        if (m := pattern.match(name)) and entry.is_file():
            c = _weights_file(entry, kind, resumable=False, fmt="weights")
            c.step = c.step if c.step is not None else int(m.group(1))
            return c
    return None


def list_candidates(model_dir: Path) -> list[Candidate]:
    """Every checkpoint and leftover in ``model_dir``, resume candidates first.

    Safe beside a live run: each entry is read from one generation (:func:`describe_entry`);
    the resume candidates (``last``, ``last.prev``, ``model_last.pth``, pointers) are looked
    up by name as well as listed, since a directory listing taken during a rename may miss
    the renamed entry. Returns an empty list when ``model_dir`` does not exist.
    """
    model_dir = Path(model_dir)
    try:
        names = {entry.name for entry in model_dir.iterdir()}
    except (FileNotFoundError, NotADirectoryError):
        return []
    names.update(n for n in (*RESUME_ORDER, *POINTERS, BEST) if os.path.lexists(model_dir / n))
    out: list[Candidate] = []
    iters: list[Candidate] = []
    for name in sorted(names):
        c = describe_entry(model_dir / name)
        if c is not None:
            (iters if c.kind in ("single", "iter", "full") or BEST_K_RE.match(c.name) else out).append(c)
    order = {n: i for i, n in enumerate(RESUME_ORDER)}
    out.sort(key=lambda c: (order.get(c.name, len(order)), c.name))
    return out + sorted(iters, key=lambda c: c.step or 0)


def in_resume_order(cands: list[Candidate]) -> list[Candidate]:
    """Candidates a resume may load, most preferred first: :data:`RESUME_ORDER`, then the kept
    ``full_<N>/`` (``checkpoint.keep_full``) and single-format ``step_<N>.pth`` files, newest first
    (a file ``last`` points at is listed once)."""
    named = [c for name in RESUME_ORDER for c in cands if c.name == name]
    seen = {c.target for c in named if c.target}
    return named + sorted((c for c in cands if c.kind in ("full", "single") and c.name not in seen),
                          key=lambda c: -(c.step or 0))


def select_resume(model_dir: Path, *, verify: bool = True) -> tuple[Candidate | None, list[Candidate]]:
    """Choose the checkpoint a resume loads.

    Args:
        verify: check each complete candidate's files (sizes, sha256) against its
            manifest and pass over those that differ (their ``verify_problems`` say why).

    Returns:
        ``(chosen, candidates)``: ``chosen`` is the first complete resumable (and, with
        ``verify``, intact) candidate in :func:`in_resume_order`, or ``None``;
        ``candidates`` is :func:`list_candidates`.

    Beside a live run the answer is one a save could not have made wrong: a candidate that
    a save replaced while it was verified is not called corrupt, a ``last.prev`` is not
    chosen while a newer ``last`` is there, and "nothing" is answered only when the resume
    candidates stayed the same through the listing; otherwise ``model/`` is listed again
    (at most ``RELIST_TRIES`` times).

    Raises:
        GenerationChanged: saves changed the resume candidates during every listing (exit
            code 75: try again); never a wrong answer.
    """
    model_dir = Path(model_dir)
    for attempt in range(1, RELIST_TRIES + 1):
        before = _resume_names(model_dir)
        cands = list_candidates(model_dir)
        point("selection.listed", model_dir)  # (tests: a save lands here, between the listing and the checks)
        chosen, changed = _first_intact(cands, verify)
        if not changed:
            if chosen is None and _resume_names(model_dir) == before:
                return None, cands
            listed_last = next((c.generation for c in cands if c.name == "last"), None)
            if chosen is not None and not (chosen.name == "last.prev" and identity(model_dir / "last") != listed_last):
                return chosen, cands
        wait_for_rotation(model_dir / "last", 0.02 * attempt)
    raise GenerationChanged(changed_message(str(model_dir), RELIST_TRIES))


#: How many times :func:`select_resume` lists ``model/`` again when a save changed it under the read.
RELIST_TRIES = 5


def _resume_names(model_dir: Path) -> tuple[Any, ...]:
    """What the names a resume may pick hold now (their generations)."""
    return tuple(identity(model_dir / n) for n in RESUME_ORDER)


def _first_intact(cands: list[Candidate], verify: bool) -> tuple[Candidate | None, bool]:
    """The first complete, resumable (and, with ``verify``, intact) candidate in resume order,
    and whether one that came before it in that order changed while it was checked."""
    for c in in_resume_order(cands):
        if not (c.complete and c.resumable):
            continue
        if verify:
            problems = verify_stable(c)
            if problems is None:
                return None, True
            c.verify_problems = problems or None
            if c.verify_problems:
                continue
        if identity(Path(c.path)) != c.generation:
            return None, True
        return c, False
    return None, False


def verify_stable(c: Candidate) -> list[str] | None:
    """:func:`verify_candidate`, or ``None`` when the candidate's path no longer holds the
    generation it was described from (a save replaced or removed it): no verdict."""
    problems = verify_candidate(c)
    if c.generation is not None and identity(Path(c.path)) != c.generation:
        return None
    return problems


def explain(cands: list[Candidate], chosen: Candidate | None) -> list[str]:
    """One human line per candidate: accepted/rejected and why."""
    lines = []
    for c in cands:
        if chosen is not None and c.path == chosen.path:
            verdict = "selected"
        elif c.verify_problems:
            verdict = f"rejected: failed verification ({'; '.join(c.verify_problems)})"
        elif not c.resumable and c.complete:
            verdict = "rejected: weights only, cannot resume"
        elif not c.complete:
            verdict = f"rejected: {c.reason}"
        else:
            verdict = "accepted (complete, lower preference)"
        where = f" step={c.step} epoch={c.epoch}" if c.step is not None else ""
        lines.append(f"{c.name}: {verdict}{where}")
    return lines


def has_checkpoints(model_dir: Path) -> bool:
    """True when ``model_dir`` holds anything a run wrote (a checkpoint or a leftover)."""
    return bool(list_candidates(model_dir))


def is_model_dir(p: Path) -> bool:
    """A ``model/`` directory (holds candidates), as opposed to one checkpoint directory."""
    return p.is_dir() and not (p / WEIGHTS).exists() and not (p / TRAINER_DCP).exists() \
        and (any((p / n).exists() or (p / n).is_symlink() for n in RESUME_ORDER)
             or any(SINGLE_RE.match(q.name) for q in p.iterdir()))


def select_verified(model_dir: Path) -> tuple[Candidate | None, list[str]]:
    """:func:`select_resume` with verification: ``(chosen or None, warnings)``, one warning per
    candidate passed over as corrupt, naming the candidate actually used."""
    chosen, cands = select_resume(model_dir, verify=True)
    return chosen, fallback_warnings(cands, chosen)


def fallback_warnings(cands: list[Candidate], chosen: Candidate | None) -> list[str]:
    """One line per candidate that failed verification, naming what is used instead."""
    instead = f"using {chosen.path} (step {chosen.step}) instead" if chosen else "no other intact candidate"
    return [f"checkpoint {c.path} failed verification ({'; '.join(c.verify_problems)}); {instead}"
            for c in in_resume_order(cands) if c.verify_problems]
