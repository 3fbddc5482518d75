"""Weight sources on a remote store: ``s3://``, ``gs://``... (any fsspec URL but ``hf://``), torch-free.

``--train.weight``, ``pimm export`` and :func:`~pimm_core.checkpoint.weights.strict_load.load_weights`
accept a URL wherever they accept a local path. :func:`plan_remote` finds what the URL names
without downloading (``--dry-run`` and the launch's check); :func:`local_copy` downloads it
into a fresh temporary directory of pimm's own (``$TMPDIR/pimm-remote-*``, removed when the
reading is done, or by a later download when a kill cut this one short: :mod:`..records.scratch`), checks it, and hands the local copy to the local resolver, so the same
rules apply as for a local source:

===========================================  ==================================================
URL names                                    downloaded and checked
===========================================  ==================================================
``.../step_<N>/`` (a standard checkpoint,    ``weights.pth`` (or, for a sharded save without
as ``checkpoint.remote`` uploads it), or     gathered weights, ``trainer.dcp/``) and
its ``weights.pth``                          ``manifest.json``; each file's sha256 against the
                                             manifest. Without ``.complete`` (written last):
                                             refused
``model_best.pth``, ``iter_<step>.pth``      the file and its sidecar ``<name>.json`` (written
                                             last): sha256 against it. Without it: refused
an export directory (``export.json``)        the weight files ``export.json`` lists, their
                                             sha256 against it; the training config
                                             (``config.json``, or ``pimm_config.json``) without
                                             ``export.json`` is an export cut short: refused
any other file (``.pth``, ``.safetensors``)  the file (checked against a sidecar when it has one)
a directory with ``model.safetensors`` /     that file (``config.json`` beside it)
``pytorch_model.bin`` / ``model.bin``
a run's ``model/`` prefix (``step_<N>/``     the newest complete ``step_<N>/``
inside), or the run prefix above it
===========================================  ==================================================

Errors are one line: a key that does not exist is :class:`~pimm_core.errors.WeightNotFoundError`
(exit 2), a candidate without its marker :class:`~pimm_core.errors.IncompleteCheckpointError`
(exit 2), a store that cannot be reached or read (network, credentials, a missing ``s3fs``)
:class:`~pimm_core.errors.RemoteStoreError` (exit 1).
"""

from __future__ import annotations

import contextlib
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ...errors import IncompleteCheckpointError, PimmError, RemoteStoreError, UsageError, WeightNotFoundError, first_line
from ...faults import point, register
from ..records.foreign import EXPORT_FILES
from ..records.manifest import COMPLETE, MANIFEST
from ..records.outputs import CONFIG_JSON, EXPORT_JSON, PIMM_CONFIG_JSON
from ..records.scratch import owned_temp_dir
from ..select.selection import BEST, ITER_RE, TRAINER_DCP, WEIGHTS
from .store import STEP_RE, remote_candidates

register("remote.file_downloaded")

_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_HF = "hf://"
_STANDARD_MARKS = (WEIGHTS, MANIFEST, COMPLETE, TRAINER_DCP)


def is_store_url(source: object) -> bool:
    """True for a URL with a scheme (``s3://``, ``gs://``, ``memory://``...) other than ``hf://``."""
    text = str(source)
    return bool(_SCHEME_RE.match(text)) and not text.startswith(_HF)


def store_error(url: str, e: BaseException, doing: str = "read") -> PimmError:
    """The one-line error for a store exception: a missing key is not found (exit 2), a URL
    whose scheme fsspec does not know is bad input (exit 2), anything else (network,
    credentials, a missing filesystem package) a failed operation (exit 1)."""
    if isinstance(e, PimmError):
        return e
    text = first_line(e)
    if isinstance(e, FileNotFoundError):
        return WeightNotFoundError(f"No weight found: {url} does not exist on the store ({text})")
    if isinstance(e, ValueError) and "protocol" in text.lower():
        return UsageError(f"{url}: {text}; use a URL fsspec knows (s3://, gs://, az://...) or a local path")
    if isinstance(e, ImportError):
        return RemoteStoreError(f"cannot {doing} {url}: {text}")
    return RemoteStoreError(
        f"cannot {doing} {url}: {type(e).__name__}: {text}; check that the store is reachable and its "
        "credentials (for s3://: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, AWS_ENDPOINT_URL)")


@contextlib.contextmanager
def store_errors(url: str, doing: str = "read") -> Iterator[None]:
    """Turn the store's own exceptions (botocore, aiohttp, OSError...) into :func:`store_error`."""
    try:
        yield
    except PimmError:
        raise
    except Exception as e:
        raise store_error(url, e, doing) from None


