"""A run's checkpoints on a remote store (``checkpoint.remote``, any fsspec URL): layout, listing, download.

Torch-free (``pimm checkpoints ls`` lists remote candidates). The remote mirrors the run's
``model/`` under ``<remote>/<group>/<run>/model/``:

- ``step_<N>/``: the standard checkpoint published locally as ``last`` at step ``N``, with its
  layout (``weights.pth``, ``trainer.dcp/``, ``manifest.json``); complete only once its
  ``.complete`` is there, written after every file was uploaded and its sha256 checked
  against the manifest, and after ``manifest.json`` itself;
- ``model_best.pth``, ``iter_<step>.pth``, ``best_<step>.pth``: weights files, complete once their sidecar
  ``<name>.json`` (written last) is there and matches the file's size.

A wiped ``model/`` is restored from the remote whole (:func:`download_newest`, then
:func:`download_weights_files`): the newest complete ``step_<N>/`` as ``last`` and every complete
weights file beside it, so the run's retention (``keep_iter``, ``keep_best``, ``model_best.pth``)
continues from the set it had, and the mirror removes from the remote only what that retention removes.

A kill during an upload leaves a ``step_<N>/`` without ``.complete``: :func:`remote_candidates`
reports it as incomplete and :func:`download_newest` never takes it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..records.manifest import COMPLETE, MANIFEST
from ..select.selection import BEST, BEST_K_RE, ITER_RE
from .candidate import STEP_RE, RemoteCandidate  # noqa: F401 (re-exported)
from .choice import ResumeChoice, newest_complete, resume_choice

def is_mirrored_weights(name: str) -> bool:
    """A weights file of ``model/`` the mirror uploads: ``model_best.pth``, ``iter_<step>.pth``, ``best_<step>.pth``."""
    return name == BEST or bool(ITER_RE.match(name)) or bool(BEST_K_RE.match(name))


class RemoteError(OSError):
    """The remote store could not be reached or read (network, credentials, missing filesystem package)."""


def open_store(url: str, options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``(filesystem, root path)`` of ``url`` through fsspec, with ``options`` as storage options.

    Raises:
        RemoteError: no filesystem for the URL's scheme is installed (e.g. ``s3fs`` for ``s3://``).
    """
    import fsspec

    options = dict(options or {})
    if fsspec.utils.get_protocol(url) in ("file", "local"):
        # a directory tree, not an object store: the parents of each file must exist before it
        # is written (fsspec's local filesystem makes them only when asked)
        options.setdefault("auto_mkdir", True)
    try:
        return fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as e:
        raise RemoteError(f"cannot open checkpoint.remote = {url!r}: {e}") from None


def run_prefix(url: str, run_dir: Path) -> str:
    """The URL under which run ``run_dir`` (``<root>/<group>/<run>``) keeps its ``model/``."""
    return f"{url.rstrip('/')}/{run_dir.parent.name}/{run_dir.name}/model"


def sha256_remote(fs: Any, path: str, bufsize: int = 1 << 22) -> str:
    """Hex sha256 of a remote object's bytes, read back from the store."""
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def remote_candidates(fs: Any, prefix: str) -> list[RemoteCandidate]:
    """The checkpoints under ``prefix`` (newest step first), complete or not.

    Raises:
        RemoteError: the store cannot be listed.
    """
    try:
        fs.invalidate_cache()
        entries = fs.ls(prefix, detail=True) if fs.exists(prefix) else []
    except (OSError, Exception) as e:  # botocore/aiohttp errors are not OSErrors
        raise RemoteError(f"cannot list {prefix}: {e}") from None
    names = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries}
    out = []
    for name, entry in names.items():
        if (m := STEP_RE.match(name)) and entry.get("type") == "directory":
            out.append(RemoteCandidate(name, int(m.group(1)), fs.exists(f"{prefix}/{name}/{COMPLETE}"), "standard"))
        elif name.endswith(".pth"):
            step = None
            complete = f"{name}.json" in names
            if complete:
                try:
                    side = json.loads(fs.cat_file(f"{prefix}/{name}.json"))
                    step = side.get("step")
                    complete = side["files"][name]["size"] == entry.get("size")
                except (ValueError, KeyError, TypeError):
                    complete = False
            out.append(RemoteCandidate(name, step, complete, "weights"))
    return sorted(out, key=lambda c: (c.kind != "standard", -(c.step or -1), c.name))


