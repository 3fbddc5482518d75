"""Publishing a checkpoint: atomic files, the ``<name>.tmp`` -> ``<name>`` rotation, and the
failure contract every format shares.

Everything a save writes goes under a temporary name, is fsynced, then renamed into place
with a directory fsync after each rename; a directory checkpoint is rotated in (``last`` ->
``last.prev``, ``last.tmp`` -> ``last``, ``last.prev`` renamed away whole and removed in the
background). A write that fails on rank 0 makes every rank raise :class:`CheckpointSaveError`
(:func:`on_main`), naming what a resume would now select (:func:`intact_note`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch

from ...errors import CheckpointSaveError
from ...faults import point, register
from ...fsio import (
    BackgroundSync,
    PageRelease,
    atomic_write,
    atomic_write_bytes,
    fsync_dir,
    fsync_tree_together,
    release_cached_pages,
    remove_tree,
)
from ...pools import SharedPool
from ...process import dist
from ...process.dist import DistInfo
from ..records.manifest import COMPLETE, MANIFEST, describe_files, write_manifest
from ..select.selection import TRAINER_DCP, WEIGHTS, select_resume
from .follow import FollowingHasher
from .save_errors import short_error, torch_save

log = logging.getLogger("pimm")

register("file.written", "file.synced", "file.renamed", "standard.prepared", "standard.dcp_written",
         "standard.dcp_complete", "standard.weights_written", "standard.synced", "standard.manifest_written",
         "standard.complete_written", "rotate.old_prev_removed", "rotate.renamed_to_prev", "rotate.renamed_into_place",
         "rotate.prev_removed")


_crc_lock = threading.Lock()
_crc_users = 0
_crc_before = True


@contextlib.contextmanager
def without_zip_crc32():
    """``torch.save`` without the zip CRC-32 of each record while inside (thread-safe, nestable).

    Used for the files of a standard checkpoint (``trainer.dcp/`` shards, ``weights.pth``),
    the periodic save's hot path: the CRC costs a CPU pass over every byte (about a third
    of a ``torch.save`` here) and duplicates the sha256 in the checkpoint's manifest, which
    ``pimm checkpoints verify`` and resume check. ``torch.load`` and DCP read such files
    (``torch.serialization.set_crc32_options``); a zip tool's integrity test (``unzip -t``,
    ``zipfile.testzip``) reports the missing CRCs. The files users take away
    (``model_best.pth``, ``iter_<step>.pth``, legacy and single-format files, exports) keep them.
    """
    global _crc_users, _crc_before
    with _crc_lock:
        if _crc_users == 0:
            _crc_before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                torch.serialization.set_crc32_options(_crc_before)


def _write_marker(path: Path, durable: bool = True) -> None:
    atomic_write_bytes(path, b"", durable=durable)


def save_torch_file(path: Path, obj: Any, hasher: FollowingHasher | None = None) -> None:
    """``torch.save`` to ``path`` through a temporary file, fsync and rename (atomic); with
    ``hasher``, its sha256 is computed as the bytes are written (:meth:`FollowingHasher.writing`).

    A sidecar manifest ``<path>.json`` describes the bytes it sits next to, so it is removed
    before they are replaced (the caller writes the new one after): a crash between the
    rename and the new sidecar leaves an intact file without a manifest (resumable, the file
    is the authority) rather than one whose checksum no longer matches (rejected as corrupt).
    """
    release_cached_pages(path)  # the file being replaced: its pages are reused by the write
    sidecar = path.with_name(path.name + ".json")

    def drop_sidecar() -> None:
        if sidecar.exists():
            sidecar.unlink()
            fsync_dir(path.parent)

    # torch.save: zip CRCs as it is set (see without_zip_crc32)
    wrap = hasher.writing if hasher is not None else None
    atomic_write(path, lambda tmp: torch_save(obj, tmp, wrap), points="file", before_replace=drop_sidecar)


def rotate_into_place(tmp: Path, final: Path, keep_full: int = 1) -> None:
    """Publish directory ``tmp`` as ``final`` keeping a complete candidate at every instant.

    ``final`` -> ``final.prev``; ``tmp`` -> ``final``; ``final.prev`` renamed to a hidden
    ``*.tmp`` name and removed in the background (see :func:`wait_for_purges`). If a previous
    rotation was interrupted after its first rename, ``final`` is absent and ``final.prev`` is the complete one: it stays
    until the new ``final`` is in place.

    A superseded tree that cannot be removed (a file kept busy or immutable, a directory
    without write permission) never blocks a save: it is moved out of the way to
    ``<final>.stale-<k>`` (the first free ``k``; selection ignores that name), a warning
    names the path that could not be removed, and every later rotation (and the next run's
    first save) tries again (:func:`retry_stale`).

    ``keep_full`` > 1 (``checkpoint.keep_full``): the superseded ``final.prev`` is kept as
    ``full_<step>/`` instead of removed, and only the newest ``keep_full - 1`` of those stay.

    Raises:
        OSError: a rename of ``final`` or ``tmp`` failed.
    """
    prev = final.with_name(final.name + ".prev")
    parent = final.parent
    wait_for_purges()
    if final.exists():
        if prev.exists():
            try:
                remove_tree(prev)
                fsync_dir(parent)
                point("rotate.old_prev_removed", prev)
            except OSError as e:
                _set_aside(prev, final, e)
        if prev.exists():  # it could be neither removed nor renamed: the superseded one goes aside
            dest = _stale_name(final)
            os.rename(final, dest)
            fsync_dir(parent)
            _remember(dest)
        else:
            os.rename(final, prev)
            fsync_dir(parent)
            point("rotate.renamed_to_prev", prev)
    os.rename(tmp, final)
    fsync_dir(parent)
    point("rotate.renamed_into_place", final)
    superseded = prev if prev.exists() and prev not in _stale else None
    if superseded is not None and keep_full > 1:
        superseded = _keep_generation(superseded, keep_full)
    shown = superseded
    if superseded is not None:
        # Renamed away whole before anything in it is removed: a reader in another process sees
        # `final.prev` complete or absent, never half-deleted (pimm_core.checkpoint.records.generation).
        doomed = superseded.with_name(f".{superseded.name}.removing.{os.getpid()}.tmp")
        try:
            remove_tree(doomed)
            os.rename(superseded, doomed)
            superseded = doomed
        except OSError:
            pass  # (it cannot be renamed either: the purge below fails and sets it aside, with the warning)
    _purge_in_background(superseded, final, shown)


FULL_PREFIX = "full_"


def _keep_generation(prev: Path, keep_full: int) -> Path | None:
    """Keep the superseded ``prev`` as ``full_<step>`` (its manifest's step) and remove the oldest
    ``full_*`` beyond ``keep_full - 1`` in the background; returns what to remove now (``prev``
    itself when its step is already kept or unknown), or None."""
    import json

    parent = prev.parent
    try:
        step = int(json.loads((prev / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return prev  # not a readable checkpoint: removed as before
    dest = parent / f"{FULL_PREFIX}{step}"
    if dest.exists():
        return prev  # (this step is kept already)
    os.rename(prev, dest)
    fsync_dir(parent)
    kept = sorted((p for p in parent.glob(f"{FULL_PREFIX}*") if p.name[len(FULL_PREFIX):].isdigit()),
                  key=lambda p: int(p.name[len(FULL_PREFIX):]))
    for old in kept[:max(0, len(kept) - (keep_full - 1))]:
        _purge_in_background(old, parent / "last")
    return None


# Removing the superseded checkpoint is off the save's critical path (as torchtitan's purge
# thread does): deleting a GiB-sized tree costs ~0.2 s on ext4 with online discard, and the
# new checkpoint is already complete and in place. A removal that fails is a warning naming
# the path; the tree is moved aside and removed again later (retry_stale).
_purge_lock = threading.Lock()
_purges: list[Future] = []


def _forget_purges() -> None:
    global _purge_lock
    _purge_lock = threading.Lock()  # (a forked child: the parent's purges are not the child's to wait for)
    _purges.clear()


# its thread is joined at interpreter exit, so a purge is never cut short
_purge_pool = SharedPool(1, "purge", after_fork=_forget_purges)
_stale: set[Path] = set()  # trees that could not be removed (retried by later rotations)
STALE_INFIX = ".stale-"


def _stale_name(final: Path) -> Path:
    k = 1
    while (dest := final.with_name(f"{final.name}{STALE_INFIX}{k}")).exists() or dest.is_symlink():
        k += 1
    return dest


def _remember(path: Path) -> None:
    with _purge_lock:
        _stale.add(path)


def _set_aside(path: Path, final: Path, error: OSError, shown: Path | None = None) -> None:
    """``path`` could not be removed: warn naming it (under the name ``shown`` it had in the run,
    for a tree renamed away before its removal), move it to ``<final>.stale-<k>`` (so the name
    ``final.prev`` is free and no half-removed candidate sits under it) and remember it."""
    where = path
    failed = error.filename or path
    if shown is not None and str(failed).startswith(str(path)):
        failed = str(shown) + str(failed)[len(str(path)):]
    try:
        dest = _stale_name(final)
        os.rename(path, dest)
        fsync_dir(path.parent)
        where = dest
        kept = f"moved to {dest}; "
    except OSError:
        kept = "left in place; "
    log.warning("warning: could not remove the superseded checkpoint %s (%s); %sremoval is retried at later "
                "saves; new saves go on", failed, error.strerror or error, kept)
    _remember(where)


def _purge_in_background(path: Path | None, final: Path, shown: Path | None = None) -> None:
    """Remove ``path`` (the superseded ``final.prev``, renamed away from ``shown``; None: none)
    on the purge thread, then retry the trees set aside before (:func:`retry_stale`)."""

    def purge() -> None:
        if path is not None:
            try:
                remove_tree(path)
                fsync_dir(path.parent)
                point("rotate.prev_removed", path)
            except OSError as e:
                _set_aside(path, final, e, shown)
        retry_stale(final.parent, final.name)

    with _purge_lock:
        _purges.append(_purge_pool.submit(purge))


def retry_stale(directory: Path, name: str = "last") -> list[Path]:
    """Try again to remove the trees set aside in ``directory`` (``<name>.stale-<k>``, this
    process's and those an earlier run left); returns the ones still there (quietly: the
    first failure was the warning)."""
    left = []
    found = set(directory.glob(f"{name}{STALE_INFIX}*")) if directory.is_dir() else set()
    with _purge_lock:
        mine = {p for p in _stale if p.parent == directory}
    for path in sorted(found | mine):
        try:
            remove_tree(path)
        except OSError:
            left.append(path)
            continue
        with _purge_lock:
            _stale.discard(path)
    if len(left) < len(found | mine):
        fsync_dir(directory)
    return left


def wait_for_purges() -> list[Path]:
    """Block until the background removals of superseded checkpoints are done; returns the
    trees that could not be removed (each was a warning when it failed)."""
    with _purge_lock:
        pending = list(_purges)
        _purges.clear()
    for f in pending:
        f.exception()  # purge() catches OSError; anything else is a bug, and shows in the thread
    with _purge_lock:
        return sorted(_stale)


def follow_hashes(tmp: Path, previous: Path | None = None, own_shards: bool = False) -> FollowingHasher:
    """Rank 0: hash the DCP shards written on this node (``__<rank>_<n>.distcp`` for ranks
    ``0 .. LOCAL_WORLD_SIZE-1``: torchrun gives rank 0's node the first ranks) as they are
    written, on a second thread; ``weights.pth`` (:func:`publish`), and rank 0's own shards
    with ``own_shards``, are written through :meth:`FollowingHasher.writing`, which hashes
    them on the hashing threads as their bytes reach the file (with one local rank no
    following thread is started).

    Other nodes' shards are hashed after their writers have closed them: on a shared
    filesystem (NFS) a file opened while another client writes it may show a stale size.

    ``previous`` (the checkpoint this save replaces) has its page cache released in step
    with the writes, 128 MiB ahead of them (:class:`~pimm_core.fsio.PageRelease`), so the
    writers take pages freed milliseconds before.
    """
    local = {f"__{r}_" for r in range(1 if own_shards else 0, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))}

    def big_file(rel: str) -> bool:
        name = rel.rsplit("/", 1)[-1]
        return name.endswith(".distcp") and any(name.startswith(prefix) for prefix in local)

    on_written = PageRelease(previous).advance if previous is not None else None
    return FollowingHasher(tmp, big_file if local else None, on_written).start()


def prepare(tmp: Path) -> None:
    """Rank 0: an empty ``<name>.tmp/trainer.dcp/`` (a leftover of an interrupted or failed save is removed)."""
    remove_tree(tmp)
    (tmp / TRAINER_DCP).mkdir(parents=True)
    point("standard.prepared", tmp)


def publish(tmp: Path, final: Path, weights: dict[str, Any] | None, manifest: dict[str, Any],
            hasher: FollowingHasher | None = None, keep_full: int = 1, synced: BackgroundSync | None = None) -> None:
    """Rank 0, after every rank's DCP write: markers, ``weights.pth``, manifest, ``.complete``, rotation.

    ``weights`` None writes no ``weights.pth`` (a sharded model's weights kept in
    ``trainer.dcp/`` only). ``hasher`` (:func:`follow_hashes`, started before the DCP
    write) has been hashing the big files while they were written; whatever it did not
    cover is hashed here. ``synced``: this process's DCP files, being fsynced in the
    background since its DCP write ended (:class:`~pimm_core.fsio.BackgroundSync`).

    Durability: nothing under ``tmp`` is selected by a resume (a ``*.tmp`` name), so the
    small files are written there without an fsync each; every file and directory under
    ``tmp`` is fsynced (together, :func:`~pimm_core.fsio.fsync_tree_together`; those already
    fsynced since their write are left out) before ``tmp`` is renamed into place.
    """
    _write_marker(tmp / TRAINER_DCP / COMPLETE, durable=False)
    point("standard.dcp_complete", tmp)
    durable: set[tuple[int, int]] = set()
    if weights is not None:
        with without_zip_crc32():  # like the shards: the manifest's sha256 covers it
            save_torch_file(tmp / WEIGHTS, weights, hasher)  # (fsynced itself: atomic_write)
        st = (tmp / WEIGHTS).stat()
        durable.add((st.st_dev, st.st_ino))
    point("standard.weights_written", tmp / WEIGHTS)
    files = describe_files(tmp, known=hasher.finish() if hasher is not None else None)
    write_manifest(tmp / MANIFEST, {"format": "standard", **manifest, "files": files}, durable=False)
    point("standard.manifest_written", tmp / MANIFEST)
    _write_marker(tmp / COMPLETE, durable=False)
    point("standard.complete_written", tmp / COMPLETE)
    if synced is not None:
        durable |= synced.wait()
    fsync_tree_together(tmp, skip=durable)
    point("standard.synced", tmp)
    rotate_into_place(tmp, final, keep_full)


def remove_quietly(tmp: Path) -> None:
    """Remove a failed save's temporary directory, if it can be removed."""
    try:
        remove_tree(tmp)
    except OSError:
        pass  # reported by `pimm checkpoints ls` and removed by the next successful save


def intact_note(model_dir: Path) -> str:
    """What a failed save left a resume (read from disk after the cleanup, not assumed):
    ``"; <path> (step N) is complete and is what a resume selects"``, or that the run has no
    complete checkpoint yet. After a late failure (a rotation step) that can be the new save."""
    chosen, _ = select_resume(model_dir)
    if chosen is None:
        return "; this run has no complete checkpoint yet"
    return f"; {chosen.path} (step {chosen.step}) is complete and is what a resume selects"


def on_main(info: DistInfo, fn: Callable[[], None], tmp: Path, model_dir: Path) -> None:
    """Run ``fn`` on rank 0 and make every rank raise if it failed, so no rank waits forever.

    Raises:
        CheckpointSaveError: on every rank, naming the path and the OS error and what a
            resume would now select (:func:`intact_note`); ``tmp`` is removed.
    """
    error = None
    if info.is_main:
        try:
            fn()
        except Exception as e:
            cause = short_error(e, tmp)  # (before the removal: the file system's state names the cause)
            remove_quietly(tmp)
            error = f"checkpoint save failed: {cause}{intact_note(model_dir)}"
    errors = dist.all_gather_object(error) if info.distributed else [error]
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointSaveError(first)

