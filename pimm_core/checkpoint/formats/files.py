"""The single-file checkpoint formats: ``legacy`` and ``single``.

Both are one ``torch.save`` file written by rank 0, published atomically (temporary
name, fsync, rename, directory fsync) with a sidecar manifest ``<file>.json``. Every
value loads with ``torch.load(weights_only=True)``.

``legacy`` — ``model/model_last.pth`` (replaced at each save) and ``model_best.pth``::

    {"format": "legacy", "state_dict": raw, "ema_state_dict"?: ema, "optimizer": FQN-keyed,
     "scheduler": ..., "scaler": ..., "epoch": int, "progress": trainer counters, "ema"?: meta,
     "world_size": int, "workers_per_rank": int, "rng": rank-0 RNG}

It has no per-rank loader cursor, so a mid-epoch legacy checkpoint resumes by replaying
from the epoch boundary.

``single`` — one complete file per checkpoint, ``model/step_<global step>.pth``::

    {"format": "single", "weights": {"raw": sd, "ema"?: sd}, "optimizer": FQN-keyed,
     "scheduler", "scaler", "trainer": counters, "ema"?: meta,
     "rank_states": [per-rank RNG and loader cursor, gathered to rank 0],
     "world_size", "workers_per_rank"}

with relative symlinks ``last`` (every save, including a requested pause), ``best``
(the selection metric improved) and ``final`` (a normal end). A symlink target is a
bare file name in the same directory, so moving the run directory keeps them valid.
Retention (``checkpoint.keep_last``) deletes the oldest ``step_*.pth`` files but never
a pointer's target; it runs after the pointers move, whether a save wrote a new file
(:func:`save_single`) or only moved pointers to a position already on disk
(:func:`move_pointers`), so no file is left that neither a pointer nor the count keeps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import CheckpointError, CheckpointParseError
from ...faults import point, register
from ...fsio import fsync_dir, temp_path
from ...process import dist
from ...process.dist import DistInfo
from ..publish.rotation import on_main, save_torch_file
from ..records.manifest import sha256_file, write_manifest
from ..select.selection import LEGACY_LAST, POINTERS, SINGLE_RE
from ..tensors.safe_read import load_torch_file
from ..tensors.safe_state import decode, encode
from ..tensors.state import is_sharded, load_full_state_dict, unwrap
from .optim_structure import named_groups, structure_fix, structure_problem
from .optim_state import frozen_state_loaded, unstepped
from .protocol import LoadedState, SaveItem, meta_problem
from .weights_file import DtypeCast, check_compatible, check_dtypes, dtype_casts

# (torch.distributed.checkpoint's state-dict functions are imported by the save or load that
# uses them: their import is not a run's start-up; see standard.py)

register("file_format.published", "file_format.sidecar_written", "pointer.linked", "pointer.replaced",
         "single.pointers_set", "single.pruned")



class LegacyFormat:
    """``checkpoint_format = "legacy"`` (:class:`~pimm_core.checkpoint.formats.protocol.CheckpointFormat`):
    rank 0 replaces ``model_last.pth``; no loader cursor, so a mid-epoch one resumes by replay."""

    name = "legacy"
    asynchronous = False

    def __init__(self, info: DistInfo):
        self.info = info

    def save(self, model_dir: Path, item: SaveItem, *, background: bool = False) -> Path:
        path = model_dir / LEGACY_LAST
        on_main(self.info, lambda: save_legacy(model_dir, model=item.model, optimizer=item.optimizer, meta=item.meta,
                                               rank0_state=item.rank_state, manifest=item.manifest,
                                               ema_state_dict=item.ema_weights()),
                temp_path(path), model_dir)
        return path

    def load(self, path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             strict: bool = True, ema_target: dict[str, torch.Tensor] | None = None) -> LoadedState:
        """(``ema_target`` is ignored: the file holds the full EMA weight set, returned as it is.)"""
        return load_file_checkpoint(path, model=model, optimizer=optimizer, rank=self.info.rank,
                                    world_size=self.info.world_size, strict=strict)

    def wait_staged(self) -> None:
        pass

    def wait(self) -> None:
        pass


class SingleFormat(LegacyFormat):
    """``checkpoint_format = "single"``: every rank's state gathered into ``step_<step>.pth``
    with ``item.pointers`` moved to it, then retention (``checkpoint.keep_last``).

    A second save at a step already on disk (``best`` then ``last``/``final`` at the same
    position) only moves its pointers.
    """

    name = "single"

    def __init__(self, info: DistInfo, keep_last: int = 0):
        super().__init__(info)
        self.keep_last = keep_last
        self.saved_step: int | None = None  # the step of the last file this format wrote

    def save(self, model_dir: Path, item: SaveItem, *, background: bool = False) -> Path:
        states = dist.all_gather_object(item.rank_state)
        path = model_dir / f"step_{item.step}.pth"

        def write() -> None:
            if self.saved_step == item.step:
                # this position is already on disk: only move pointers (then retention)
                move_pointers(model_dir, item.pointers, path.name, keep_last=self.keep_last)
            else:
                save_single(model_dir, model=item.model, optimizer=item.optimizer, meta=item.meta,
                            rank_states=states, manifest=item.manifest, ema_state_dict=item.ema_weights(),
                            pointers=item.pointers, keep_last=self.keep_last)

        on_main(self.info, write, temp_path(path), model_dir)
        self.saved_step = item.step
        return path


def _publish_file(path: Path, payload: dict[str, Any], manifest: dict[str, Any], fmt: str) -> None:
    """Write ``payload`` to ``path`` atomically, then its sidecar manifest."""
    save_torch_file(path, payload)
    point("file_format.published", path)
    write_manifest(path.with_name(path.name + ".json"), {
        "format": fmt, **manifest, "files": {path.name: {"size": path.stat().st_size, "sha256": sha256_file(path)}}})
    point("file_format.sidecar_written", path)


def save_legacy(model_dir: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
                rank0_state: dict[str, Any], manifest: dict[str, Any],
                ema_state_dict: dict[str, torch.Tensor] | None) -> Path:
    """Publish ``model_dir/model_last.pth`` (rank 0 only)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    plain = unwrap(model)
    with unstepped(optimizer, fill=False):
        optim_sd = get_optimizer_state_dict(plain, optimizer)
    payload: dict[str, Any] = {
        "format": "legacy", "state_dict": plain.state_dict(), "optimizer": optim_sd,
        **encode({"scheduler": meta["scheduler"], "scaler": meta["scaler"], "epoch": meta["trainer"]["epoch"],
                  "progress": meta["trainer"], "world_size": meta["world_size"],
                  "workers_per_rank": meta["workers_per_rank"], "rng": rank0_state["rng"]}),
    }
    if ema_state_dict is not None:
        payload["ema_state_dict"], payload["ema"] = ema_state_dict, meta["ema"]
    path = model_dir / LEGACY_LAST
    _publish_file(path, payload, {**manifest, "has_loader_state": False}, "legacy")
    return path


