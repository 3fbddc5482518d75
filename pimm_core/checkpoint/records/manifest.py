"""``manifest.json``: the torch-free record of a checkpoint.

A manifest lets scripts, ``pimm checkpoints`` and the console describe and verify
a checkpoint without importing torch. Schema (``manifest_version`` 1)::

    {
      "manifest_version": 1,
      "format": "standard",            # standard | legacy | single
      "kind": "last",                  # last | best | iter
      "step": 120, "epoch": 3, "iter": 0,   # next batch to run: epoch, iteration in epoch
      "world_size": 2, "workers_per_rank": 0,
      "metrics": {"val/acc": 0.97},
      "selection_metric": {"name": "val/acc", "value": 0.97, "mode": "max", "split": "val", "epoch": 2},
      "created": "2026-11-29T12:00:00+00:00",
      "torch_version": "2.15.0", "code_version": "abc123",
      "files": {"weights.pth": {"size": 123, "sha256": "..."}, ...}
    }

Paths in ``files`` are relative to the checkpoint directory (or, for a single-file
checkpoint with a sidecar manifest, the file's directory).

:func:`read_manifest` is the one place a manifest is read, and it checks this schema:
``step``, ``epoch``, ``iter`` and ``files`` are required, and every known field has its
type (unknown fields are kept, for newer writers). A manifest that fails is a
:class:`ManifestError` whose message says what is wrong; selection makes it the
candidate's reason (``invalid manifest: ...``) and passes over the candidate.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

from ...fsio import atomic_write_bytes

MANIFEST = "manifest.json"
COMPLETE = ".complete"
MANIFEST_VERSION = 1


def sha256_file(path: Path, bufsize: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def describe_files(root: Path, exclude: tuple[str, ...] = (MANIFEST, COMPLETE),
                   known: dict[tuple[int, int], dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every regular file under ``root`` (relative POSIX paths).

    Args:
        exclude: relative paths to leave out.
        known: ``{(st_dev, st_ino): {"size", "sha256"}}`` already computed while the files
            were written (:class:`~pimm_core.checkpoint.publish.follow.FollowingHasher`); a file
            whose inode and size match is not read again.
    """
    files = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in sorted(names):
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if rel in exclude:
                continue
            st = p.stat()
            hashed = (known or {}).get((st.st_dev, st.st_ino))
            if hashed is not None and hashed["size"] == st.st_size:
                files[rel] = dict(hashed)
            else:
                files[rel] = {"size": st.st_size, "sha256": sha256_file(p)}
    return dict(sorted(files.items()))


def write_manifest(path: Path, record: dict[str, Any], *, durable: bool = True) -> None:
    """Write ``record`` (plus ``manifest_version``) as pretty JSON, atomically and (``durable``)
    durably; ``durable=False`` for a manifest inside a checkpoint's unpublished ``<name>.tmp/``,
    whose files are fsynced together before it is renamed into place."""
    record = {"manifest_version": MANIFEST_VERSION, **record}
    atomic_write_bytes(path, (json.dumps(record, indent=2, sort_keys=False) + "\n").encode(), durable=durable)


class ManifestError(ValueError):
    """A manifest is not JSON, or not the schema above; the message says what is wrong
    (``files is a list, not a mapping``), without the path."""


def read_manifest(path: Path) -> dict[str, Any]:
    """Read a manifest and check its schema (:func:`check_manifest`).

    Raises:
        ManifestError: the file is not JSON (corrupt or truncated), not a JSON object, or a
            field is missing or of the wrong type.
        OSError: the file cannot be read.
    """
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except RecursionError:
        raise ManifestError("nested too deeply to be a manifest") from None
    except ValueError as e:
        raise ManifestError(f"not JSON ({e})") from None
    check_manifest(data)
    return data


_INT, _NUM, _STR, _BOOL = "an integer", "a number", "a string", "true or false"
#: Known fields: (what it must be, may it be null). ``step``/``epoch``/``iter`` are required.
_FIELDS: dict[str, tuple[str, bool]] = {
    "manifest_version": (_INT, False), "step": (_INT, False), "epoch": (_INT, False), "iter": (_INT, False),
    "world_size": (_INT, True), "workers_per_rank": (_INT, True), "batch_size": (_INT, True),
    "grad_accum": (_INT, True), "epoch_start_step": (_INT, True), "format": (_STR, False), "kind": (_STR, True),
    "created": (_STR, True), "torch_version": (_STR, True), "code_version": (_STR, True), "strategy": (_STR, True),
    "data_fingerprint": (_STR, True), "weights": (_STR, True), "has_loader_state": (_BOOL, True),
    "tp": (_INT, True),
}
_REQUIRED = ("step", "epoch", "iter", "files")


