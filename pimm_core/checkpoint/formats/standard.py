"""The ``standard`` checkpoint format: ``model/last/{weights.pth, trainer.dcp/, manifest.json, .complete}``.

- ``weights.pth``: ``{"state_dict": ...}`` of the unwrapped model (no ``module.`` or
  ``_orig_mod.`` prefixes), loadable with plain ``torch.load(weights_only=True)``.
- ``trainer.dcp/``: written with ``torch.distributed.checkpoint`` by every rank.
  Keys: ``optim/<fqn>/<state>`` tensors (FQN-keyed via DCP's ``get_optimizer_state_dict``,
  so they reshard across world sizes), ``meta`` (packed optimizer structure,
  scheduler, scaler, trainer counters and metric state) and ``rank_state/<rank>``
  (packed per-rank RNG and loader cursor). Gets its own ``.complete``.
  A sharded (FSDP2) model adds its weights: ``model/<fqn>``, ``ema/<fqn>`` and
  ``weights_aliases``, written by every rank in parallel (:mod:`.sharded`); ``weights.pth``
  then holds the gathered copy, or is not written (``gather_weights=False``: the manifest
  says ``"weights": "trainer.dcp"``).
- ``manifest.json``: torch-free description with sizes and sha256 of every file.
- ``.complete``: written last.

Publishing: everything is written under ``<name>.tmp/``, fsynced, then rotated in
(``last`` -> ``last.prev``, ``last.tmp`` -> ``last``, ``last.prev`` removed), with a
directory fsync after each rename.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...errors import CheckpointError, CheckpointParseError, CheckpointSaveError
from ...faults import point
from ...fsio import BackgroundSync, release_cached_pages
from ...process.dist import DistInfo
from ..publish.rotation import (
    follow_hashes,
    intact_note,
    on_main,
    prepare,
    publish,
    remove_quietly,
    short_error,
    wait_for_purges,
    without_zip_crc32,
)
from ..select.selection import TRAINER_DCP, WEIGHTS, WEIGHTS_FIELD
from ..tensors.state import is_sharded, join_tensors, load_full_state_dict, pack, split_tensors, unpack, unwrap
from .optim_structure import structure_fix, structure_problem
from .protocol import LoadedState, SaveItem, meta_problem
from .weights_file import check_compatible, check_dtypes, dtype_casts, read_weights_file, weights_payload

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException

    from ..publish.follow import FollowingHasher

# torch.distributed.checkpoint (with DTensor and FSDP, which it imports) adds ~40 % to the CPU
# time of `import torch`: it, and the modules here that need it, are imported by the first save
# or load, not by a run's start-up (benchmarks/startup.py, docs/performance.md).


class StandardFormat:
    """``checkpoint_format = "standard"``: :func:`save_standard` and :func:`load_standard`
    (:class:`~pimm_core.checkpoint.formats.protocol.CheckpointFormat`); every save is synchronous."""

    name = "standard"
    asynchronous = False

    def __init__(self, info: DistInfo, keep_full: int = 1):
        self.info, self.keep_full = info, keep_full

    def save(self, model_dir: Path, item: SaveItem, *, background: bool = False) -> Path:
        return save_standard(model_dir, model=item.model, optimizer=item.optimizer, meta=item.meta,
                             rank_state=item.rank_state, manifest=item.manifest, info=self.info,
                             ema_state_dict=item.ema_weights(), gather_weights=item.gather_weights,
                             keep_full=self.keep_full)

    def load(self, path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             strict: bool = True, ema_target: dict[str, torch.Tensor] | None = None) -> LoadedState:
        return load_standard(path, model=model, optimizer=optimizer, info=self.info, strict=strict,
                             ema_target=ema_target)

    def wait_staged(self) -> None:
        pass

    def wait(self) -> None:
        pass


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
    gather_weights: bool = True,
    keep_full: int = 1,
) -> Path:
    """Write and publish a standard checkpoint; every rank must call it.

    Args:
        model: the trained module (wrappers allowed; weights are saved unwrapped).
        meta: replicated, non-tensor trainer state (scheduler, scaler, counters, metrics).
        rank_state: this rank's state (RNG, loader cursor); stored under ``rank_state/<rank>``.
        manifest: fields for ``manifest.json`` (step, epoch, iter, world size, metrics...);
            ``format`` and ``files`` are added here.
        ema_state_dict: the EMA weight set, stored in ``weights.pth`` as ``ema_state_dict``
            (and, for a sharded model, in ``trainer.dcp/`` as ``ema/<fqn>``).
        gather_weights: a sharded (FSDP2) model only: also gather the full weights into
            ``weights.pth`` (a collective; rank 0 holds them on CPU while it writes); False:
            no ``weights.pth``, the manifest says ``"weights": "trainer.dcp"``.

    Returns:
        The published directory ``model_dir/<name>``.

    Raises:
        OSError: a write failed; the previously published checkpoint is untouched.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    final = model_dir / name
    tmp = model_dir / f"{name}.tmp"

    # A removal of the previous save's last.prev still running is finished first (in a run
    # it finished long ago, during training): its failure then stops this save before it
    # writes anything, and the page cache it frees is reused by this save's writes.
    on_main(info, lambda: (wait_for_purges(), prepare(tmp)), tmp, model_dir)
    # The previous checkpoint's page cache is released so the writes reuse its pages: on rank 0
    # in step with the writes (follow_hashes), on another node's first rank (the page cache
    # is the node's) at once.
    if info.local_rank == 0 and not info.is_main:
        release_cached_pages(final)
    hasher = follow_hashes(tmp, previous=final, own_shards=True) if info.is_main else None
    # Rank 0's shards are fsynced in the background while it writes weights.pth (publish
    # waits for them before the rename); the other ranks' by DCP itself, before its last
    # collective, so they are durable before rank 0 publishes.
    syncs = BackgroundSync() if info.is_main else None
    try:
        plain = unwrap(model)
        sharded = is_sharded(plain)
        state = dcp_state(plain, optimizer, meta, rank_state, info.rank, ema_state_dict)
        try:
            with without_zip_crc32():
                dcp.save(state, storage_writer=_shard_writer(tmp / TRAINER_DCP, hasher, syncs),
                         no_dist=not info.distributed)
            if syncs is not None:
                syncs.start()
            point("standard.dcp_written", tmp / TRAINER_DCP)
        except (Exception, CheckpointException) as e:  # DCP raises on every rank when any rank's write failed
            cause = short_error(e, tmp / TRAINER_DCP)
            if info.is_main:
                hasher.close()
                remove_quietly(tmp)
            raise CheckpointSaveError(f"checkpoint save failed: {cause}{intact_note(model_dir)}") from None

        # (Writing weights.pth on a second thread during the DCP write was measured slower here:
        # the two writers contend for the page cache; see benchmarks/README.md.)
        if not sharded:
            weights = lambda: weights_payload(plain, ema_state_dict)  # noqa: E731 (rank 0, inside on_main)
        else:  # the gather is a collective: every rank, before rank 0 publishes
            gathered = weights_payload(plain, ema_state_dict) if gather_weights else None
            weights = lambda: gathered  # noqa: E731
            if not gather_weights:
                manifest = {**manifest, WEIGHTS_FIELD: TRAINER_DCP}
        on_main(info, lambda: publish(tmp, final, weights(), manifest, hasher, keep_full, syncs), tmp, model_dir)
    finally:
        if hasher is not None:
            hasher.close()
        if syncs is not None:
            syncs.close()
    return final


