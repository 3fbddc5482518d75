"""``hf://`` weight sources: the Hugging Face Hub and its local cache (torch-free).

``hf://org/repo[@rev][/file]`` is downloaded with ``huggingface_hub``; without ``file``
the first of ``model.safetensors``, ``model.bin``, ``weights.pth`` the repository has.
A Hub that does not answer one quick probe fails at once (:class:`HubUnreachableError`)
unless the file is cached; with ``HF_HUB_OFFLINE=1`` only the cache is looked in.
:func:`~pimm_core.checkpoint.weights.sources.resolve_weight_source` sends every ``hf://``
source here; :func:`plan_hf` is the ``--dry-run`` look-up that downloads nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ...errors import HubUnreachableError, UsageError, WeightNotFoundError, first_line
from ..records.foreign import BIN, SAFETENSORS
from ..select.selection import WEIGHTS

HF_PREFIX = "hf://"
HF_DEFAULT_FILES = (SAFETENSORS, BIN, WEIGHTS)

_WARNED: set[str] = set()  # hf:// sources whose cached copy was used with a warning (once per process)


def is_remote(source: str | os.PathLike[str]) -> bool:
    """True for ``hf://`` sources (warm start and export only; they cannot resume a run)."""
    return str(source).startswith(HF_PREFIX)


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


def _offline_message(text: str, names: list[str]) -> str:
    return (f"cannot use {text}: HF_HUB_OFFLINE is set and the local Hugging Face cache has none of "
            f"{', '.join(names)}; download it once with network access (unset HF_HUB_OFFLINE)")


def resolve_hf(text: str) -> Path:
    """Download ``hf://org/repo[@revision][/path/in/repo]`` and return the cached file.

    Offline (``HF_HUB_OFFLINE=1``) only the local cache is looked in. Otherwise one quick
    probe (:func:`hub_unreachable`) comes first: when the Hub does not answer, a cached copy
    is used (with a warning) or :class:`HubUnreachableError` is raised at once.

    Returns:
        The file in the local Hugging Face cache (symlinks resolved).

    Raises:
        UsageError: ``text`` is not of that form.
        HubUnreachableError: not cached, and the Hub is unreachable or ``HF_HUB_OFFLINE`` is set.
        WeightNotFoundError: the Hub answered, but has no such repository, revision or file.
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
        raise HubUnreachableError(_offline_message(text, tried))
    raise WeightNotFoundError(f"No weight found: {text}: the repository has none of {', '.join(tried)}")



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
        UsageError, WeightNotFoundError, HubUnreachableError: as
            :func:`~pimm_core.checkpoint.weights.sources.resolve_weight_source`.
    """
    repo_id, revision, filename = parse_hf(text)
    hub = _hub()
    names = [filename] if filename else list(HF_DEFAULT_FILES)
    cached = _cached_hf(repo_id, names, revision)
    if hub_offline() or cached is not None:
        if cached is None:
            raise HubUnreachableError(_offline_message(text, names))
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
                raise WeightNotFoundError(
                    f"No weight found: {text}: {e.__class__.__name__}: {first_line(e, empty='')}") from None
            local = Path(info.local_path) if getattr(info, "is_cached", False) else None
            return HubFile(name, getattr(info, "file_size", None), local)
    raise WeightNotFoundError(f"No weight found: {text}: the repository has none of {', '.join(tried)}")
