"""An export written to a remote store (``pimm export ... s3://bucket/out``), torch-free.

An object store has no rename, so an export cannot appear whole in one step as it does on a
file system. Instead ``export.json`` is the export's completion marker: the export is written
in a local temporary directory first, then its files are uploaded (each one's sha256 read back
from the store and compared), and ``export.json`` last. A prefix without ``export.json`` is an
export cut short or still being written: warm start and export refuse it
(:mod:`.source`), and ``--force`` does not take it for a previous export.

``--force`` replaces only a previous export (its ``export.json`` and nothing but an export's
files, :func:`~pimm_core.checkpoint.records.outputs.is_export_listing`): its ``export.json`` is removed
first, so from then on readers see an incomplete export, never a mix of two; the new files are
uploaded, the old ones the new export does not have are removed, and the new ``export.json`` goes last.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ...errors import RemoteStoreError, UsageError
from ...faults import point, register
from ..records.manifest import sha256_file
from ..records.outputs import EXPORT_JSON, is_export_listing
from ..select.selection import TRAINER_DCP
from .source import open_url, store_errors
from .store import STEP_RE, sha256_remote
from .upload import with_retries

register("remote.export_files")


def check_remote_output(url: str, *, force: bool, options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """Check that an export may be written to the remote prefix ``url``; ``(filesystem, path)``.

    Raises:
        UsageError: (exit code 2) ``url`` is a file, or inside a checkpoint (``step_<N>/``,
            ``trainer.dcp/``); it holds objects, without ``force``; with ``force``, it is not a
            previous export.
        RemoteStoreError: the store cannot be reached or read (exit code 1).
    """
    fs, path = open_url(url, options)
    inside = [p for p in path.split("/")[:-1] if STEP_RE.match(p) or p == TRAINER_DCP]
    if inside:
        raise UsageError(f"cannot export to {url}: it is inside the remote checkpoint {inside[-1]}/; "
                         "choose a prefix outside the run's checkpoints")
    with store_errors(url):
        fs.invalidate_cache()
        if fs.isfile(path):
            raise UsageError(f"{url} exists and is a file; choose a prefix for the export")
        entries = fs.ls(path, detail=True) if fs.exists(path) else []
        names = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries}
        if not names:
            return fs, path
        if not force:
            raise UsageError(f"{url} already exists and is not empty; use --force to replace a previous export")
        record = None
        if EXPORT_JSON in names:
            try:
                record = json.loads(fs.cat_file(f"{path}/{EXPORT_JSON}"))
            except ValueError:
                record = None
    subdirs = [n for n, e in names.items() if e.get("type") == "directory"]
    if subdirs or not is_export_listing(set(names), record):
        why = (f"it holds folders ({', '.join(sorted(subdirs)[:3])})" if subdirs else
               f"it has no {EXPORT_JSON} (an export cut short, or not an export)" if record is None else
               f"it holds objects an export does not write ({', '.join(sorted(names)[:3])})")
        raise UsageError(f"--force replaces only a previous export, and {url} is not one: {why}; choose another "
                         "prefix, or remove it yourself")
    return fs, path


def upload_export(local: Path, fs: Any, path: str, url: str) -> list[str]:
    """Upload the export directory ``local`` to ``path`` (checked by :func:`check_remote_output`):
    a previous export's ``export.json`` removed first, each file uploaded and its sha256 read
    back and compared, stale files of the previous export removed, ``export.json`` last.

    Returns:
        The names uploaded (``export.json`` last).

    Raises:
        RemoteStoreError: an upload failed beyond retries or its sha256 does not match (the
            remote prefix then has no ``export.json``: an incomplete export, refused by readers).
    """
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    body = [f for f in files if f != EXPORT_JSON]

    def put(rel: str) -> None:
        dst = f"{path}/{rel}"
        with_retries(dst, lambda: fs.put_file(str(local / rel), dst))
        got = with_retries(dst, lambda: sha256_remote(fs, dst))
        if got != sha256_file(local / rel):
            raise RemoteStoreError(f"{url}/{rel}: sha256 after upload {got[:12]} does not match the file written")

    with store_errors(url, "write"):
        fs.invalidate_cache()
        old = [e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=False)] if fs.exists(path) else []
        if EXPORT_JSON in old:  # from here on the previous export is incomplete, never half-replaced
            fs.rm_file(f"{path}/{EXPORT_JSON}")
        with ThreadPoolExecutor(4, thread_name_prefix="pimm-export-upload") as pool:
            for f in [pool.submit(put, rel) for rel in body]:
                f.result()
        for name in old:
            if name not in files:
                fs.rm_file(f"{path}/{name}")
        point("remote.export_files", path)  # every file is there, export.json is not yet
        put(EXPORT_JSON)  # the marker: the export is complete from here on
    return [*body, EXPORT_JSON]