def run_remote(run_dir: Path) -> tuple[str, dict[str, Any] | None] | None:
    """``(checkpoint.remote, checkpoint.remote_options)`` from the run's resolved ``config.toml``
    (torch-free), or None when the run has no remote or no readable config."""
    import tomllib

    try:
        table = tomllib.loads((run_dir / "config.toml").read_text()).get("checkpoint", {})
    except (OSError, ValueError):
        return None
    url = table.get("remote") if isinstance(table, dict) else None
    if not isinstance(url, str) or not url:
        return None
    options = table.get("remote_options")
    return url, options if isinstance(options, dict) else None


def _listed(url: str, options: dict[str, Any] | None, prefix_url: str) -> tuple[list[Any], str | None]:
    """``(candidates under prefix_url, None)``, or ``([], the error's first line)`` when the store
    cannot be listed (botocore/aiohttp errors are not OSErrors: any exception)."""
    try:
        fs, _ = open_store(url, options)
        return remote_candidates(fs, fs._strip_protocol(prefix_url)), None
    except Exception as e:
        return [], str(e).splitlines()[0] if str(e) else type(e).__name__


def describe_remote(run_dir: Path, local_step: int | None, chosen: Any = None) -> dict[str, Any] | None:
    """What ``pimm checkpoints ls`` shows of the run's remote: ``{"url", "candidates": [{name,
    step, complete, kind}], "uploading": [what is local and not complete remotely], "resume": the
    line saying whether a resume takes ``chosen`` (the local selection) or the remote's newest, "error"}``,
    or None when the run has no ``checkpoint.remote``. Never raises: an unreachable store is ``error``."""
    remote = run_remote(run_dir)
    if remote is None:
        return None
    url, options = remote
    prefix = run_prefix(url, run_dir)
    cands, error = _listed(url, options, prefix)
    out: dict[str, Any] = {"url": prefix, "candidates": [], "uploading": [], "resume": None, "error": error}
    if error is not None:
        return out
    out["candidates"] = [{"name": c.name, "step": c.step, "complete": c.complete, "kind": c.kind} for c in cands]
    out["resume"] = resume_choice(chosen, newest_complete(cands)).reason
    if local_step is not None and not any(c.complete and c.step == local_step for c in cands if c.kind == "standard"):
        out["uploading"].append(f"last (step {local_step})")
    return out


def remote_choice(url: str, options: dict[str, Any] | None, run_dir: Path, local: Any) -> ResumeChoice:
    """The :func:`~.choice.resume_choice` for run ``run_dir`` whose ``checkpoint.remote`` is
    ``url`` and whose ``model/`` would resume ``local`` (what ``pimm resume --dry-run`` prints;
    nothing downloaded). Never raises: a store that cannot be listed is a choice of the local one
    whose reason says so."""
    cands, error = _listed(url, options, run_prefix(url, run_dir))
    if error is not None:
        what = f"model/{local.name} at step {local.step}" if local is not None else "nothing"
        return ResumeChoice(None, f"the remote cannot be listed ({error}): resuming from {what}")
    return resume_choice(local, newest_complete(cands))


