"""Where weights come from: resolving a weight source to one file (torch-free).

Warm start (``--train.weight``), :func:`~pimm_core.checkpoint.weights.load_weights`
and ``pimm export`` all accept the same kinds of *weight source* and go through
:func:`resolve_weight_source`, which turns one into a single file to read:

=====================================  ===========================================
source                                 file read
=====================================  ===========================================
``.../model/last`` (standard dir)      ``last/weights.pth`` (needs ``.complete``)
``weights.pth``, ``model_best.pth``,   the file itself
``iter_<step>.pth``, ``model_last.pth``
a single-format file or a ``last`` /   the file (symlinks are followed)
``best`` / ``final`` pointer symlink
an export directory                    ``model.safetensors``, else ``model.bin``
an Accelerate ``save_state`` or a      ``model.safetensors``, else ``pytorch_model.bin``
Hugging Face model directory           (see :mod:`.foreign`)
a run directory or its ``model/``      the checkpoint a resume would pick (``last``,
                                       complete ``last.prev``, ``model_last.pth``),
                                       else the ``last``/``final`` pointer
``hf://org/repo[@rev][/file]``         downloaded with ``huggingface_hub``; without
                                       ``file``: ``model.safetensors``, then
                                       ``model.bin``, then ``weights.pth``. A Hub that
                                       does not answer one quick probe fails at once
                                       (:class:`HubUnreachableError`) unless the file
                                       is cached; ``HF_HUB_OFFLINE=1``: the cache only
``last`` | ``best`` | ``final`` |      with ``run_dir``: see :func:`resolve_run_checkpoint`
``iter_<step>``
=====================================  ===========================================

Nothing here imports torch; reading the file is :mod:`.weights`' job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CheckpointParseError, UsageError, first_line
from ..run.layout import model_dir_of
from ..run.status import read_run_status
from .foreign import directory_layout, not_a_checkpoint, sniff
from .manifest import COMPLETE, MANIFEST, read_manifest
from .selection import BEST, LEGACY_LAST, TRAINER_DCP, WEIGHTS, select_resume

HF_PREFIX = "hf://"
SAFETENSORS = "model.safetensors"
BIN = "model.bin"
HF_BIN = "pytorch_model.bin"
EXPORT_FILES = (SAFETENSORS, BIN)
HF_DEFAULT_FILES = (SAFETENSORS, BIN, WEIGHTS)
POINTERS = ("last", "best", "final")
ITER_NAME_RE = re.compile(r"^iter_(\d+)(?:\.pth)?$")


class WeightNotFoundError(CheckpointError):
    """A non-empty weight source does not resolve to a file (exit code 2).

    The message starts with ``No weight found:`` and names the source.
    """

    exit_code = 2


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint directory lacks a required part (exit code 2).

    The message starts with ``Incomplete checkpoint directory`` and names what is missing.
    """

    exit_code = 2


def is_remote(source: str | os.PathLike[str]) -> bool:
    """True for ``hf://`` sources (warm start and export only; they cannot resume a run)."""
    return str(source).startswith(HF_PREFIX)


