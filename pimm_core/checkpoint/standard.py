"""The ``standard`` checkpoint format: ``model/last/{weights.pth, trainer.dcp/, manifest.json, .complete}``.

- ``weights.pth``: ``{"state_dict": ...}`` of the unwrapped model (no ``module.`` or
  ``_orig_mod.`` prefixes), loadable with plain ``torch.load(weights_only=True)``.
- ``trainer.dcp/``: written with ``torch.distributed.checkpoint`` by every rank.
  Keys: ``optim/<fqn>/<state>`` tensors (FQN-keyed via DCP's ``get_optimizer_state_dict``,
  so they reshard across world sizes), ``meta`` (packed optimizer structure,
  scheduler, scaler, trainer counters and metric state) and ``rank_state/<rank>``
  (packed per-rank RNG and loader cursor). Gets its own ``.complete``.
- ``manifest.json``: torch-free description with sizes and sha256 of every file.
- ``.complete``: written last.

Publishing: everything is written under ``<name>.tmp/``, fsynced, then rotated in
(``last`` -> ``last.prev``, ``last.tmp`` -> ``last``, ``last.prev`` removed), with a
directory fsync after each rename.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from .. import dist
from ..dist import DistInfo
from ..errors import CheckpointError, CheckpointParseError, CheckpointSaveError, first_line
from ..fsio import atomic_write, atomic_write_bytes, fsync_dir, fsync_tree, release_cached_pages, remove_tree
from .follow import FollowingHasher
from .manifest import COMPLETE, MANIFEST, describe_files, write_manifest
from .mapped_reader import MappedFileSystemReader
from .safe_read import load_failure, load_torch_file
from .selection import TRAINER_DCP, WEIGHTS, select_resume
from .state import join_tensors, pack, split_tensors, unpack, unwrap  # noqa: F401  (unwrap: re-exported)
from .ties import find_aliases
from ..faults import point, register

register("file.written", "file.synced", "file.renamed", "standard.prepared", "standard.dcp_written",
         "standard.dcp_complete", "standard.weights_written", "standard.synced", "standard.manifest_written",
         "standard.complete_written", "rotate.old_prev_removed", "rotate.renamed_to_prev", "rotate.renamed_into_place",
         "rotate.prev_removed")


# DCP warns "assuming the intent is to save/load in a single process" whenever no process
# group exists; that is the intent (no_dist). Filtered process-wide rather than around each
# call: an async save's write emits it later, on DCP's own thread.
warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process.*", category=UserWarning)


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


def _write_marker(path: Path) -> None:
    atomic_write_bytes(path, b"")


def save_torch_file(path: Path, obj: Any) -> None:
    """``torch.save`` to ``path`` through a temporary file, fsync and rename (atomic).

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
    atomic_write(path, lambda tmp: torch.save(obj, tmp), points="file", before_replace=drop_sidecar)


def rotate_into_place(tmp: Path, final: Path) -> None:
    """Publish directory ``tmp`` as ``final`` keeping a complete candidate at every instant.

    ``final`` -> ``final.prev``; ``tmp`` -> ``final``; ``final.prev`` removed in the
    background (see :func:`wait_for_purges`). If a previous rotation was interrupted after
    its first rename, ``final`` is absent and ``final.prev`` is the complete one: it stays
    until the new ``final`` is in place.

    Raises:
        OSError: a rename failed, or the background removal of the previous rotation's
            ``final.prev`` did (reported here, by the save after it).
    """
    prev = final.with_name(final.name + ".prev")
    parent = final.parent
    wait_for_purges()
    if final.exists():
        if prev.exists():
            remove_tree(prev)
            fsync_dir(parent)
            point("rotate.old_prev_removed", prev)
        os.rename(final, prev)
        fsync_dir(parent)
        point("rotate.renamed_to_prev", prev)
    os.rename(tmp, final)
    fsync_dir(parent)
    point("rotate.renamed_into_place", final)
    if prev.exists():
        _purge_in_background(prev)