def remote_manifest(url: str, options: dict[str, Any] | None, run_dir: Path, name: str) -> dict[str, Any] | None:
    """The ``manifest.json`` of the remote checkpoint ``name`` (``step_<N>``) of run ``run_dir``: what
    ``pimm resume --dry-run`` describes when the resume restores it (nothing else is downloaded).
    None when it cannot be read."""
    prefix = run_prefix(url, run_dir)
    try:
        fs, _ = open_store(url, options)
        data = json.loads(fs.cat_file(f"{fs._strip_protocol(prefix)}/{name}/{MANIFEST}"))
    except Exception:  # botocore/aiohttp errors are not OSErrors
        return None
    return data if isinstance(data, dict) else None


def download_newest(fs: Any, prefix: str, dest: Path) -> RemoteCandidate | None:
    """Download the newest complete remote ``step_<N>/`` into directory ``dest`` (created;
    it must not exist) and check every file against its manifest; None when there is none.

    Raises:
        RemoteError: the store failed, or a downloaded file does not match the manifest.
    """
    for cand in remote_candidates(fs, prefix):
        if cand.kind != "standard" or not cand.complete:
            continue
        src = f"{prefix}/{cand.name}"
        try:
            manifest = json.loads(fs.cat_file(f"{src}/{MANIFEST}"))
            dest.mkdir(parents=True)
            for rel in manifest["files"]:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f"{src}/{rel}", str(dest / rel))
            fs.get_file(f"{src}/{MANIFEST}", str(dest / MANIFEST))
        except Exception as e:
            raise RemoteError(f"cannot download {src}: {e}") from None
        from ..records.manifest import verify_files

        problems = verify_files(dest, manifest["files"])
        if problems:
            raise RemoteError(f"{src} downloaded but does not match its manifest: {'; '.join(problems)}")
        (dest / COMPLETE).write_bytes(b"")
        return cand
    return None


def download_weights_files(fs: Any, prefix: str, model_dir: Path, *, newer: bool = False) -> tuple[list[str], list[str]]:
    """Download the complete remote weights files (:func:`is_mirrored_weights`) that ``model_dir``
    lacks (with ``newer``, the remote is ahead of ``model/``: its ``model_best.pth`` too when its
    sidecar differs from the local one's, which is removed first), each with its sidecar, its sha256 checked against the sidecar: the file goes into place
    under a temporary name first (``.<name>.<pid>.tmp``, removed by the next save's clean-up if this
    is killed), then the sidecar, as a local save writes them.

    Returns:
        ``(names restored, one line per file that could not be)``: a failure is not fatal
        (the run resumes without that file; the mirror never removes it from the remote).
    """
    from ...fsio import atomic_write_bytes, fsync_dir, fsync_file, remove_tree
    from ..records.manifest import sha256_file

    restored: list[str] = []
    failed: list[str] = []
    try:
        cands = remote_candidates(fs, prefix)
    except RemoteError as e:
        return restored, [str(e)]
    for cand in cands:
        name = cand.name
        if cand.kind != "weights" or not cand.complete or not is_mirrored_weights(name):
            continue
        present = (model_dir / name).exists() or (model_dir / f"{name}.json").exists()
        if present and not (newer and name == BEST):
            continue
        tmp = model_dir / f".{name}.{os.getpid()}.tmp"
        try:
            side = fs.cat_file(f"{prefix}/{name}.json")
            if present:
                try:
                    if (model_dir / f"{name}.json").read_bytes() == side:
                        continue
                except FileNotFoundError:
                    pass
                remove_tree(model_dir / f"{name}.json")  # no sidecar describing other bytes, ever
            want = json.loads(side)["files"][name]["sha256"]
            fs.get_file(f"{prefix}/{name}", str(tmp))
            got = sha256_file(tmp)
            if got != want:
                raise RemoteError(f"sha256 {got[:12]} does not match its sidecar's {str(want)[:12]}")
            fsync_file(tmp)
            os.replace(tmp, model_dir / name)
            fsync_dir(model_dir)
            atomic_write_bytes(model_dir / f"{name}.json", side)
        except Exception as e:  # botocore/aiohttp errors are not OSErrors
            remove_tree(tmp)
            failed.append(f"{name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            continue
        restored.append(name)
    return restored, failed