def resolve_weight_source(path: str | os.PathLike[str], *, run_dir: Path | None = None) -> Path:
    """Turn a weight source (see the module docstring) into the one file to read.

    Args:
        path: a file, a directory, a pointer symlink, ``hf://org/repo[@rev][/file]``, or
            (with ``run_dir``) one of ``last``, ``best``, ``final``, ``iter_<step>``.
        run_dir: a run directory; names the keywords above, and relative paths that do
            not exist from the working directory are also tried under it and under
            its ``model/``.

    Returns:
        The path of an existing regular file (symlinks resolved). For ``hf://`` it is
        the file in the local Hugging Face cache.

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
        return _resolve_hf(text)
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
    elif text in POINTERS or ITER_NAME_RE.match(text):
        if not p.exists():
            raise UsageError(f"{text!r} names a checkpoint of a run; pass --run-dir RUN (or a path to the checkpoint)")
    return _resolve_local(p, shown=shown)


def _resolve_local(p: Path, *, shown: str) -> Path:
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
    if _looks_standard(d):
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
    - ``iter_<step>``: ``model/iter_<step>.pth``.

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
        p = model / f"iter_{m.group(1)}.pth"
        if p.exists():
            return p
        have = sorted(x.name for x in model.glob("iter_*.pth")) if model.is_dir() else []
        raise WeightNotFoundError(
            f"No weight found: {name}: {p} does not exist (snapshots here: {', '.join(have) or 'none'})")
    return Path(name)


class HubUnreachableError(CheckpointError):
    """An ``hf://`` file is not in the local cache and the Hub cannot be asked for it (exit code 1).

    Either the Hub (``HF_ENDPOINT``) did not answer one quick probe, or ``HF_HUB_OFFLINE=1``
    forbids asking it. The message says which, and what to do.
    """

    exit_code = 1


def parse_hf(text: str) -> tuple[str, str | None, str]:
    """``hf://org/repo[@revision][/path/in/repo]`` -> ``(repo_id, revision or None, path or "")``.

    Raises:
        UsageError: not of that form.
    """
    rest = text[len(HF_PREFIX):].strip("/")
    parts = rest.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise UsageError(f"{text} is not a Hub source; use hf://org/repo or hf://org/repo/file")
    repo_id, revision = f"{parts[0]}/{parts[1]}", None
    if "@" in parts[1]:
        name, revision = parts[1].split("@", 1)
        repo_id = f"{parts[0]}/{name}"
    return repo_id, revision or None, "/".join(parts[2:])


def _hub():
    try:
        import huggingface_hub
    except ImportError:  # pragma: no cover - a declared dependency
        raise UsageError("hf:// sources need the huggingface_hub package (uv add huggingface_hub)") from None
    return huggingface_hub


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set: only the local cache may be used."""
    _hub()
    from huggingface_hub import constants

    return constants.is_offline_mode()


def hub_unreachable() -> str | None:
    """Why the Hub (``HF_ENDPOINT``) cannot be reached, from one request; None when it answers.

    Any HTTP answer counts as reachable. The request waits at most ``HF_HUB_ETAG_TIMEOUT``
    seconds (default 10), once: huggingface_hub itself retries a failed connection with
    back-off for about 25 s per file, which is what this probe spares.
    """
    _hub()
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    timeout = float(min(constants.HF_HUB_ETAG_TIMEOUT, 10))
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as e:  # a connection refused or timed out, DNS, proxy, TLS
        return f"{e.__class__.__name__}: {first_line(e, empty='')}".rstrip(": ")
    return None