def set_pointer(model_dir: Path, name: str, target: str) -> None:
    """Atomically point symlink ``model_dir/name`` at ``target`` (a file name in the same directory)."""
    if "/" in target or target == name:
        raise ValueError(f"pointer {name} must name another file in its own directory, got {target!r}")
    tmp = model_dir / f".{name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(target, tmp)
        point("pointer.linked", tmp)
        os.replace(tmp, model_dir / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(model_dir)
    point("pointer.replaced", model_dir / name)


def pointer_targets(model_dir: Path) -> set[str]:
    """File names that ``last``/``best``/``final`` point at."""
    out = set()
    for name in POINTERS:
        p = model_dir / name
        if p.is_symlink():
            out.add(os.readlink(p))
    return out


def save_single(model_dir: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
                rank_states: list[dict[str, Any]], manifest: dict[str, Any],
                ema_state_dict: dict[str, torch.Tensor] | None, pointers: tuple[str, ...], keep_last: int) -> Path:
    """Publish ``model_dir/step_<step>.pth``, move ``pointers`` to it, apply retention (rank 0 only)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    plain = unwrap(model)
    weights = {"raw": plain.state_dict()}
    if ema_state_dict is not None:
        weights["ema"] = ema_state_dict
    with unstepped(optimizer, fill=False):
        optim_sd = get_optimizer_state_dict(plain, optimizer)
    # (numpy values encoded so that torch.load(weights_only=True) reads them back: safe_state)
    payload = {"format": "single", "weights": weights, "optimizer": optim_sd,
               **encode({k: meta[k] for k in (*SINGLE_META, *OPTIONAL_META) if k in meta}),
               "rank_states": encode(rank_states)}
    path = model_dir / f"step_{meta['trainer']['global_step']}.pth"
    _publish_file(path, payload, manifest, "single")
    for name in pointers:
        set_pointer(model_dir, name, path.name)
    point("single.pointers_set", path)
    prune_single(model_dir, keep_last, current=path.name)
    return path


def move_pointers(model_dir: Path, pointers: tuple[str, ...], target: str, *, keep_last: int) -> None:
    """Point ``pointers`` at the existing ``target`` (a position saved already), then apply retention.

    Moving a pointer can leave a file that no pointer targets any more beyond the
    ``keep_last`` newest (e.g. ``best`` moving off an old step, or ``final``/``last``
    moving at the end): retention runs after every pointer move, not only after a new
    file, so none is left behind.
    """
    for name in pointers:
        set_pointer(model_dir, name, target)
    prune_single(model_dir, keep_last, current=target)


def prune_single(model_dir: Path, keep_last: int, *, current: str | None = None) -> list[str]:
    """Retention of the single format: delete ``step_*.pth`` (and sidecars) beyond the
    ``keep_last`` newest, except a pointer's target and ``current``; 0 keeps everything.

    Call it after the pointers have moved (:func:`save_single`, :func:`move_pointers`).

    Returns:
        The names deleted.
    """
    if not keep_last:
        return []
    keep = pointer_targets(model_dir) | ({current} if current else set())
    steps = sorted((int(m.group(1)), p) for p in model_dir.iterdir() if (m := SINGLE_RE.match(p.name)))
    removed = []
    for _, old in steps[: max(0, len(steps) - keep_last)]:
        if old.name not in keep:
            old.unlink(missing_ok=True)
            old.with_name(old.name + ".json").unlink(missing_ok=True)
            removed.append(old.name)
    fsync_dir(model_dir)
    point("single.pruned", model_dir)
    return removed


def load_file_checkpoint(path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int,
                         world_size: int, strict: bool = True) -> LoadedState:
    """Restore model and optimizer from a ``legacy`` or ``single`` file; returns the rest.

    The returned ``meta`` has the same keys as the standard format's (``trainer``,
    ``scheduler``, ``scaler``, ``ema``, ``world_size``, ``workers_per_rank``). Nothing is
    changed in ``model`` or ``optimizer`` until the file's structure and dtypes are checked.

    Args:
        strict: with False, optimizer state that does not fit is skipped, and tensors
            saved in another dtype than the model's or optimizer's are cast; both are
            reported in ``LoadedState.skipped``.

    Raises:
        CheckpointError: the file cannot be opened; weights that do not fit the model;
            when strict, optimizer state that does not fit, or a saved dtype that differs
            from the model's or optimizer's (exit code 2, names the tensors).
        CheckpointParseError: the file is hostile (it would run code) or malformed (not a
            pimm legacy or single checkpoint); names it, nothing in it ran.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    obj = decode(load_torch_file(path))  # (numpy values as saved: safe_state)
    fmt = obj.get("format") if isinstance(obj, dict) else None
    if fmt not in ("legacy", "single"):
        raise CheckpointParseError(f"{path} is not a pimm legacy or single checkpoint")
    problem = _structure_problem(obj, fmt)
    if problem:
        raise CheckpointParseError(f"{path} is not a well-formed pimm {fmt} checkpoint: {problem}")
    plain = unwrap(model)
    raw = obj["state_dict"] if fmt == "legacy" else obj["weights"]["raw"]
    ema_sd = obj.get("ema_state_dict") if fmt == "legacy" else obj["weights"].get("ema")
    check_compatible(plain, raw, str(path))
    casts = dtype_casts({k: v.dtype for k, v in raw.items()},
                        {k: v.dtype for k, v in plain.state_dict().items() if isinstance(v, torch.Tensor)})
    if optimizer is not None:
        casts += _optimizer_casts(plain, obj["optimizer"])
    if fmt == "legacy":
        meta = {"trainer": obj["progress"], "scheduler": obj["scheduler"], "scaler": obj["scaler"],
                "ema": obj.get("ema"), "world_size": obj["world_size"], "workers_per_rank": obj["workers_per_rank"]}
        rank_state = {"rng": obj["rng"], "loader": None} if rank == 0 and obj["world_size"] == world_size == 1 else None
        saved_ranks = [0]
    else:
        meta = {k: obj[k] for k in (*SINGLE_META, *OPTIONAL_META) if k in obj or k in SINGLE_META}
        states = obj["rank_states"]
        rank_state = states[rank] if rank < len(states) else None
        saved_ranks = list(range(len(states)))
    problem = meta_problem(meta) or (None if rank_state is None or isinstance(rank_state, dict)
                                     else f"has a rank {rank} state that is not a dict")
    if problem:
        raise CheckpointParseError(f"{path} is not a well-formed pimm {fmt} checkpoint: its trainer state {problem}")
    skipped: list[str] = check_dtypes(path, casts, strict)
    load_full_state_dict(plain, raw)
    if optimizer is not None:
        changed = structure_problem(obj["optimizer"], meta.get("optimizer_class"), named_groups(plain, optimizer),
                                    f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                                    {n for n, p in plain.named_parameters() if not p.requires_grad})
        if changed:
            if strict:
                raise CheckpointError(f"cannot resume from {path}: {changed}; {structure_fix(path)}", exit_code=2)
            skipped.append(changed + "; its state was not loaded: the optimizer starts fresh "
                           "(resume_strict_state=false)")
            optimizer = None
    if optimizer is not None:
        fresh = not optimizer.state
        try:
            # the file holds full tensors: a sharded (FSDP2) model takes its shards of them
            with unstepped(optimizer, fill=True), frozen_state_loaded(plain, (obj["optimizer"] or {}).get("state")):
                set_optimizer_state_dict(plain, optimizer, obj["optimizer"],
                                         options=StateDictOptions(full_state_dict=is_sharded(plain)))
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            if fresh:
                optimizer.state.clear()  # no uninitialized state outlives a failed load
            if strict:
                raise CheckpointError(f"optimizer state in {path} does not fit: {e}") from None
            skipped.append(f"optimizer state in {path} skipped (resume_strict_state=false): {e}")
    return LoadedState(meta=meta, rank_state=rank_state, ema_state_dict=ema_sd, saved_ranks=saved_ranks,
                       skipped=skipped)