def _type_name(v: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


def _is(v: Any, want: str) -> bool:
    if want == _INT:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    if want == _NUM:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return isinstance(v, str) if want == _STR else isinstance(v, bool)


def check_manifest(data: Any) -> None:
    """Check a parsed manifest against the schema of this module's docstring.

    Raises:
        ManifestError: the first problem found, e.g. ``missing "step"``, ``"step" is a
            string, not an integer``, ``files is a list, not a mapping``.
    """
    if not isinstance(data, dict):
        raise ManifestError(f"{_type_name(data)}, not a JSON object")
    for key in _REQUIRED:
        if key not in data:
            raise ManifestError(f'missing "{key}"')
    for key, (want, nullable) in _FIELDS.items():
        v = data.get(key)
        if key in data and not (v is None and nullable) and not _is(v, want):
            shown = str(v) if _is(v, _NUM) and isinstance(v, int) else _type_name(v)
            raise ManifestError(f'"{key}" is {shown}, not {want}' + (" >= 0" if want == _INT else ""))
    metrics = data.get("metrics")
    if metrics is not None and not isinstance(metrics, dict):
        raise ManifestError(f'"metrics" is {_type_name(metrics)}, not a mapping')
    for name, v in (metrics or {}).items():
        if v is not None and not _is(v, _NUM):
            raise ManifestError(f'"metrics" entry "{name}" is {_type_name(v)}, not a number')
    sm = data.get("selection_metric")
    if sm is not None and not isinstance(sm, dict):
        raise ManifestError(f'"selection_metric" is {_type_name(sm)}, not a mapping')
    if sm is not None and not (sm.get("value") is None or _is(sm["value"], _NUM)):
        raise ManifestError(f'"selection_metric" value is {_type_name(sm["value"])}, not a number')
    files = data["files"]
    if not isinstance(files, dict):
        raise ManifestError(f'"files" is {_type_name(files)}, not a mapping')
    for rel, want in files.items():
        if not isinstance(want, dict):
            raise ManifestError(f'"files" entry "{rel}" is {_type_name(want)}, not a mapping')
        if not _is(want.get("size"), _INT):
            raise ManifestError(f'"files" entry "{rel}" has no size (an integer >= 0)')
        if not (isinstance(want.get("sha256"), str) and len(want["sha256"]) == 64):
            raise ManifestError(f'"files" entry "{rel}" has no sha256 (64 hex digits)')



def _sha256_or_none(path: Path) -> str | None:
    try:
        return sha256_file(path)
    except FileNotFoundError:
        return None


def outside_names(root: Path, files: Any) -> list[str]:
    """The problems of a manifest's ``files`` table that names something outside its checkpoint.

    A name must be a relative POSIX path without ``..``, not absolute, and must not lead out of
    ``root`` through a symbolic link. Such a manifest is invalid: nothing it names is read (only
    links are followed to find where a name leads). A table that is not a dict has no names here.

    Returns:
        One line per such name (empty: every name is inside ``root``).
    """
    if not isinstance(files, dict):
        return []
    base = Path(root).resolve()
    problems = []
    for rel in files:
        bad = not isinstance(rel, str) or not rel or "\0" in rel
        if not bad:
            parts = PurePosixPath(rel).parts
            bad = PurePosixPath(rel).is_absolute() or ".." in parts or "\\" in rel
        if not bad:
            try:
                bad = not (base / rel).resolve().is_relative_to(base)
            except (OSError, RuntimeError):  # a link loop
                bad = True
        if bad:
            problems.append(f"manifest names {rel!r}, a file outside its checkpoint (the manifest is invalid; "
                            "nothing outside was read)")
    return problems


def verify_files(root: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    """Compare files under ``root`` with a manifest's ``files`` table.

    The sha256 of the files are computed on up to ``min(files, CPUs, 8)`` threads at once
    (hashlib releases the GIL): a resume verifies a checkpoint before loading it.

    Returns:
        One line per problem (missing file, size or sha256 mismatch), in the table's
        order; empty if all match. A table naming a file outside ``root``
        (:func:`outside_names`) gives only those problems: nothing is read.
    """
    outside = outside_names(root, files)
    if outside:
        return outside
    found: dict[str, str] = {}
    to_hash = []
    for rel, want in files.items():
        p = root / rel
        if not p.is_file():
            found[rel] = f"{rel}: missing"
            continue
        size = p.stat().st_size
        if size != want.get("size"):
            found[rel] = f"{rel}: size {size} != {want.get('size')} in manifest"
            continue
        to_hash.append(rel)
    if to_hash:
        from concurrent.futures import ThreadPoolExecutor  # here: `pimm checkpoints ls` imports this module

        with ThreadPoolExecutor(min(len(to_hash), os.cpu_count() or 1, 8), thread_name_prefix="pimm-verify") as pool:
            for rel, digest in zip(to_hash, pool.map(lambda rel: _sha256_or_none(root / rel), to_hash)):
                if digest is None:  # removed or replaced between the size check and the read
                    found[rel] = f"{rel}: missing"
                elif digest != files[rel].get("sha256"):
                    found[rel] = f"{rel}: sha256 mismatch"
    return [found[rel] for rel in files if rel in found]