@contextlib.contextmanager
def _quiet_hub():
    """Hold huggingface_hub's own warnings (retry notices) back; pimm says what went wrong."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _unreachable_message(text: str, problem: str) -> str:
    from huggingface_hub import constants

    return (f"cannot download {text}: the Hugging Face Hub at {constants.ENDPOINT} is unreachable "
            f"({problem}); check the network (or HF_ENDPOINT / HTTPS_PROXY), or set HF_HUB_OFFLINE=1 to use "
            "files already in the local Hugging Face cache")


def _resolve_hf(text: str) -> Path:
    """Download ``hf://org/repo[@revision][/path/in/repo]`` and return the cached file.

    Offline (``HF_HUB_OFFLINE=1``) only the local cache is looked in. Otherwise one quick
    probe (:func:`hub_unreachable`) comes first: when the Hub does not answer, a cached copy
    is used (with a warning) or :class:`HubUnreachableError` is raised at once.
    """
    repo_id, revision, filename = parse_hf(text)
    hub = _hub()
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    names = [filename] if filename else list(HF_DEFAULT_FILES)
    offline = hub_offline()
    if not offline:
        problem = hub_unreachable()
        if problem is not None:
            cached = _cached_hf(repo_id, names, revision)
            if cached is None:
                raise HubUnreachableError(_unreachable_message(text, problem))
            if text not in _WARNED:  # once per process (the launch checks the source, then the trainer reads it)
                _WARNED.add(text)
                logging.getLogger("pimm").warning("warning: the Hugging Face Hub is unreachable (%s); using the "
                                                  "cached %s of %s", problem, cached.name, text)
            return cached
    tried: list[str] = []
    with _quiet_hub():
        for name in names:
            try:
                local = hub.hf_hub_download(repo_id, name, revision=revision)
            except LocalEntryNotFoundError as e:  # not in the cache, and the Hub was not (or no longer) asked
                if offline:
                    tried.append(name)
                    continue
                raise HubUnreachableError(_unreachable_message(text, f"{e.__class__.__name__}")) from None
            except EntryNotFoundError:  # the Hub answered: the repository has no such file
                tried.append(name)
                continue
            except Exception as e:  # auth, unknown repo or revision
                raise WeightNotFoundError(
                    f"No weight found: {text}: {e.__class__.__name__}: {first_line(e, empty='')}") from None
            return Path(local).resolve()
    if offline:
        raise HubUnreachableError(
            f"cannot use {text}: HF_HUB_OFFLINE is set and the local Hugging Face cache has none of "
            f"{', '.join(tried)}; download it once with network access (unset HF_HUB_OFFLINE)")
    raise WeightNotFoundError(f"No weight found: {text}: the repository has none of {', '.join(tried)}")


_WARNED: set[str] = set()


def _cached_hf(repo_id: str, names: list[str], revision: str | None) -> Path | None:
    """The first of ``names`` in the local Hugging Face cache, without any request."""
    hub = _hub()
    with _quiet_hub():
        for name in names:
            try:
                found = hub.try_to_load_from_cache(repo_id, name, revision=revision)
            except Exception:
                continue
            if isinstance(found, str):
                return Path(found).resolve()
    return None


@dataclass
class HubFile:
    """What a warm start from ``hf://`` would read (:func:`plan_hf`, for ``--dry-run``).

    Attributes:
        name: the file in the repository.
        size: its size in bytes, when known.
        local: the cached copy, when there is one (then nothing is downloaded).
    """

    name: str
    size: int | None
    local: Path | None


def plan_hf(text: str) -> HubFile:
    """Find the file an ``hf://`` source names without downloading it (for ``--dry-run``).

    Raises:
        UsageError, WeightNotFoundError, HubUnreachableError: as :func:`resolve_weight_source`.
    """
    repo_id, revision, filename = parse_hf(text)
    hub = _hub()
    names = [filename] if filename else list(HF_DEFAULT_FILES)
    cached = _cached_hf(repo_id, names, revision)
    if hub_offline() or cached is not None:
        if cached is None:
            raise HubUnreachableError(
                f"cannot use {text}: HF_HUB_OFFLINE is set and the local Hugging Face cache has none of "
                f"{', '.join(names)}; download it once with network access (unset HF_HUB_OFFLINE)")
        return HubFile(cached.name, cached.stat().st_size, cached)
    problem = hub_unreachable()
    if problem is not None:
        raise HubUnreachableError(_unreachable_message(text, problem))
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    tried = []
    with _quiet_hub():
        for name in names:
            try:
                info = hub.hf_hub_download(repo_id, name, revision=revision, dry_run=True)
            except LocalEntryNotFoundError as e:
                raise HubUnreachableError(_unreachable_message(text, e.__class__.__name__)) from None
            except EntryNotFoundError:
                tried.append(name)
                continue
            except Exception as e:
                raise WeightNotFoundError(f"No weight found: {text}: {e.__class__.__name__}: {first_line(e, empty='')}") from None
            local = Path(info.local_path) if getattr(info, "is_cached", False) else None
            return HubFile(name, getattr(info, "file_size", None), local)
    raise WeightNotFoundError(f"No weight found: {text}: the repository has none of {', '.join(tried)}")


def check_weight_source(source: str | os.PathLike[str], *, run_dir: Path | None = None) -> Path:
    """Resolve a warm-start source (downloading ``hf://``) and refuse a file that is not a
    PyTorch checkpoint, before anything is created (torch-free; ``pimm launch`` calls it
    before the run directory exists).

    Returns:
        The file a warm start will read.

    Raises:
        as :func:`resolve_weight_source`; CheckpointParseError: the file is not a PyTorch
        checkpoint (text, random bytes...; exit code 2).
    """
    path = resolve_weight_source(source, run_dir=run_dir)
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
            except (OSError, ValueError):
                return {}
    return {}