#: The trainer state a single-format file holds; and what newer ones add (callbacks, objective, optimizer).
SINGLE_META = ("trainer", "scheduler", "scaler", "ema", "world_size", "workers_per_rank")
OPTIONAL_META = ("callbacks", "objective", "optimizer_class", "optimizer_built")


def _structure_problem(obj: dict[str, Any], fmt: str) -> str | None:
    """What is missing from or wrong in a loaded legacy/single checkpoint's top level, or None."""
    if fmt == "legacy":
        need = ("state_dict", "optimizer", "scheduler", "scaler", "progress", "world_size", "workers_per_rank", "rng")
    else:
        need = ("weights", "optimizer", "trainer", "scheduler", "scaler", "world_size", "workers_per_rank",
                "rank_states")
    missing = [k for k in need if k not in obj]
    if missing:
        return f"no {', '.join(missing)}"
    sets = {"raw": obj["state_dict"], "ema": obj.get("ema_state_dict")} if fmt == "legacy" else obj["weights"]
    if not isinstance(sets, dict) or not isinstance(sets.get("raw"), dict):
        return "no raw weights"
    for name, sd in sets.items():
        if sd is not None and not (isinstance(sd, dict) and all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items())):
            return f"the {name} weights are not a state dict of tensors"
    optim = obj["optimizer"]
    if not isinstance(optim, dict) or not isinstance(optim.get("state", {}), dict):
        return "the optimizer state is not a dict"
    if fmt == "single" and not isinstance(obj["rank_states"], list):
        return "rank_states is not a list"
    return None


def _optimizer_casts(plain: nn.Module, saved: dict[str, Any]) -> list[DtypeCast]:
    """Saved optimizer state tensors whose dtype loading would change.

    ``torch.optim.Optimizer.load_state_dict`` casts every floating state tensor but
    ``step`` to its parameter's dtype; ``saved`` is FQN-keyed (``get_optimizer_state_dict``).
    """
    params = dict(plain.named_parameters())
    out: list[DtypeCast] = []
    for fqn, state in sorted((saved.get("state") or {}).items(), key=lambda kv: str(kv[0])):
        p = params.get(fqn) if isinstance(fqn, str) else None
        if p is None or not p.is_floating_point() or not isinstance(state, dict):
            continue
        for key, value in sorted(state.items(), key=lambda kv: str(kv[0])):
            if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point() \
                    and value.dtype != p.dtype:
                out.append((f"optim/state/{fqn}/{key}", value.dtype, p.dtype))
    return out