# Removing the superseded checkpoint is off the save's critical path (as torchtitan's purge
# thread does): deleting a GiB-sized tree costs ~0.2 s on ext4 with online discard, and the
# new checkpoint is already complete and in place. A failure is not lost: it is raised by
# the next rotation or by wait_for_purges at the end of the run.
_purge_lock = threading.Lock()
_purge_pool: ThreadPoolExecutor | None = None
_purges: list[Future] = []


def _purge_in_background(path: Path) -> None:
    global _purge_pool

    def purge() -> None:
        remove_tree(path)
        fsync_dir(path.parent)
        point("rotate.prev_removed", path)

    with _purge_lock:
        if _purge_pool is None:  # its thread is joined at interpreter exit, so a purge is never cut short
            _purge_pool = ThreadPoolExecutor(1, thread_name_prefix="pimm-purge")
        _purges.append(_purge_pool.submit(purge))


def wait_for_purges() -> None:
    """Block until superseded checkpoints are removed.

    Raises:
        OSError: a removal failed (the first failure; the rest are dropped).
    """
    with _purge_lock:
        pending = list(_purges)
        _purges.clear()
    errors = [f.exception() for f in pending]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def save_standard(
    model_dir: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    rank_state: dict[str, Any],
    manifest: dict[str, Any],
    info: DistInfo,
    name: str = "last",
    ema_state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write and publish a standard checkpoint; every rank must call it.

    Args:
        model: the trained module (wrappers allowed; weights are saved unwrapped).
        meta: replicated, non-tensor trainer state (scheduler, scaler, counters, metrics).
        rank_state: this rank's state (RNG, loader cursor); stored under ``rank_state/<rank>``.
        manifest: fields for ``manifest.json`` (step, epoch, iter, world size, metrics...);
            ``format`` and ``files`` are added here.
        ema_state_dict: the EMA weight set, stored in ``weights.pth`` as ``ema_state_dict``.

    Returns:
        The published directory ``model_dir/<name>``.

    Raises:
        OSError: a write failed; the previously published checkpoint is untouched.
    """
    final = model_dir / name
    tmp = model_dir / f"{name}.tmp"

    # A removal of the previous save's last.prev still running is finished first (in a run
    # it finished long ago, during training): its failure then stops this save before it
    # writes anything, and the page cache it frees is reused by this save's writes.
    on_main(info, lambda: (wait_for_purges(), prepare(tmp)), tmp, model_dir)
    if info.local_rank == 0:  # one process per node: the page cache is the node's
        release_cached_pages(final)
    hasher = follow_hashes(tmp) if info.is_main else None
    try:
        plain = unwrap(model)
        state = dcp_state(plain, optimizer, meta, rank_state, info.rank)
        try:
            with without_zip_crc32():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp / TRAINER_DCP, sync_files=True),
                         no_dist=not info.distributed)
            point("standard.dcp_written", tmp / TRAINER_DCP)
        except Exception as e:  # DCP raises on every rank when any rank's write failed
            if info.is_main:
                hasher.close()
                _cleanup(tmp)
            raise CheckpointSaveError(f"checkpoint save failed writing {tmp / TRAINER_DCP}: {_short(e)}"
                                      f"{intact_note(model_dir)}") from None

        # (Writing weights.pth on a second thread during the DCP write was measured slower here:
        # the two writers contend for the page cache; see benchmarks/README.md.)
        on_main(info, lambda: publish(tmp, final, weights_payload(plain, ema_state_dict), manifest, hasher),
                tmp, model_dir)
    finally:
        if hasher is not None:
            hasher.close()
    return final


def follow_hashes(tmp: Path) -> FollowingHasher:
    """Rank 0: hash ``weights.pth`` (under its temporary name) and the DCP shards written on
    this node (``__<rank>_<n>.distcp`` for ranks ``0 .. LOCAL_WORLD_SIZE-1``: torchrun gives
    rank 0's node the first ranks) as they are written, on a second thread.

    Other nodes' shards are hashed after their writers have closed them: on a shared
    filesystem (NFS) a file opened while another client writes it may show a stale size.
    """
    local = {f"__{r}_" for r in range(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))}

    def big_file(rel: str) -> bool:
        name = rel.rsplit("/", 1)[-1]
        if name.startswith(f".{WEIGHTS}."):
            return True
        return name.endswith(".distcp") and any(name.startswith(prefix) for prefix in local)

    return FollowingHasher(tmp, big_file).start()


def prepare(tmp: Path) -> None:
    """Rank 0: an empty ``<name>.tmp/trainer.dcp/`` (a leftover of an interrupted or failed save is removed)."""
    remove_tree(tmp)
    (tmp / TRAINER_DCP).mkdir(parents=True)
    point("standard.prepared", tmp)


def dcp_state(plain: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
              rank_state: dict[str, Any], rank: int) -> dict[str, Any]:
    """The flat dict ``trainer.dcp/`` stores: optimizer tensors by FQN, packed ``meta``, this rank's state."""
    tensors, skeleton = split_tensors(get_optimizer_state_dict(plain, optimizer), "optim")
    state: dict[str, Any] = dict(tensors)
    state["meta"] = pack({**meta, "optim": skeleton})
    state[f"rank_state/{rank}"] = pack(rank_state)
    return state


def publish(tmp: Path, final: Path, weights: dict[str, Any], manifest: dict[str, Any],
            hasher: FollowingHasher | None = None) -> None:
    """Rank 0, after every rank's DCP write: markers, ``weights.pth``, manifest, ``.complete``, rotation.

    ``hasher`` (:func:`follow_hashes`, started before the DCP write) has been hashing the
    big files while they were written; whatever it did not cover is hashed here.
    """
    _write_marker(tmp / TRAINER_DCP / COMPLETE)
    point("standard.dcp_complete", tmp)
    with without_zip_crc32():  # like the shards: the manifest's sha256 covers it
        save_torch_file(tmp / WEIGHTS, weights)
    point("standard.weights_written", tmp / WEIGHTS)
    files = describe_files(tmp, known=hasher.finish() if hasher is not None else None)
    fsync_tree(tmp)
    point("standard.synced", tmp)
    write_manifest(tmp / MANIFEST, {"format": "standard", **manifest, "files": files})
    point("standard.manifest_written", tmp / MANIFEST)
    _write_marker(tmp / COMPLETE)
    fsync_dir(tmp)
    point("standard.complete_written", tmp / COMPLETE)
    rotate_into_place(tmp, final)


def _short(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename:
        return f"{e.filename}: {e.strerror or e}"
    return f"{e.__class__.__name__}: {first_line(e, empty='')}"


def _cleanup(tmp: Path) -> None:
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
            _cleanup(tmp)
            error = f"checkpoint save failed: {_short(e)}{intact_note(model_dir)}"
    errors = dist.all_gather_object(error) if info.distributed else [error]
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointSaveError(first)


@dataclass
class LoadedState:
    """What :func:`load_standard` restored.

    Attributes:
        meta: the replicated trainer state saved as ``meta`` (optimizer structure removed).
        rank_state: this rank's saved RNG/loader state, or None when the checkpoint has
            no entry for this rank (world size grew).
        saved_ranks: ranks that have a ``rank_state`` entry.
    """

    meta: dict[str, Any]
    rank_state: dict[str, Any] | None
    ema_state_dict: dict[str, torch.Tensor] | None = None
    saved_ranks: list[int] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def weights_payload(model: nn.Module, ema_state_dict: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """``{"state_dict": raw}`` plus ``"ema_state_dict"`` when an EMA weight set exists."""
    out: dict[str, Any] = {"state_dict": unwrap(model).state_dict()}
    if ema_state_dict is not None:
        out["ema_state_dict"] = ema_state_dict
    return out


def read_weights_file(path: Path) -> dict[str, Any]:
    """Read a standard weights file: ``{"state_dict": sd, "ema_state_dict"?: sd}``.

    The file is mapped, not read: ``load_state_dict`` then copies straight from the page
    cache into the parameters (the file is read once, into no intermediate buffer).

    Raises:
        CheckpointError: the file cannot be opened.
        CheckpointParseError: ``torch.load(weights_only=True)`` refused it, it is damaged,
            or it is not a pimm weights file.
    """
    obj = load_torch_file(path, mmap=True)
    ema = obj.get("ema_state_dict") if isinstance(obj, dict) else None
    if not isinstance(obj, dict) or not _is_tensor_dict(obj.get("state_dict")) or not (
            ema is None or _is_tensor_dict(ema)):
        raise CheckpointParseError(f"{path} is not a pimm weights file (expected a dict with a 'state_dict' key "
                                   "mapping names to tensors)")
    return obj


def _is_tensor_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


DtypeCast = tuple[str, torch.dtype, torch.dtype]  # (tensor name, saved dtype, dtype now)


def dtype_casts(saved: dict[str, torch.dtype], now: dict[str, torch.dtype]) -> list[DtypeCast]:
    """The tensors present in both whose saved dtype differs from the one now, sorted by name."""
    return [(k, saved[k], now[k]) for k in sorted(saved.keys() & now.keys()) if saved[k] != now[k]]


def check_dtypes(path: Path, casts: list[DtypeCast], strict: bool) -> list[str]:
    """Refuse, or describe, a resume that would cast checkpoint tensors to other dtypes.

    A load copies each saved tensor into the model's (or optimizer's) own, converting
    silently; a model cast to bf16 after it was built, or fp32 moments loaded into bf16
    ones, must be a decision, never an accident.

    Returns:
        ``[]`` when nothing is cast; else one warning naming what is cast (strict False).

    Raises:
        CheckpointError: (exit code 2) ``strict`` and some dtype differs; names the first
            tensors with their dtypes saved -> now, and the fix.
    """
    if not casts:
        return []
    groups: dict[tuple[str, str], list[str]] = {}
    for name, saved, now in casts:
        groups.setdefault((_dtype_name(saved), _dtype_name(now)), []).append(name)

    def listed(limit: int) -> str:
        return "; ".join(f"{a} -> {b}: {', '.join(names[:limit])}"
                         f"{f' (+{len(names) - limit} more)' if len(names) > limit else ''}"
                         for (a, b), names in groups.items())

    if strict:
        raise CheckpointError(f"{path} holds tensors in other dtypes than this model and optimizer (saved -> now: "
                              f"{listed(3)}); build the model in the saved dtype, or set resume_strict_state = false "
                              "to cast them", exit_code=2)
    return [f"cast {len(casts)} tensors of {path} to this model's and optimizer's dtypes (resume_strict_state=false; "
            f"saved -> now: {listed(10)})"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_compatible(model: nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """Raise :class:`CheckpointError` naming missing, unexpected and shape-mismatched keys."""
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    shapes = sorted(f"{k} {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
                    for k in set(own) & set(sd) if tuple(own[k].shape) != tuple(sd[k].shape))
    if missing or unexpected or shapes:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
            if items:
                more = f" (+{len(items) - 3} more)" if len(items) > 3 else ""
                parts.append(f"{label}: {', '.join(items[:3])}{more}")
        raise CheckpointError(f"{source} does not match the model: " + "; ".join(parts))


def load_standard(ckpt: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None, info: DistInfo,
                  strict: bool = True) -> LoadedState:
    """Restore model weights and optimizer state from a standard checkpoint; every rank calls it.

    Optimizer tensors are read through DCP, so a checkpoint written at another world
    size reshards. The caller applies ``meta`` (scheduler, scaler, counters) and
    ``rank_state`` according to the resume policy. The weights' keys, shapes and dtypes
    and the optimizer state's shapes and dtypes are checked before anything is loaded.

    Args:
        strict: with False, optimizer state that does not fit is skipped, and tensors
            saved in another dtype than the model's or optimizer's are cast; both are
            reported in ``LoadedState.skipped`` instead of raising. Model keys and shapes
            are always strict.

    Raises:
        CheckpointError: weights do not match (names the tensors); when strict, optimizer
            state does not match, or a saved dtype differs from the model's or
            optimizer's (exit code 2, names them); a file cannot be read.
        CheckpointParseError: a file is hostile or malformed (names it; nothing in it ran).
    """
    weights_path = ckpt / WEIGHTS
    weights = read_weights_file(weights_path)
    plain = unwrap(model)
    check_compatible(plain, weights["state_dict"], str(weights_path))
    casts = dtype_casts({k: v.dtype for k, v in weights["state_dict"].items()},
                        {k: v.dtype for k, v in plain.state_dict().items()})

    path = ckpt / TRAINER_DCP
    reader = MappedFileSystemReader(path)
    metadata = reader.read_metadata()
    saved = metadata.state_dict_metadata
    if "meta" not in saved:
        raise CheckpointParseError(f"{path} is not a pimm trainer state (no 'meta' item)")
    saved_ranks = sorted(int(k.split("/", 1)[1]) for k in saved
                         if k.startswith("rank_state/") and k.split("/", 1)[1].isdigit())

    request: dict[str, Any] = {"meta": torch.empty(saved["meta"].size, dtype=torch.uint8)}
    rank_key = f"rank_state/{info.rank}"
    if rank_key in saved:
        request[rank_key] = torch.empty(saved[rank_key].size, dtype=torch.uint8)
    skipped: list[str] = []
    fresh = optimizer if optimizer is not None and not optimizer.state else None
    try:
        if optimizer is not None:
            _empty_optimizer_state(optimizer)
            target, _ = split_tensors(get_optimizer_state_dict(plain, optimizer), "optim")
            saved_optim = {k for k in saved if k.startswith("optim/")}
            mismatched = sorted(k for k in set(target) & saved_optim if tuple(target[k].shape) != tuple(saved[k].size))
            missing = sorted(set(target) - saved_optim)
            extra = sorted(saved_optim - set(target))  # e.g. state of a parameter frozen since the save
            if mismatched or missing or extra:
                parts = [f"{label}: {', '.join(keys[:3])}{f' (+{len(keys) - 3} more)' if len(keys) > 3 else ''}"
                         for label, keys in (("shape differs", mismatched), ("not in the checkpoint", missing),
                                             ("not in this optimizer", extra)) if keys]
                problem = f"optimizer state in {path} does not match the model/optimizer: {'; '.join(parts)}"
                if strict:
                    raise CheckpointError(problem)
                skipped.append(problem + " (skipped: resume_strict_state=false)")
                if fresh is not None:  # a fresh optimizer, not the uninitialized buffers allocated above
                    fresh.state.clear()
                optimizer = None
            else:
                casts += dtype_casts({k: saved[k].properties.dtype for k in saved_optim},
                                     {k: target[k].dtype for k in saved_optim})
                # DCP reads straight into the optimizer's own state tensors (for a fresh
                # optimizer, the empty ones _empty_optimizer_state allocated): no second copy.
                request.update({k: target[k] for k in saved_optim})
        skipped += check_dtypes(ckpt, casts, strict)

        plain.load_state_dict(weights["state_dict"])
        try:
            dcp.load(request, storage_reader=reader, no_dist=not info.distributed)
        except CheckpointException as e:  # a BaseException: one rank's failure, raised on every rank
            raise _load_failure(path, e) from None
        meta = _unpack_checked(request.pop("meta"), _item_file(path, metadata, "meta"), "meta")
        problem = meta_problem(meta, "optim")
        if problem:
            raise CheckpointParseError(f"{path} is not a pimm trainer state: its 'meta' item {problem}")
        skeleton = meta.pop("optim")
        rank_state = (_unpack_checked(request.pop(rank_key), _item_file(path, metadata, rank_key), rank_key)
                      if rank_key in request else None)
        if rank_state is not None and not isinstance(rank_state, dict):
            raise CheckpointParseError(f"{path} is not a pimm trainer state: its {rank_key!r} item is not a dict")
        if optimizer is not None:
            set_optimizer_state_dict(plain, optimizer, join_tensors(skeleton, request))
    except BaseException:
        if fresh is not None:  # uninitialized state buffers (_empty_optimizer_state) must not outlive a failed load
            fresh.state.clear()
        raise
    return LoadedState(meta=meta, rank_state=rank_state, ema_state_dict=weights.get("ema_state_dict"),
                       saved_ranks=saved_ranks, skipped=skipped)


def _load_failure(path: Path, e: CheckpointException) -> CheckpointError:
    """The error of a failed ``dcp.load``: a rank's own :class:`CheckpointError` (a refused
    shard), else one line naming ``path`` and the first rank's exception."""
    errors = [exc for exc, _ in e.failures.values()] if isinstance(e.failures, dict) else []
    own = next((exc for exc in errors if isinstance(exc, CheckpointError)), None)
    if own is not None:
        return own
    first = errors[0] if errors else e
    lines = [ln.strip() for ln in str(first).splitlines() if ln.strip()]
    return CheckpointError(f"cannot load {path}: {first.__class__.__name__}: {lines[0] if lines else ''}".rstrip(": "))


META_KEYS = ("trainer", "scheduler", "scaler", "world_size", "workers_per_rank")
COUNTERS = ("global_step", "epoch", "iter")


def meta_problem(meta: Any, *extra: str) -> str | None:
    """What makes ``meta`` (the trainer state a loader returns) unusable by a resume, or None."""
    if not isinstance(meta, dict):
        return f"is a {type(meta).__name__}, not a dict"
    missing = [k for k in (*META_KEYS, *extra) if k not in meta]
    if missing:
        return f"has no {', '.join(missing)}"
    trainer = meta["trainer"]
    if not isinstance(trainer, dict) or not all(isinstance(trainer.get(k), int) for k in COUNTERS):
        return "has no integer trainer counters (global_step, epoch, iter)"
    if not isinstance(meta["world_size"], int) or not isinstance(meta["workers_per_rank"], int):
        return "has a world_size or workers_per_rank that is not an integer"
    return None


def _item_file(path: Path, metadata: Any, key: str) -> Path:
    """The shard file under ``path`` that holds DCP item ``key`` (``path`` itself when unknown)."""
    rel = next((info.relative_path for index, info in metadata.storage_data.items() if index.fqn == key), None)
    return path / rel if rel else path


def _unpack_checked(t: torch.Tensor, path: Path, key: str) -> Any:
    """:func:`unpack` of item ``key``, stored in ``path``.

    Raises:
        CheckpointParseError: ``torch.load(weights_only=True)`` refused or could not parse it.
    """
    try:
        return unpack(t)
    except Exception as e:
        raise CheckpointParseError(f"{load_failure(path, e)} (item {key!r})") from None


def _empty_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer uninitialized state tensors of the right shapes and dtypes for a load to fill.

    DCP's ``get_optimizer_state_dict`` materializes a fresh optimizer's state by running a
    zero-gradient ``step()``: the whole optimizer update over every parameter (~75 % of a
    288 MiB load here). The same structure comes for free from a step of a copy of the
    optimizer over ``meta`` tensors (shapes, strides and dtypes only), one per distinct
    (param group, shape, strides, dtype): per-parameter state in ``torch.optim`` depends
    on nothing else. The real tensors are then allocated empty, and the load overwrites
    every one of them (or the caller clears the state). Leaves the optimizer untouched, so DCP's own step
    runs, when it already has state, when a parameter is not a plain tensor, or when the
    copy cannot be built or stepped on ``meta`` (an optimizer class with extra constructor
    arguments, one that needs a closure, ``fused``).
    """
    if optimizer.state:
        return
    params: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its meta stand-in)
    groups = []
    try:
        for g, group in enumerate(optimizer.param_groups):
            metas: dict[tuple, torch.Tensor] = {}
            for p in group["params"]:
                if type(p) not in (torch.Tensor, nn.Parameter):
                    return
                key = (g, tuple(p.shape), tuple(p.stride()), p.dtype, p.requires_grad)
                if key not in metas:  # empty_like keeps the layout (channels_last, transposed), as zeros_like does
                    m = metas[key] = torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
                    if p.requires_grad:
                        m.grad = torch.empty_like(m)
                params.append((p, metas[key]))
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(metas.values())})
        shadow = type(optimizer)(groups)
        shadow.step()
    except Exception:
        return
    for p, m in params:
        for key, value in shadow.state.get(m, {}).items():
            if isinstance(value, torch.Tensor):
                value = (torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=p.device)
                         if value.is_meta else value.clone())
            optimizer.state[p][key] = value


def write_weights_file(path: Path, model: nn.Module, manifest: dict[str, Any],
                       ema_state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Publish a weights-only file (``model_best.pth``, ``iter_<step>.pth``) with a sidecar manifest.

    The sidecar ``<name>.json`` records step, metrics and the file's size and sha256.
    """
    save_torch_file(path, weights_payload(model, ema_state_dict))
    from .manifest import sha256_file

    write_manifest(path.with_name(path.name + ".json"), {
        "format": "weights", **manifest,
        "files": {path.name: {"size": path.stat().st_size, "sha256": sha256_file(path)}},
    })


class _ReusedStaging(AsyncStager):
    """CPU copies of the checkpointed tensors, in buffers kept from one save to the next.

    Staging is all of an async save's stall. Fresh buffers (DCP's default staging, a
    ``clone``) make the training thread fault in every page of a new allocation; copying
    into buffers that are already mapped is about 4x faster on CPU. Safe because at most
    one save is in flight (``AsyncStandardSaver.save`` waits for the previous one before
    copying). Costs one resident CPU copy of the checkpointed state between saves.
    """

    _synchronize_after_execute = False

    def __init__(self, pool: ThreadPoolExecutor | None = None) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.pool = pool

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        if type(t) is not torch.Tensor:  # e.g. a DTensor: a plain CPU copy, not cached
            return t.detach().to("cpu", copy=True)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._buffers[key] = torch.empty(t.shape, dtype=t.dtype)
        return buf.copy_(t.detach())

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | Future:
        """Copy DCP's state dict into the kept buffers: on :attr:`pool` when set (DCP's
        ``async_save`` then waits for the returned future before writing), else now."""
        if self.pool is None:
            return self._stage_now(state_dict)
        return self.pool.submit(self._stage_now, state_dict)

    def _stage_now(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k: self.copy(f"dcp/{k}", v) if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}


class AsyncStandardSaver:
    """Standard-format saves that write in the background (``checkpoint.async = true``).

    ``save`` stages the state to CPU (the optimizer and trainer state through DCP's
    ``async_save``, the ``weights.pth`` tensors here, both into :class:`_ReusedStaging`
    buffers) and returns; the write runs in a
    background thread, DCP's collectives on a separate gloo process group so they never
    interleave with training collectives. Publication — ``trainer.dcp/.complete``,
    ``weights.pth``, ``manifest.json``, ``.complete`` and the rotation — happens only
    after the background write has finished. At most one save is in flight: the next
    ``save`` (and :meth:`wait`) waits for the previous one. Until it is published the
    previous ``last`` stays the selected candidate, so a crash mid-write loses nothing
    but the save in flight.
    """

    def __init__(self, info: DistInfo):
        self.info = info
        self.pg = torch.distributed.new_group(backend="gloo") if info.distributed else None
        self._future = None
        self._thread = None
        self._error: str | None = None
        # Staging copies run on this thread while the training thread goes on with the next
        # forward/backward passes; the trainer calls wait_staged() before the optimizer
        # step, the first thing that changes what is being copied.
        self._staging_pool = ThreadPoolExecutor(1, thread_name_prefix="pimm-staging")
        self._staging = _ReusedStaging(self._staging_pool)
        self._staged: list[Future] = []

    def save(self, model_dir: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
             rank_state: dict[str, Any], manifest: dict[str, Any],
             ema_state_dict: dict[str, torch.Tensor] | None = None, name: str = "last") -> Path:
        """Start a background save (every rank calls it); returns the path it will publish.

        Until :meth:`wait_staged` returns, the parameters, EMA weights and optimizer state
        must not change (the trainer waits before its next optimizer step). Buffers
        (BatchNorm running statistics change in forward) and the packed trainer state are
        copied before this returns.
        """
        self.wait()
        final, tmp = model_dir / name, model_dir / f"{name}.tmp"

        on_main(self.info, lambda: prepare(tmp), tmp, model_dir)
        if self.info.local_rank == 0:  # on the staging thread, which runs before the write starts
            self._staging_pool.submit(release_cached_pages, final)
        hasher = follow_hashes(tmp) if self.info.is_main else None
        try:
            self._start(model_dir, final, tmp, hasher, model=model, optimizer=optimizer, meta=meta,
                        rank_state=rank_state, manifest=manifest, ema_state_dict=ema_state_dict)
        except BaseException:
            if hasher is not None:  # the publishing thread, which owns it otherwise, never started
                hasher.close()
            raise
        return final

    def _start(self, model_dir: Path, final: Path, tmp: Path, hasher: FollowingHasher | None, *, model: nn.Module,
               optimizer: torch.optim.Optimizer, meta: dict[str, Any], rank_state: dict[str, Any],
               manifest: dict[str, Any], ema_state_dict: dict[str, torch.Tensor] | None) -> None:
        """Stage and start the background write; on rank 0 also the thread that publishes it."""
        import threading

        plain = unwrap(model)
        state = dcp_state(plain, optimizer, meta, rank_state, self.info.rank)
        response = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(tmp / TRAINER_DCP, sync_files=True),
                                  process_group=self.pg, no_dist=not self.info.distributed,
                                  async_stager=self._staging)
        future = self._future = response.upload_completion  # wait() waits for it even if the rest fails
        self._staged = [response.staging_completion]
        if not self.info.is_main:
            return
        payload = weights_payload(plain, ema_state_dict)
        buffers = {n for n, _ in plain.named_buffers()}
        weights = {k: dict(v) if isinstance(v, dict) else v for k, v in payload.items()}
        ties = {k: find_aliases(v) for k, v in weights.items() if isinstance(v, dict)}  # copied once, kept tied
        for n in buffers & weights["state_dict"].keys() - ties["state_dict"].keys():
            weights["state_dict"][n] = self._staging.copy(f"state_dict/{n}", weights["state_dict"][n])

        def stage_weights() -> None:
            for k, v in weights.items():
                if isinstance(v, dict):
                    for n, t in v.items():
                        if not (k == "state_dict" and n in buffers) and n not in ties[k]:
                            v[n] = self._staging.copy(f"{k}/{n}", t)
                    v.update({alias: v[kept] for alias, kept in ties[k].items()})

        weights_staged = self._staging_pool.submit(stage_weights)
        self._staged.append(weights_staged)

        def finish() -> None:
            try:
                future.result()
                weights_staged.result()
                publish(tmp, final, weights, manifest, hasher)
                logging.getLogger("pimm").info("saved %s (step %s, epoch %s, iter %s; written in the background)",
                                               final, manifest.get("step"), manifest.get("epoch"),
                                               manifest.get("iter"))
            except Exception as e:
                hasher.close()
                _cleanup(tmp)
                self._error = f"checkpoint save failed: {_short(e)}{intact_note(model_dir)}"

        self._thread = threading.Thread(target=finish, name="pimm-async-save", daemon=False)
        self._thread.start()

    def wait_staged(self) -> None:
        """Block until the save in flight has copied everything it saves (not until it is
        written): after this the parameters and optimizer state may change. A staging
        failure is reported by :meth:`wait`."""
        if self._staged:
            futures_wait(self._staged)
            self._staged = []

    @property
    def in_flight(self) -> bool:
        return (self._thread is not None and self._thread.is_alive()) or (
            self._future is not None and not self._future.done())

    def wait(self) -> None:
        """Block until the save in flight is published (every rank calls it at the same point).

        Raises:
            CheckpointSaveError: on every rank, when the background save failed.
        """
        error = None
        self.wait_staged()
        try:
            if self._future is not None:
                self._future.result()
        except Exception as e:
            error = f"checkpoint save failed: {_short(e)}"
        if self._thread is not None:
            self._thread.join()
        error = self._error or error  # rank 0's publishing thread adds what a resume would now select
        self._future = self._thread = None
        self._error = None
        errors = dist.all_gather_object(error) if self.info.distributed else [error]
        first = next((e for e in errors if e), None)
        if first:
            raise CheckpointSaveError(first)