def open_url(url: str, options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``(filesystem, path without protocol)`` of ``url``; credentials and endpoint come from the
    filesystem's own configuration, ``options`` are its storage options.

    Raises:
        UsageError, RemoteStoreError: as :func:`store_error`.
    """
    import fsspec

    with store_errors(url, "open"):
        fs, path = fsspec.core.url_to_fs(url, **(options or {}))
    return fs, path.rstrip("/")


def options_for(url: str, remote: str, remote_options: dict[str, Any] | None) -> dict[str, Any] | None:
    """The storage options for ``url``: ``checkpoint.remote_options`` when ``url`` is on the
    same kind of store as ``checkpoint.remote`` (same scheme), else None (the filesystem's own
    configuration alone)."""
    same = remote and url.split("://", 1)[0] == remote.split("://", 1)[0]
    return remote_options if same else None


@dataclass
class RemotePlan:
    """What a remote weight source names (:func:`plan_remote`).

    Attributes:
        url: the source as given.
        what: one phrase for messages (``standard checkpoint step_90``...).
        base: the store path (no protocol) of the directory ``files`` are relative to.
        local: the name of the local copy under the download directory that the local
            resolver reads (a directory's or a file's name).
        files: ``{relative path: size in bytes}`` to download (under ``base``).
        check: ``{relative path: {"size", "sha256"}}`` the downloads are checked against.
        checked_by: the record ``check`` comes from (``manifest.json``, a sidecar,
            ``export.json``), or ``""``: nothing to check against.
        extra: ``{relative path: bytes}`` written beside the downloads (the manifest and
            ``.complete`` of a standard checkpoint, a sidecar) so the local copy is complete.
    """

    url: str
    what: str
    base: str
    local: str
    files: dict[str, int] = field(default_factory=dict)
    check: dict[str, dict[str, Any]] = field(default_factory=dict)
    checked_by: str = ""
    extra: dict[str, bytes] = field(default_factory=dict)
    protocol: str = ""

    @property
    def size(self) -> int:
        return sum(self.files.values())

    def url_for(self, copy: Path, resolved: Path) -> str:
        """The URL of the remote file whose local copy is ``resolved`` (inside ``copy``, what
        :func:`download` returned): what messages and records name instead of the temporary path."""
        try:
            rel = Path(resolved).relative_to(copy).as_posix() if copy.is_dir() else copy.name
        except ValueError:
            return self.url
        return self.file_url(rel)

    def file_url(self, rel: str) -> str:
        """The URL of ``rel`` under :attr:`base`."""
        base = f"{self.protocol}://{self.base}" if self.protocol else self.base
        return f"{base}/{rel}" if rel not in ("", ".") else base

    def describe(self) -> str:
        checked = f", sha256 checked against {self.checked_by}" if self.checked_by else ", nothing to check it against"
        return f"{self.what} ({len(self.files)} file(s), {self.size:,} bytes{checked})"


def plan_remote(url: str, options: dict[str, Any] | None = None) -> tuple[Any, RemotePlan]:
    """Find what ``url`` names on its store, without downloading weights (see the module docstring).

    Returns:
        ``(filesystem, plan)``.

    Raises:
        WeightNotFoundError: no such key, or nothing usable under it (exit 2).
        IncompleteCheckpointError: a checkpoint without its marker, an export without
            ``export.json`` (exit 2).
        RemoteStoreError: the store cannot be reached or read (exit 1).
    """
    fs, path = open_url(url, options)
    protocol = url.split("://", 1)[0]
    with store_errors(url):
        fs.invalidate_cache()
        info = fs.info(path)
        if info.get("type") == "directory":
            plan = _plan_dir(fs, url, path, _listing(fs, path))
        else:
            plan = _plan_file(fs, url, path, int(info.get("size") or 0))
    plan.protocol = protocol
    return fs, plan


def _listing(fs: Any, path: str) -> dict[str, dict[str, Any]]:
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in fs.ls(path, detail=True)}


def _plan_file(fs: Any, url: str, path: str, size: int) -> RemotePlan:
    parent, name = path.rsplit("/", 1) if "/" in path else ("", path)
    if name == WEIGHTS:  # inside a standard checkpoint: the directory's rules (its marker)
        listing = _listing(fs, parent)
        if MANIFEST in listing or COMPLETE in listing or STEP_RE.match(parent.rsplit("/", 1)[-1]):
            return _plan_standard(fs, url, parent, listing)
    plan = RemotePlan(url, f"weights file {name}", parent, name, files={name: size})
    side = f"{path}.json"
    candidate = name == BEST or bool(ITER_RE.match(name))
    if fs.exists(side):
        record = _json(fs, side)
        want = (record.get("files") or {}).get(name) if isinstance(record, dict) else None
        if isinstance(want, dict) and "sha256" in want:
            plan.check, plan.checked_by, plan.extra = {name: want}, f"{name}.json", {f"{name}.json": json.dumps(
                record).encode()}
            return plan
    if candidate:
        raise IncompleteCheckpointError(
            f"Incomplete remote checkpoint {url}: its sidecar {name}.json, written last when an upload completes, "
            "is missing or unreadable (an upload cut short or still running); choose a complete candidate "
            "(`pimm checkpoints ls RUN` lists the remote ones)")
    return plan


def _plan_dir(fs: Any, url: str, path: str, listing: dict[str, dict[str, Any]]) -> RemotePlan:
    name = path.rsplit("/", 1)[-1]
    if STEP_RE.match(name) or any(m in listing for m in _STANDARD_MARKS):
        return _plan_standard(fs, url, path, listing)
    if EXPORT_JSON in listing:
        return _plan_export(fs, url, path, listing)
    if PIMM_CONFIG_JSON in listing or (CONFIG_JSON in listing and _is_training_config(fs, f"{path}/{CONFIG_JSON}")):
        raise IncompleteCheckpointError(
            f"Incomplete export {url}: no {EXPORT_JSON}, which an export writes last (an export cut short or "
            "still running); export again")
    for weights in EXPORT_FILES:
        if weights in listing and listing[weights].get("type") != "directory":
            files = {weights: int(listing[weights].get("size") or 0)}
            if CONFIG_JSON in listing:
                files[CONFIG_JSON] = int(listing[CONFIG_JSON].get("size") or 0)
            return RemotePlan(url, f"model directory ({weights})", path, name, files=files)
    model = f"{path}/model" if "model" in listing else path
    cands = [c for c in remote_candidates(fs, model) if c.kind == "standard"]
    done = [c for c in cands if c.complete]
    if done:
        return _plan_standard(fs, url, f"{model}/{done[0].name}", _listing(fs, f"{model}/{done[0].name}"))
    if cands:
        raise IncompleteCheckpointError(
            f"Incomplete remote checkpoints under {url}: {', '.join(c.name for c in cands)} lack their .complete "
            "marker (written last when an upload completes); none can be used")
    raise WeightNotFoundError(
        f"No weight found: {url} is a directory on the store without {WEIGHTS}, {', '.join(EXPORT_FILES)} or "
        "step_<N>/ checkpoints")


def _plan_standard(fs: Any, url: str, path: str, listing: dict[str, dict[str, Any]]) -> RemotePlan:
    name = path.rsplit("/", 1)[-1]
    if COMPLETE not in listing or MANIFEST not in listing:
        missing = ", ".join(n for n in (MANIFEST, COMPLETE) if n not in listing)
        raise IncompleteCheckpointError(
            f"Incomplete remote checkpoint {url}: missing {missing} (the marker is written last, after every file "
            "was uploaded and checked: an upload cut short or still running); choose a complete candidate "
            "(`pimm checkpoints ls RUN` lists the remote ones)")
    manifest = _json(fs, f"{path}/{MANIFEST}")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise IncompleteCheckpointError(f"Incomplete remote checkpoint {url}: its {MANIFEST} has no files table")
    # a warm start or an export needs the weights only, not the optimizer state
    need = [WEIGHTS] if WEIGHTS in files else [r for r in files if r.startswith(f"{TRAINER_DCP}/")]
    return RemotePlan(url, f"standard checkpoint {name} (step {manifest.get('step')})", path, name,
                      files={r: int(files[r].get("size") or 0) for r in need},
                      check={r: files[r] for r in need}, checked_by=MANIFEST,
                      extra={MANIFEST: json.dumps(manifest).encode(), COMPLETE: b""})


def _plan_export(fs: Any, url: str, path: str, listing: dict[str, dict[str, Any]]) -> RemotePlan:
    name = path.rsplit("/", 1)[-1]
    record = _json(fs, f"{path}/{EXPORT_JSON}")
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or not files:
        raise IncompleteCheckpointError(f"Incomplete export {url}: its {EXPORT_JSON} lists no files")
    plan = RemotePlan(url, f"export {name}", path, name, files={f: int(w.get("size") or 0) for f, w in files.items()},
                      check=dict(files), checked_by=EXPORT_JSON, extra={EXPORT_JSON: json.dumps(record).encode()})
    if CONFIG_JSON in listing:  # a library model's own config, which from_pretrained reads
        plan.files[CONFIG_JSON] = int(listing[CONFIG_JSON].get("size") or 0)
    return plan


def _is_training_config(fs: Any, path: str) -> bool:
    """The ``config.json`` at ``path`` is a pimm export's training config (its ``train`` and
    ``model`` tables), not a library model's own config."""
    try:
        data = _json(fs, path)
    except OSError:
        return False
    return isinstance(data, dict) and isinstance(data.get("train"), dict) and isinstance(data.get("model"), dict)


