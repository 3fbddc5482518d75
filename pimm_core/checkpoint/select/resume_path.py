"""Resolving a checkpoint the user named (``--train.resume-from PATH``) to one resumable
:class:`~.selection.Candidate`, with one-line errors for what cannot resume (torch-free)."""

from __future__ import annotations

from pathlib import Path

from ..records.foreign import why_not_resumable
from ..records.manifest import COMPLETE, MANIFEST
from .selection import FULL_RE, LEGACY_LAST, RESUME_ORDER, SINGLE_RE, TRAINER_DCP, WEIGHTS, Candidate, _pointer, _standard_dir, _weights_file, explain, is_model_dir, list_candidates, select_resume


def resolve_resume_path(path: str | Path) -> Candidate:
    """Validate an explicit resume source and return it as a candidate.

    ``path`` may be a checkpoint directory (``.../model/last``), a legacy
    ``model_last.pth``, a single-format file or pointer, or a ``model/`` directory (or the
    run directory holding it: its :func:`select_resume` choice).

    Raises:
        CheckpointError: ``hf://`` sources (Hub artifacts carry no trainer state);
            "No weight found" for a path that does not exist; "Incomplete checkpoint
            directory" naming the missing parts and the complete candidates beside it;
            (exit code 2) something pimm did not write, named when recognisable
            (:func:`..records.foreign.why_not_resumable`: an Accelerate ``save_state`` directory,
            a Lightning ``.ckpt``, a Hugging Face model directory, a plain state dict)
            with the warm start to use instead, or "not a PyTorch checkpoint".
    """
    from ...errors import CheckpointError

    text = str(path)
    if text.startswith("hf://"):
        raise CheckpointError(
            f"cannot resume from {text}: Hub model artifacts omit trainer state (no trainer.dcp/); "
            "warm-start a new run with --train.weight instead, or resume from the original run's model/last",
            exit_code=2)
    p = Path(text)
    if not text or not p.exists():
        raise CheckpointError(f"No weight found: {text!r} does not exist; check the run path "
                              "(pimm checkpoints latest MODEL_DIR finds the newest complete checkpoint)", exit_code=2)
    if p.is_dir() and not is_model_dir(p) and is_model_dir(p / "model"):
        p = p / "model"  # a run directory: its model/ directory's choice
    looks_standard = any((p / n).exists() for n in (WEIGHTS, TRAINER_DCP, COMPLETE, MANIFEST))
    if p.is_dir() and not looks_standard:
        if is_model_dir(p):
            chosen, cands = select_resume(p)
            if chosen is None:
                raise CheckpointError(f"no complete checkpoint in {p}: " + "; ".join(explain(cands, None)), exit_code=2)
            return chosen
        if p.name not in RESUME_ORDER and ".tmp" not in p.name and not FULL_RE.match(p.name):
            refusal = why_not_resumable(p) or (
                f"{p} is not a pimm checkpoint directory (it has no {WEIGHTS}, {TRAINER_DCP}/, {MANIFEST} or "
                f"{COMPLETE}); --train.resume-from takes a run's model/last, its model/ directory, model_last.pth "
                "or step_<N>.pth")
            raise CheckpointError(refusal, exit_code=2)
    if p.is_file() and p.name != LEGACY_LAST and not SINGLE_RE.match(p.name):
        refusal = why_not_resumable(p)  # text, Lightning, a plain state dict... (pimm's own files: None)
        if refusal is not None:
            raise CheckpointError(refusal, exit_code=2)
    if p.is_file():
        if p.is_symlink():
            return _pointer(p) if _pointer(p).complete else _raise_incomplete(p, _pointer(p))
        fmt = "legacy" if p.name == LEGACY_LAST else "single" if SINGLE_RE.match(p.name) else "weights"
        cand = _weights_file(p, fmt, resumable=fmt != "weights", fmt=fmt)
        if not cand.resumable:
            raise CheckpointError(f"{p} holds weights only and cannot resume a run; warm-start with --train.weight {p}",
                                  exit_code=2)
        return cand
    cand = _standard_dir(p, "full" if FULL_RE.match(p.name) else p.name)
    if not cand.complete:
        _raise_incomplete(p, cand)
    return cand


def _raise_incomplete(p: Path, cand: Candidate) -> Candidate:
    from ...errors import CheckpointError

    others = [c for c in list_candidates(p.parent) if c.complete and c.resumable and c.path != cand.path]
    alt = ", ".join(c.path for c in others) if others else "none"
    raise CheckpointError(f"Incomplete checkpoint directory {p}: {cand.reason}. Complete candidates: {alt}",
                          exit_code=2)
