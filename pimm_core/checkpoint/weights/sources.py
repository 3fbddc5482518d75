"""Where weights come from: resolving a weight source to one file (torch-free).

Warm start (``--train.weight``), :func:`~pimm_core.checkpoint.weights.strict_load.load_weights`
and ``pimm export`` all accept the same kinds of *weight source* and go through
:func:`resolve_weight_source`, which turns one into a single file to read:

=====================================  ===========================================
source                                 file read
=====================================  ===========================================
``.../model/last`` (standard dir)      ``last/weights.pth`` (needs ``.complete``); a
                                       sharded save without gathered weights
                                       (manifest ``"weights": "trainer.dcp"``): the
                                       directory ``last/trainer.dcp``
``weights.pth``, ``model_best.pth``,   the file itself
``iter_<step>.pth``, ``model_last.pth``
a single-format file or a ``last`` /   the file (symlinks are followed)
``best`` / ``final`` pointer symlink
an export directory                    ``model.safetensors``, else ``model.bin``
an Accelerate ``save_state`` or a      ``model.safetensors``, else ``pytorch_model.bin``
Hugging Face model directory           (see :mod:`..records.foreign`)
a run directory or its ``model/``      the checkpoint a resume would pick (``last``,
                                       complete ``last.prev``, ``model_last.pth``),
                                       else the ``last``/``final`` pointer
``hf://org/repo[@rev][/file]``         the file in the local Hugging Face cache,
                                       downloaded first when needed (see :mod:`.hub`)
``last`` | ``best`` | ``final`` |      with ``run_dir``: see :func:`resolve_run_checkpoint`
``iter_<step>``
=====================================  ===========================================

Nothing here imports torch; reading the file is :mod:`.read`' job.
"""

from __future__ import annotations

import logging

import os
import re
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, CheckpointParseError, IncompleteCheckpointError, UsageError, WeightNotFoundError
from ...run.layout import model_dir_of
from ...run.status import read_run_status
from ..records.foreign import BIN, EXPORT_FILES, HF_BIN, SAFETENSORS, directory_layout, not_a_checkpoint, sniff
from ..records.generation import wait_for_rotation
from ..records.manifest import COMPLETE, MANIFEST, read_manifest
from ..select.selection import BEST, LEGACY_LAST, POINTERS, TRAINER_DCP, WEIGHTS, select_resume, weights_in_dcp
from .hub import is_remote, resolve_hf

#: ``iter_<step>`` or ``best_<step>`` as a keyword of a run (``.pth`` optional), unlike selection's
#: file-name patterns.
ITER_NAME_RE = re.compile(r"^(iter|best)_(\d+)(?:\.pth)?$")


def resolve_weight_source(path: str | os.PathLike[str], *, run_dir: Path | None = None) -> Path:
    """Turn a weight source (see the module docstring) into the one file to read.

    Args:
        path: a file, a directory, a pointer symlink, ``hf://org/repo[@rev][/file]``, or
            (with ``run_dir``) one of ``last``, ``best``, ``final``, ``iter_<step>``.
        run_dir: a run directory; names the keywords above, and relative paths that do
            not exist from the working directory are also tried under it and under
            its ``model/``.

    Returns:
        The path of an existing regular file (symlinks resolved), or the ``trainer.dcp``
        directory of a standard checkpoint whose weights are only there (see
        :func:`~pimm_core.checkpoint.formats.sharded.read_checkpoint_weights`). For ``hf://`` it
        is the file in the local Hugging Face cache.

    Raises:
        UsageError: ``path`` is empty, or a keyword was given without ``run_dir``.
        WeightNotFoundError: nothing resolves (``No weight found: <path> ...``).
        IncompleteCheckpointError: a standard checkpoint directory without its
            ``weights.pth`` or ``.complete`` marker, or a ``.tmp`` leftover.
    """
    text = os.fspath(path)
    if not text.strip():
        raise UsageError("no weight source given (empty path); pass a checkpoint, an export directory or hf://org/repo")
    if is_remote(text):
        return resolve_hf(text)
    p = Path(text).expanduser()
    shown = text
    if run_dir is not None:
        run_dir = Path(run_dir)
        if text in POINTERS or ITER_NAME_RE.match(text):
            p = resolve_run_checkpoint(run_dir, text)
            shown = f"{text} ({p})"
        elif not p.exists() and not p.is_absolute():
            for base in (run_dir, run_dir / "model"):
                if (base / p).exists():
                    p = base / p
                    break
            else:
                raise WeightNotFoundError(f"No weight found: {text} is not a checkpoint of {run_dir}; "
                                          f"{_names_in_run(run_dir)}")
    elif text in POINTERS or ITER_NAME_RE.match(text):
        if not p.exists():
            raise UsageError(f"{text!r} names a checkpoint of a run; pass --run-dir RUN (or a path to the checkpoint)")
    return _resolve_local(p, shown=shown)