def _json(fs: Any, path: str) -> Any:
    try:
        return json.loads(fs.cat_file(path))
    except ValueError:
        return None


def download(fs: Any, plan: RemotePlan, into: Path) -> Path:
    """Download ``plan``'s files under ``into/<plan.local>`` and check them; returns the local copy
    (a file or a directory) for the local resolver.

    Raises:
        RemoteStoreError: the store failed, or a downloaded file does not match its record.
    """
    from ..records.manifest import verify_files

    single = plan.local in plan.files  # a file: it sits right under `into`
    root = into if single else into / plan.local
    root.mkdir(parents=True, exist_ok=True)

    def get(rel: str) -> None:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{plan.base}/{rel}", str(root / rel))
        point("remote.file_downloaded", root / rel)

    with store_errors(plan.url, "download"), ThreadPoolExecutor(4, thread_name_prefix="pimm-download") as pool:
        for f in [pool.submit(get, rel) for rel in plan.files]:
            f.result()
    problems = verify_files(root, plan.check)
    if problems:
        raise RemoteStoreError(f"{plan.url} was downloaded but does not match its {plan.checked_by}: "
                               f"{'; '.join(problems)}; the remote copy is damaged, or was replaced while it was read")
    for rel, data in plan.extra.items():
        (root / rel).write_bytes(data)
    return root / plan.local if single else root


