"""Reading weight sets from any checkpoint file (the layouts below), safely.

A *weight set* is a flat state dict ``{name: Tensor}`` of a model: ``raw`` (the
trained weights) and, when the run kept one, ``ema`` (the exponential moving
average, with the raw model's buffers at checkpoint time). Every reader here
uses ``torch.load(weights_only=True)`` or safetensors, so a checkpoint can never
run code; a file that needs anything else is refused with :class:`CheckpointError`.

File layouts :func:`read_weight_sets` understands:

=============================================  =======================================
file                                           layout
=============================================  =======================================
``weights.pth``, ``model_best.pth``,           ``{"state_dict": sd, "ema_state_dict"?: sd}``
``iter_<step>.pth`` (standard)
``trainer.dcp/`` of a sharded checkpoint       the same, read from its ``model/*`` and ``ema/*``
saved without gathered weights                 items (:func:`..formats.sharded.read_checkpoint_weights`)
``model_last.pth`` (legacy)                    the same plus ``"optimizer"``, counters...
single-format checkpoint                       ``{"format": "single", "weights": {"raw": sd, "ema"?: sd}, ...}``
``model.safetensors`` (export)                 a flat sd; tied keys dropped at export and
                                               re-added from the ``pimm.aliases`` metadata
``model.bin`` (export), a user's file          a flat sd (``{"model": sd}`` is also accepted)
a PyTorch Lightning ``.ckpt``                  ``{"state_dict": sd, "pytorch-lightning_version", ...}``
                                               (keys carry the LightningModule's attribute
                                               prefix: see ``train.key_rules``)
=============================================  =======================================

Which *file* a source names (a run's ``last``, an export directory, ``hf://``...)
is decided by :func:`~pimm_core.checkpoint.weights.sources.resolve_weight_source`. What is
done with a weight set is elsewhere: renaming its keys (:mod:`.key_rules`), a warm
start (:mod:`.warm_start`), a strict load (:mod:`.strict_load`), an export (:mod:`..export.model_dir`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, CheckpointParseError, UsageError
from ..formats.sharded import read_checkpoint_weights
from ..records.foreign import is_safetensors_head
from ..records.generation import read_whole
from ..tensors.safe_read import load_torch_file
from .sources import checkpoint_record, resolve_weight_source

WEIGHT_SETS = ("raw", "ema")

StateDict = dict[str, torch.Tensor]


# --------------------------------------------------------------------- reading
def read_weight_sets(path: Path) -> dict[str, StateDict]:
    """Read the named weight sets of one checkpoint file.

    Args:
        path: a file, normally from :func:`resolve_weight_source` (see the module
            docstring for the layouts); anything else is resolved with it first.

    Returns:
        ``{"raw": sd}``, plus ``{"ema": sd}`` when the file has EMA weights. Each ``sd``
        maps parameter/buffer names to CPU tensors (dtypes as saved). Tensors that were
        tied when saved are still the same tensor object under each name.

    Raises:
        CheckpointError: the file cannot be opened.
        CheckpointParseError: (exit code 2) the file is refused by
            ``torch.load(weights_only=True)`` (it would run code or needs classes that
            are not plain tensors and containers), cannot be parsed, or is not a state dict.
    """
    return _read(Path(path))[0]


def read_checkpoint(path: Path) -> tuple[dict[str, StateDict], dict[str, Any]]:
    """Like :func:`read_weight_sets`, plus what the file says about itself.

    Returns:
        ``(sets, info)``: ``info["layout"]`` is ``weights`` | ``legacy`` | ``single`` |
        ``safetensors`` | ``state_dict`` | ``lightning`` (a PyTorch Lightning ``.ckpt``: its
        ``state_dict``, keys as the LightningModule names them); ``info["step"]`` is the global step when the
        file records one (else absent); ``info["aliases"]`` (safetensors exports) maps a
        dropped tied key to the key it aliases.
    """
    return _read(Path(path))


def read_source(source: str | os.PathLike[str], *, run_dir: Path | None = None,
                storage_options: dict[str, Any] | None = None
                ) -> tuple[Path, dict[str, StateDict], dict[str, Any], dict[str, Any]]:
    """Resolve a weight source and read its weight sets and its manifest, from one generation.

    Beside a live run (``last`` rotated by every save) the file and the manifest that
    describes it are read from the same checkpoint: a read that a save overtook is done
    again (:func:`~pimm_core.checkpoint.records.generation.read_whole`).

    Args:
        source, run_dir: as :func:`~pimm_core.checkpoint.weights.sources.resolve_weight_source`.

    Returns:
        ``(path, sets, info, record)``: the file read, :func:`read_checkpoint`'s ``sets``
        and ``info``, and :func:`~pimm_core.checkpoint.weights.sources.checkpoint_record` (``{}``
        when no manifest describes the file).

    A remote source (``s3://``..., :mod:`..remote.source`) is downloaded into a temporary
    directory of pimm's own, checked against its manifest or sidecar, read, and removed;
    ``info["remote_file"]`` is then the URL of the file read (``path`` no longer exists).

    Raises:
        GenerationChanged: saves replaced the checkpoint during every try (exit code 75: try again).
        as :func:`resolve_weight_source` and :func:`read_checkpoint`;
        as :func:`~pimm_core.checkpoint.remote.source.local_copy` for a remote source.
    """
    from ..remote.source import is_store_url, local_copy

    if is_store_url(source):
        with local_copy(os.fspath(source), storage_options) as (copy, plan):
            path, sets, info, record = read_source(copy)
            return path, sets, {**info, "remote_file": plan.url_for(copy, path)}, record

    def read(path: Path) -> tuple[Path, dict[str, StateDict], dict[str, Any], dict[str, Any]]:
        sets, info = _read(path)
        return path, sets, info, checkpoint_record(path)

    return read_whole(lambda: resolve_weight_source(source, run_dir=run_dir), read, what=os.fspath(source))


def _read(path: Path) -> tuple[dict[str, StateDict], dict[str, Any]]:
    if not path.is_file():  # a directory or pointer: resolve it as a weight source
        path = resolve_weight_source(path)
    if path.is_dir():  # trainer.dcp/ of a checkpoint whose weights stay sharded
        return _interpret(read_checkpoint_weights(path.parent), path)
    if _is_safetensors(path):
        return _read_safetensors(path)
    obj = load_torch_file(path, hint=". If you wrote it yourself, re-save it with "
                          "torch.save(model.state_dict(), path)")
    return _interpret(obj, path)


def _is_safetensors(path: Path) -> bool:
    """Sniff the header (one rule with :func:`..records.foreign.sniff`): a u64 length that fits, then ``{``."""
    with open(path, "rb") as f:
        return is_safetensors_head(f.read(9), os.fstat(f.fileno()).st_size)


def _read_safetensors(path: Path) -> tuple[dict[str, StateDict], dict[str, Any]]:
    from safetensors import safe_open

    try:
        sd: StateDict = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            for k in f.keys():
                sd[k] = f.get_tensor(k)
    except Exception as e:  # SafetensorError, OSError
        raise CheckpointParseError(f"cannot read {path} as safetensors: {e.__class__.__name__}: {e}") from None
    aliases = _parse_aliases(meta.get("pimm.aliases"), path)
    retie(sd, aliases)
    info: dict[str, Any] = {"layout": "safetensors", "aliases": aliases, "metadata": meta}
    if str(meta.get("pimm.step", "")).isdigit():
        info["step"] = int(meta["pimm.step"])
    return {"raw": sd}, info


def _parse_aliases(text: str | None, path: Path) -> dict[str, str]:
    if not text:
        return {}
    try:
        aliases = json.loads(text)
    except ValueError:
        raise CheckpointParseError(f"{path}: metadata pimm.aliases is not JSON") from None
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise CheckpointParseError(f"{path}: metadata pimm.aliases must map tensor names to tensor names")
    return aliases


def retie(sd: StateDict, aliases: dict[str, str]) -> StateDict:
    """Add each alias key of ``aliases`` (``{alias: canonical}``) back to ``sd``, in place.

    The alias gets the canonical tensor object itself, so the two names stay tied.

    Raises:
        CheckpointError: a canonical key is absent from ``sd``.
    """
    for alias, canonical in sorted(aliases.items()):
        if canonical not in sd:
            raise CheckpointError(f"tied tensor {alias} aliases {canonical}, which is not in the weights")
        sd.setdefault(alias, sd[canonical])
    return sd


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def _check_state_dict(obj: Any, what: str, path: Path) -> StateDict:
    if not isinstance(obj, dict):
        raise CheckpointParseError(f"{path}: {what} is a {type(obj).__name__}, not a state dict of tensors")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        k = bad[0]
        raise CheckpointParseError(f"{path}: {what} is not a state dict: entry {k!r} is a "
                                   f"{type(obj[k]).__name__}, not a tensor")
    return obj


def _find_step(obj: dict[str, Any]) -> int | None:
    for holder in (obj, obj.get("trainer"), obj.get("state"), obj.get("meta"), obj.get("progress")):
        if isinstance(holder, dict):
            for key in ("global_step", "step"):
                v = holder.get(key)
                if isinstance(v, int) and not isinstance(v, bool):
                    return v
    return None


def _is_lightning(obj: dict[str, Any]) -> bool:
    """A PyTorch Lightning ``.ckpt`` (``trainer.save_checkpoint``): its version key, or its loop state."""
    return "pytorch-lightning_version" in obj or {"optimizer_states", "loops"} <= obj.keys()


def _interpret(obj: Any, path: Path) -> tuple[dict[str, StateDict], dict[str, Any]]:
    if not isinstance(obj, dict):
        raise CheckpointParseError(f"{path} holds a {type(obj).__name__}, not a state dict or a pimm checkpoint")
    info: dict[str, Any] = {}
    if obj.get("format") == "single" and isinstance(obj.get("weights"), dict):
        named = obj["weights"]
        if "raw" not in named:
            raise CheckpointParseError(f"{path}: single-format checkpoint has no raw weights (sets: {sorted(named)})")
        sets = {name: _check_state_dict(sd, f"weights[{name!r}]", path) for name, sd in named.items()}
        info["layout"] = "single"
    elif "state_dict" in obj and _is_lightning(obj):
        sets = {"raw": _check_state_dict(obj["state_dict"], "state_dict", path)}
        info["layout"] = "lightning"
    elif "state_dict" in obj:
        sets = {"raw": _check_state_dict(obj["state_dict"], "state_dict", path)}
        if obj.get("ema_state_dict") is not None:
            sets["ema"] = _check_state_dict(obj["ema_state_dict"], "ema_state_dict", path)
        info["layout"] = "legacy" if "optimizer" in obj else "weights"
    elif _is_state_dict(obj):
        sets = {"raw": obj}
        info["layout"] = "state_dict"
    elif _is_state_dict(obj.get("model")):
        sets = {"raw": obj["model"]}
        info["layout"] = "state_dict"
    else:
        keys = ", ".join(repr(k) for k in list(obj)[:5]) or "none"
        raise CheckpointParseError(
            f"{path} is not a state dict: expected {{'state_dict': ...}}, a single-format checkpoint or a flat dict "
            f"of tensors; its top-level keys are {keys}")
    step = _find_step(obj)
    if step is not None:
        info["step"] = step
    return sets, info


def select_weight_set(sets: dict[str, StateDict], weight_set: str, source: str | os.PathLike[str]) -> StateDict:
    """Pick ``raw`` or ``ema`` from :func:`read_weight_sets`' result.

    An EMA set that lacks some keys of the raw set (EMA kept for parameters only) takes
    those entries (the checkpoint-time raw buffers) from the raw set.

    Raises:
        UsageError: ``weight_set`` is not ``raw`` or ``ema``.
        CheckpointError: (exit code 2) the file has no such set (e.g. ``ema`` from a run
            without EMA).
    """
    if weight_set not in WEIGHT_SETS:
        raise UsageError(f"weights = {weight_set!r} is not a weight set; use one of {list(WEIGHT_SETS)}")
    if weight_set not in sets:
        raise CheckpointError(f"{source} has no {weight_set} weights (it has: {', '.join(sorted(sets))}); "
                              f"was EMA enabled in that run (ema.enabled)? Use the raw weights (--weights raw, "
                              f"train.weight_set = 'raw')", exit_code=2)
    sd = dict(sets[weight_set])
    if weight_set == "ema":
        for k, v in sets["raw"].items():
            sd.setdefault(k, v)
    return sd