def _names_in_run(run_dir: Path) -> str:
    """What a user may pass for ``run_dir``'s checkpoints, for an error line (names sorted by step)."""
    model = model_dir_of(run_dir)
    try:
        entries = sorted(e.name for e in model.iterdir())
    except OSError:
        entries = []
    names = [n for n in POINTERS if n in entries or (n == "last" and "last.prev" in entries)
             or (n == "best" and "model_best.pth" in entries)]  # (best: model_best.pth first, resolve_run_checkpoint)
    steps = sorted((int(m.group(2)), m.group(0).removesuffix(".pth")) for e in entries if (m := ITER_NAME_RE.match(e)))
    names += [name for _, name in steps]
    if not names:
        return "the run has no checkpoint yet"
    shown = names if len(names) <= 8 else names[:4] + ["..."] + names[-3:]
    return "pass one of: " + ", ".join(shown)


def _resolve_local(p: Path, *, shown: str) -> Path:
    wait_for_rotation(p)  # `last` between a live save's two renames is back in a moment
    if p.is_symlink() and not p.exists():
        raise WeightNotFoundError(f"No weight found: {shown} is a pointer to {os.readlink(p)}, which does not exist")
    if not p.exists():
        raise WeightNotFoundError(f"No weight found: {shown} does not exist; check the run path and checkpoint name")
    real = p.resolve()
    if real.is_file():
        if real.stat().st_size == 0:
            raise WeightNotFoundError(f"No weight found: {shown} is an empty file")
        return real
    if not real.is_dir():
        raise WeightNotFoundError(f"No weight found: {shown} is not a file or directory")
    return _resolve_dir(real, shown=shown)


def _looks_standard(d: Path) -> bool:
    return any((d / n).exists() for n in (WEIGHTS, TRAINER_DCP, MANIFEST, COMPLETE))


def _resolve_dir(d: Path, *, shown: str) -> Path:
    """A standard checkpoint dir, an export dir, a run dir or a model dir -> one file."""
    if d.name.endswith(".tmp"):
        raise IncompleteCheckpointError(
            f"Incomplete checkpoint directory {shown}: a temporary leftover of an interrupted save; "
            "select a complete candidate (`pimm checkpoints ls RUN`)")
    if d.name == TRAINER_DCP and _looks_standard(d.parent):
        return _resolve_dir(d.parent, shown=shown)
    if _looks_standard(d):
        if not (d / WEIGHTS).is_file() and weights_in_dcp(_manifest_of(d)):
            missing = [n for n in (COMPLETE, f"{TRAINER_DCP}/.metadata") if not (d / n).is_file()]
            if missing:
                raise IncompleteCheckpointError(
                    f"Incomplete checkpoint directory {shown}: missing {', '.join(missing)}; select a complete "
                    "candidate (`pimm checkpoints ls RUN`), do not add the marker by hand")
            return d / TRAINER_DCP
        missing = [n for n in (WEIGHTS, COMPLETE) if not (d / n).is_file()]
        # A bare directory holding only weights.pth (copied by hand) is fine.
        only_weights = (d / WEIGHTS).is_file() and not any((d / n).exists() for n in (TRAINER_DCP, MANIFEST, COMPLETE))
        if missing and not only_weights:
            raise IncompleteCheckpointError(
                f"Incomplete checkpoint directory {shown}: missing {', '.join(missing)}; select a complete "
                "candidate (`pimm checkpoints ls RUN`), do not add the marker by hand")
        return d / WEIGHTS
    for name in EXPORT_FILES:
        if (d / name).is_file():
            return d / name
    foreign = directory_layout(d)
    if foreign is not None:  # an Accelerate save_state or Hugging Face directory: its weights file
        if foreign.weights is not None:
            return foreign.weights
        raise WeightNotFoundError(f"No weight found: {shown} is {foreign.what}, but {foreign.note}")
    model_dir = d / "model" if (d / "model").is_dir() else d
    chosen = _model_dir_choice(model_dir)
    if chosen is not None:
        return _resolve_local(chosen, shown=f"{shown} ({chosen.name})")
    raise WeightNotFoundError(
        f"No weight found: {shown} is a directory without weights.pth, {SAFETENSORS}, {BIN}, {HF_BIN} or checkpoints")


def _manifest_of(d: Path) -> dict[str, Any] | None:
    try:
        return read_manifest(d / MANIFEST)
    except (OSError, ValueError):
        return None


def _model_dir_choice(model_dir: Path) -> Path | None:
    """What a directory of checkpoints offers for weights: resume choice, else pointers, else best."""
    last = model_dir / "last"
    if last.is_symlink():
        return last
    chosen, _ = select_resume(model_dir)
    if chosen is not None:
        return Path(chosen.path)
    for p in (model_dir / "final", model_dir / "last", model_dir / BEST, model_dir / "best"):
        if p.exists() or p.is_symlink():
            return p
    return None