def check_remote_source(url: str, options: dict[str, Any] | None = None) -> RemotePlan:
    """What the launch checks of a remote warm-start source before it creates anything: it
    exists, is complete (:func:`plan_remote`), and its weight file's first bytes are those of a
    PyTorch or safetensors file (only those bytes are read).

    Raises:
        as :func:`plan_remote`; CheckpointParseError: the file is not a checkpoint (exit 2).
    """
    from ...errors import CheckpointParseError
    from ..records.foreign import not_a_checkpoint, sniff

    fs, plan = plan_remote(url, options)
    first = next((f for f in plan.files if not f.endswith(".json")), None)  # not an index or a config
    if first is None or first.startswith(f"{TRAINER_DCP}/"):
        return plan  # sharded: DCP's metadata is read at load
    with store_errors(url):
        head = fs.cat_file(f"{plan.base}/{first}", start=0, end=4096)
    if head.startswith(b"PK"):
        return plan  # a torch zip: its pickle is checked when it is read
    with owned_temp_dir("pimm-remote-") as tmp:
        (tmp / "head").write_bytes(head)
        sniffed = sniff(tmp / "head")
    if sniffed.not_a_checkpoint:
        raise CheckpointParseError(not_a_checkpoint(plan.file_url(first), sniffed.describe()))
    return plan


#: Copies already downloaded in this process (by the first rank of a node, for all its ranks:
#: :func:`~pimm_core.train.remote_weight.node_copy`), used by :func:`local_copy` instead of a download.
_SHARED: dict[str, tuple[Path, RemotePlan]] = {}


@contextlib.contextmanager
def shared_copy(url: str, copy: Path, plan: RemotePlan) -> Iterator[None]:
    """While inside, :func:`local_copy` of ``url`` yields ``(copy, plan)`` (downloaded and checked
    by someone else, who also removes it) instead of downloading again."""
    _SHARED[url] = (copy, plan)
    try:
        yield
    finally:
        _SHARED.pop(url, None)


@contextlib.contextmanager
def local_copy(url: str, options: dict[str, Any] | None = None) -> Iterator[tuple[Path, RemotePlan]]:
    """Download the remote weight source ``url`` into a fresh temporary directory
    (``$TMPDIR/pimm-remote-*``), checked; yields ``(local copy, plan)``; the directory is removed
    on exit, whatever happened (after a kill: by the next download, :mod:`..records.scratch`). (Inside :func:`shared_copy` of ``url``: that copy, no download.)

    Raises:
        as :func:`plan_remote` and :func:`download`.
    """
    if url in _SHARED:
        yield _SHARED[url]
        return
    fs, plan = plan_remote(url, options)
    with owned_temp_dir("pimm-remote-") as into:
        yield download(fs, plan, into), plan