def _shard_writer(path: Path, hasher: FollowingHasher | None, syncs: BackgroundSync | None = None) -> Any:
    """DCP's ``FileSystemWriter`` for ``path``; with ``hasher``, each shard (``*.distcp``) this
    process writes is hashed on the hashing threads as its bytes reach the file, trailing the
    writer (:meth:`~..publish.follow.FollowingHasher.writing`). Every file is
    fsynced: by DCP before its last collective, or, with ``syncs``, not by DCP: each file it
    writes is added to ``syncs`` (the caller starts and waits for those fsyncs)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem

    writer = dcp.FileSystemWriter(path, sync_files=syncs is None)
    if hasher is None and syncs is None:
        return writer

    class HashingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as stream:
                if syncs is not None and mode == "wb":
                    syncs.add(stream.fileno())
                if hasher is None or mode != "wb" or not str(path).endswith(".distcp"):
                    yield stream
                    return
                with hasher.writing(stream) as hashed:
                    yield hashed

    writer.fs = HashingFileSystem()
    return writer


def dcp_state(plain: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
              rank_state: dict[str, Any], rank: int,
              ema_state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The flat dict ``trainer.dcp/`` stores: optimizer tensors by FQN, packed ``meta``, this rank's
    state; for a sharded model also its weights and ``ema_state_dict`` (:func:`.sharded.sharded_items`)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from .optim_state import unstepped
    from .sharded import sharded_items

    with unstepped(optimizer, fill=False):  # (a stateless optimizer is not stepped to make state)
        tensors, skeleton = split_tensors(get_optimizer_state_dict(plain, optimizer), "optim")
    state: dict[str, Any] = dict(tensors)
    if is_sharded(plain):
        state.update(sharded_items(plain, ema_state_dict))
    state["meta"] = pack({**meta, "optim": skeleton})
    state[f"rank_state/{rank}"] = pack(rank_state)
    return state



def load_standard(ckpt: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None, info: DistInfo,
                  strict: bool = True, ema_target: dict[str, torch.Tensor] | None = None) -> LoadedState:
    """Restore model weights and optimizer state from a standard checkpoint; every rank calls it.

    Optimizer tensors are read through DCP, so a checkpoint written at another world
    size reshards, between plain tensors (DDP, one process) and ``DTensor`` shards (FSDP2)
    in either direction. The weights come from ``trainer.dcp/model/*`` when the save was
    sharded (resharded the same way), else from ``weights.pth`` (into a sharded model
    through :func:`~..tensors.state.load_full_state_dict`). The caller applies ``meta`` (scheduler,
    scaler, counters) and ``rank_state`` according to the resume policy. The weights'
    keys, shapes and dtypes and the optimizer state's shapes and dtypes are checked before
    anything is loaded.

    Args:
        strict: with False, optimizer state that does not fit is skipped, and tensors
            saved in another dtype than the model's or optimizer's are cast; both are
            reported in ``LoadedState.skipped`` instead of raising. Model keys and shapes
            are always strict.
        ema_target: the EMA's tensors by name; filled in place from ``trainer.dcp/ema/*``
            when the save was sharded (any dtype: the copy casts) and returned as
            ``LoadedState.ema_state_dict``. Without it such EMA weights are returned as new
            full CPU tensors; from an unsharded save ``weights.pth``'s are returned.

    Raises:
        CheckpointError: weights do not match (names the tensors); when strict, optimizer
            state does not match, or a saved dtype differs from the model's or
            optimizer's (exit code 2, names them); a file cannot be read.
        CheckpointParseError: a file is hostile or malformed (names it; nothing in it ran).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    from .mapped_reader import MappedFileSystemReader
    from .optim_state import frozen_state_loaded, unstepped
    from .sharded import EMA, MODEL, ema_targets, model_targets

    plain = unwrap(model)
    sharded_now = is_sharded(plain)
    path = ckpt / TRAINER_DCP
    reader = MappedFileSystemReader(path)
    metadata = reader.read_metadata()
    saved = metadata.state_dict_metadata
    if "meta" not in saved:
        raise CheckpointParseError(f"{path} is not a pimm trainer state (no 'meta' item)")
    saved_ranks = sorted(int(k.split("/", 1)[1]) for k in saved
                         if k.startswith("rank_state/") and k.split("/", 1)[1].isdigit())

    # the trainer state first (small): what it says is checked before anything is loaded
    first: dict[str, Any] = {"meta": torch.empty(saved["meta"].size, dtype=torch.uint8)}
    try:
        dcp.load(first, storage_reader=reader, no_dist=not info.distributed)
    except CheckpointException as e:
        raise _load_failure(path, e) from None
    meta = _unpack_checked(first["meta"], _item_file(path, metadata, "meta"), "meta")
    problem = meta_problem(meta, "optim")
    if problem:
        raise CheckpointParseError(f"{path} is not a pimm trainer state: its 'meta' item {problem}")
    skeleton = meta.pop("optim")
    request: dict[str, Any] = {}
    weights = weights_map = None
    if any(k.startswith(MODEL) for k in saved):  # a sharded save: the weights are DCP items
        model_sd, target = model_targets(plain, saved, path)
        casts = dtype_casts({k: saved[MODEL + k].properties.dtype for k in target}, {k: v.dtype for k, v in target.items()})
        request.update({MODEL + k: v for k, v in target.items()})
    else:
        weights_path = ckpt / WEIGHTS
        weights, weights_map = read_weights_file(weights_path, keep_map=True)
        check_compatible(plain, weights["state_dict"], str(weights_path))
        casts = dtype_casts({k: v.dtype for k, v in weights["state_dict"].items()},
                            {k: v.dtype for k, v in plain.state_dict().items() if isinstance(v, torch.Tensor)})
    ema = ema_targets(ema_target, saved, path) if any(k.startswith(EMA) for k in saved) else None
    request.update({EMA + k: v for k, v in (ema or {}).items()})  # (EMA weights are kept in the params' dtype)
    rank_key = f"rank_state/{info.rank}"
    if rank_key in saved:
        request[rank_key] = torch.empty(saved[rank_key].size, dtype=torch.uint8)
    skipped: list[str] = []
    fresh = optimizer if optimizer is not None and not optimizer.state else None
    try:
        if optimizer is not None:
            with unstepped(optimizer, fill=True):  # (a fresh optimizer's state, made by no step of it)
                target, now_skeleton = split_tensors(get_optimizer_state_dict(plain, optimizer), "optim")
            changed = structure_problem(skeleton, meta.get("optimizer_class"), now_skeleton,
                                        f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                                        {n for n, p in plain.named_parameters() if not p.requires_grad})
            if changed and strict:
                raise CheckpointError(f"cannot resume from {ckpt}: {changed}; {structure_fix(ckpt / WEIGHTS)}",
                                      exit_code=2)
            saved_optim = {k for k in saved if k.startswith("optim/")}
            if not saved_optim and fresh is not None and target:  # saved before the optimizer's first step
                fresh.state.clear()  # (it stays fresh, as it was then)
                target = {}
            # a parameter frozen now has the state it had while it trained, if it ever did
            frozen = tuple(f"optim/state/{n}/" for n, p in plain.named_parameters() if not p.requires_grad)
            target = {k: v for k, v in target.items() if k in saved_optim or not k.startswith(frozen)}
            mismatched = sorted(k for k in set(target) & saved_optim if tuple(target[k].shape) != tuple(saved[k].size))
            missing = sorted(set(target) - saved_optim)
            extra = sorted(saved_optim - set(target))  # e.g. state of a parameter frozen since the save
            if changed:  # (not strict) the saved state is the state of another optimizer
                skipped.append(changed + "; its state was not loaded: the optimizer starts fresh "
                               "(resume_strict_state=false)")
                if fresh is not None:
                    fresh.state.clear()
                optimizer = None
            elif mismatched or missing or extra:
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
                # optimizer, the empty ones fill_empty_state allocated): no second copy.
                request.update({k: target[k] for k in saved_optim})
        skipped += check_dtypes(ckpt, casts, strict)

        if weights is not None and not (weights_map is not None and not sharded_now and _read_weights_into(
                weights_path, weights_map, plain, weights["state_dict"])):
            load_full_state_dict(plain, weights["state_dict"])
        try:
            dcp.load(request, storage_reader=reader, no_dist=not info.distributed)
        except CheckpointException as e:  # a BaseException: one rank's failure, raised on every rank
            raise _load_failure(path, e) from None
        if weights is None:  # DCP read into the model's own tensors; this applies them as FSDP expects
            set_model_state_dict(plain, model_sd)
        rank_state = (_unpack_checked(request.pop(rank_key), _item_file(path, metadata, rank_key), rank_key)
                      if rank_key in request else None)
        if rank_state is not None and not isinstance(rank_state, dict):
            raise CheckpointParseError(f"{path} is not a pimm trainer state: its {rank_key!r} item is not a dict")
        if optimizer is not None:
            joined = join_tensors(skeleton, request)
            with unstepped(optimizer, fill=False), frozen_state_loaded(plain, joined.get("state")):
                set_optimizer_state_dict(plain, optimizer, joined)
    except BaseException:
        if fresh is not None:  # uninitialized state buffers (fill_empty_state) must not outlive a failed load
            fresh.state.clear()
        raise
    if ema is None and weights is not None:
        ema = weights.get("ema_state_dict")
    return LoadedState(meta=meta, rank_state=rank_state, ema_state_dict=ema, saved_ranks=saved_ranks, skipped=skipped)


def read_trainer_meta(ckpt: Path) -> dict[str, Any]:
    """The trainer state (``meta``: counters, scheduler, optimizer structure...) of standard
    checkpoint ``ckpt``, read alone, without a process group (a dry run's look before a resume).

    Raises:
        CheckpointError: a file cannot be read. CheckpointParseError: the item is malformed.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from .mapped_reader import MappedFileSystemReader

    path = ckpt / TRAINER_DCP
    reader = MappedFileSystemReader(path)
    metadata = reader.read_metadata()
    if "meta" not in metadata.state_dict_metadata:
        raise CheckpointParseError(f"{path} is not a pimm trainer state (no 'meta' item)")
    item = {"meta": torch.empty(metadata.state_dict_metadata["meta"].size, dtype=torch.uint8)}
    try:
        dcp.load(item, storage_reader=reader, no_dist=True)
    except CheckpointException as e:
        raise _load_failure(path, e) from None
    meta = _unpack_checked(item["meta"], _item_file(path, metadata, "meta"), "meta")
    if not isinstance(meta, dict):
        raise CheckpointParseError(f"{path} is not a pimm trainer state: its 'meta' item is not a dict")
    return meta


def _read_weights_into(path: Path, whole: torch.UntypedStorage, plain: nn.Module, sd: dict[str, torch.Tensor]) -> bool:
    """:func:`.direct_read.read_into_module`, a failed read as :class:`CheckpointError` naming ``path``."""
    from .direct_read import read_into_module

    try:
        return read_into_module(path, whole, plain, sd)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None


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

def _item_file(path: Path, metadata: Any, key: str) -> Path:
    """The shard file under ``path`` that holds DCP item ``key`` (``path`` itself when unknown)."""
    rel = next((info.relative_path for index, info in metadata.storage_data.items() if index.fqn == key), None)
    return path / rel if rel else path


def _unpack_checked(t: torch.Tensor, path: Path, key: str) -> Any:
    """:func:`unpack` of item ``key``, stored in ``path``.

    Raises:
        CheckpointParseError: ``torch.load(weights_only=True)`` refused or could not parse it.
    """
    from ..tensors.safe_read import load_failure

    try:
        return unpack(t)
    except Exception as e:
        raise CheckpointParseError(f"{load_failure(path, e)} (item {key!r})") from None