def resolve_run_checkpoint(run_dir: Path, name: str) -> Path:
    """The checkpoint of run ``run_dir`` that a keyword names (not yet checked for completeness).

    - ``last``: ``model/last`` (standard directory, or the single-format pointer), else a
      complete ``model/last.prev``, else legacy ``model/model_last.pth``.
    - ``best``: ``model/model_best.pth``, else the ``model/best`` pointer.
    - ``final``: the ``model/final`` pointer; for standard runs, ``model/last`` when
      ``status.json`` says the run finished.
    - ``iter_<step>``: ``model/iter_<step>.pth``; ``best_<step>``: ``model/best_<step>.pth``
      (``checkpoint.keep_best``).

    Raises:
        UsageError: ``run_dir`` does not exist.
        WeightNotFoundError: the run has no such checkpoint (the message says what was looked for).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"--run-dir {run_dir} does not exist or is not a directory; pass exp/<group>/<run>")
    model = model_dir_of(run_dir)
    if name == "last":
        last = model / "last"
        wait_for_rotation(last)
        if last.is_symlink() or last.is_dir():
            if last.is_dir() and not (last / COMPLETE).is_file():
                chosen, _ = select_resume(model)
                if chosen is not None:
                    return Path(chosen.path)
            return last
        chosen, _ = select_resume(model)
        if chosen is not None:
            return Path(chosen.path)
        if (model / LEGACY_LAST).exists():
            return model / LEGACY_LAST
        raise WeightNotFoundError(f"No weight found: last: {model} has no last/, last pointer or {LEGACY_LAST}")
    if name == "best":
        for p in (model / BEST, model / "best"):
            if p.exists() or p.is_symlink():
                return p
        raise WeightNotFoundError(
            f"No weight found: best: {model} has no {BEST} or best pointer (was an evaluator configured?)")
    if name == "final":
        final = model / "final"
        if final.exists() or final.is_symlink():
            return final
        state = read_run_status(run_dir).state
        if (model / "last").is_dir() and state == "finished":
            return model / "last"
        raise WeightNotFoundError(
            f"No weight found: final: {model} has no final pointer and the run has not finished "
            f"(status.json state: {state or 'unknown'}); use `last`")
    m = ITER_NAME_RE.match(name)
    if m:
        p = model / f"{m.group(1)}_{m.group(2)}.pth"
        if p.exists():
            return p
        have = sorted(x.name for x in model.glob(f"{m.group(1)}_*.pth")) if model.is_dir() else []
        raise WeightNotFoundError(
            f"No weight found: {name}: {p} does not exist (snapshots here: {', '.join(have) or 'none'})")
    return Path(name)


def check_weight_source(source: str | os.PathLike[str], *, run_dir: Path | None = None,
                        storage_options: dict[str, Any] | None = None) -> Path | str:
    """Resolve a warm-start source (downloading ``hf://``) and refuse a file that is not a
    PyTorch checkpoint, before anything is created (torch-free; ``pimm launch`` calls it
    before the run directory exists).

    A remote source (``s3://``...) is looked up and its first bytes read, nothing downloaded
    (:func:`~pimm_core.checkpoint.remote.source.check_remote_source`).

    Returns:
        The file a warm start will read (for a remote source: its URL).

    Raises:
        as :func:`resolve_weight_source` (and, for a remote source, as
        :func:`~pimm_core.checkpoint.remote.source.plan_remote`); CheckpointParseError: the
        file is not a PyTorch checkpoint (text, random bytes...; exit code 2).
    """
    from ..remote.source import check_remote_source, is_store_url

    if is_store_url(source):
        plan = check_remote_source(os.fspath(source), storage_options)
        return plan.url
    path = resolve_weight_source(source, run_dir=run_dir)
    if path.is_dir():  # a sharded checkpoint's trainer.dcp/: read through DCP's metadata, checked there
        return path
    try:
        sniffed = sniff(path)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    if sniffed.not_a_checkpoint:
        raise CheckpointParseError(not_a_checkpoint(path, sniffed.describe()))
    return path


def checkpoint_record(source: Path) -> dict[str, Any]:
    """The manifest describing a weight file: ``manifest.json`` beside it, else the ``<file>.json`` sidecar.

    Returns:
        The manifest dict (``step``, ``epoch``, ``metrics``...), or ``{}`` when there is none
        or it is unreadable.
    """
    source = Path(source)
    for cand in (source.with_name(source.name + ".json"), source.parent / MANIFEST):
        if cand.is_file():
            try:
                return read_manifest(cand)
            except (OSError, ValueError) as e:
                logging.getLogger("pimm").warning("warning: %s is unusable (%s): its step, epoch and metrics are "
                                                  "not known", cand, e)
                return {}
    return {}
