"""Export: a portable model directory from a saved checkpoint.

``pimm export --run-dir RUN last OUT_DIR`` (and :func:`export`) writes::

    OUT_DIR/
      model.safetensors   one weight set (raw or EMA), no module./_orig_mod. prefixes
                          (or model.bin: torch.save of the state dict, with --format bin)
      config.json         the run's training config when discoverable, load triggers
                          cleared (train.weight = "", train.resume = false) and every
                          other absolute path replaced by "<redacted>"
      export.json         source checkpoint (path, layout, step, epoch, metrics, its
                          creation time from its manifest), weight set, format, size and
                          sha256 of the model file, tied-tensor aliases, torch version

An export is reproducible: the same checkpoint exported again (same options, same torch
and safetensors versions) gives the same bytes in every file. Nothing records the time
of the export; the safetensors header is written in one canonical order
(:func:`canonical_safetensors_header`) and ``model.bin`` always names its inner folder
``archive/``.

Tied tensors (several names for one tensor, e.g. ``head.weight is embed.weight``):
safetensors stores each tensor once. The first name in sorted order keeps the data;
each other name is an *alias*, recorded as ``{alias: kept}`` in the file's
``pimm.aliases`` metadata and in ``export.json``. :func:`load_exported` (and every
reader in :mod:`.weights`) puts the aliases back as the same tensor object and
re-ties the model's parameters. ``model.bin`` keeps every name (``torch.save``
preserves sharing).

The directory is written as ``OUT_DIR.tmp``, fsynced and renamed into place; an
existing non-empty ``OUT_DIR`` is replaced only with ``force``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, UsageError
from ..fsio import atomic_write, atomic_write_bytes, fsync_dir, fsync_tree, remove_tree
from ..run.layout import find_run_dir
from .manifest import sha256_file
from .sources import BIN, SAFETENSORS, checkpoint_record, is_remote
from .weights import (
    DEFAULT_KEY_RULES,
    _check_unwrapped,
    read_weight_sets,
    StateDict,
    WEIGHT_SETS,
    apply_key_rules,
    check_strict,
    read_checkpoint,
    resolve_weight_source,
    retie,
    select_weight_set,
)

FORMATS = {"safetensors": SAFETENSORS, "bin": BIN}
EXPORT_JSON = "export.json"
CONFIG_JSON = "config.json"
EXPORT_VERSION = 1
REDACTED = "<redacted>"

#: Config keys that would make a model built from the exported config load weights
#: (or resume) from a path on the training machine, and the value that disables them.
LOAD_TRIGGERS: dict[str, Any] = {"train.weight": "", "train.resume": False}

_WINDOWS_ABS = re.compile(r"^[A-Za-z]:[\\/]|^\\\\")


# -------------------------------------------------------------- tied tensors
def find_aliases(sd: StateDict) -> dict[str, str]:
    """Names in ``sd`` that are the same tensor view as another name.

    Two entries are aliases when they share storage, offset, shape, stride and dtype.
    The first name in sorted order is the one kept.

    Returns:
        ``{alias: kept}``, sorted by alias.
    """
    groups: dict[tuple[Any, ...], list[str]] = {}
    for k in sorted(sd):
        t = sd[k]
        if t.device.type == "meta" or t.numel() == 0:
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        groups.setdefault(key, []).append(k)
    return dict(sorted((alias, names[0]) for names in groups.values() for alias in names[1:]))


def _storage_sharing(sd: StateDict) -> set[str]:
    """Names whose storage is shared with another (non-alias) entry: they must be copied apart."""
    by_storage: dict[tuple[Any, int], list[str]] = {}
    for k, t in sd.items():
        if t.device.type != "meta" and t.numel() > 0:
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(k)
    return {k for names in by_storage.values() if len(names) > 1 for k in names}


def write_safetensors(sd: StateDict, path: Path, *, metadata: dict[str, str] | None = None) -> dict[str, str]:
    """Write ``sd`` as safetensors, atomically, storing tied tensors once.

    Tensors are moved to CPU and made contiguous; tensors that overlap in memory without
    being aliases are copied apart. ``metadata`` gets ``format = "pt"`` and
    ``pimm.aliases`` (JSON ``{alias: kept}``).

    Returns:
        The aliases that were dropped (``{alias: kept}``).
    """
    from safetensors.torch import save_file

    aliases = find_aliases(sd)
    kept = {k: v for k, v in sd.items() if k not in aliases}
    overlap = _storage_sharing(kept)
    tensors = {k: (v.detach().cpu().clone() if k in overlap else v.detach().cpu()).contiguous()
               for k, v in sorted(kept.items())}
    meta = {"format": "pt", **(metadata or {}), "pimm.aliases": json.dumps(aliases, sort_keys=True)}
    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata=meta)
        canonical_safetensors_header(tmp)
        os.chmod(tmp, 0o644)  # safetensors creates the file owner-only

    _atomic(path, write)
    return aliases


def canonical_safetensors_header(path: Path) -> None:
    """Rewrite a safetensors file's JSON header in one order, so equal contents give equal bytes.

    The safetensors library writes the ``__metadata__`` map in hash order, which differs
    from one call to the next. Here ``__metadata__`` comes first with its keys sorted, then
    the tensors in the order of their data; the header is padded with spaces to a multiple
    of 8 bytes, as safetensors does. The tensor data is not touched (rewritten in place
    when the header keeps its length, else copied once).
    """
    path = Path(path)
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        meta = header.pop("__metadata__", None)
        ordered: dict[str, Any] = {} if meta is None else {"__metadata__": dict(sorted(meta.items()))}
        ordered.update(sorted(header.items(), key=lambda kv: (kv[1]["data_offsets"], kv[0])))
        text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        text += b" " * (-len(text) % 8)
        if len(text) == n:
            f.seek(8)
            f.write(text)
            return
        other = path.with_name(path.name + ".header")
        try:
            with open(other, "wb") as out:
                out.write(len(text).to_bytes(8, "little"))
                out.write(text)
                f.seek(8 + n)
                shutil.copyfileobj(f, out, 16 << 20)
            os.replace(other, path)
        finally:
            other.unlink(missing_ok=True)


def write_bin(sd: StateDict, path: Path) -> None:
    """``torch.save`` of the state dict (CPU tensors, every name kept, sharing preserved), atomically.

    Saved through an open file, so the archive's inner folder is always ``archive/`` (a
    path would name it after the temporary file): equal contents give equal bytes.
    """


    cpu: dict[str, torch.Tensor] = {}
    moved: dict[int, torch.Tensor] = {}
    for k, v in sd.items():
        if v.device.type == "cpu":
            cpu[k] = v.detach()
        else:  # move each distinct tensor once so ties survive
            cpu[k] = moved.setdefault(id(v), v.detach().cpu())

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            torch.save(cpu, f)

    _atomic(path, write)


def _atomic(path: Path, write) -> None:
    atomic_write(path, write, points=None)


# -------------------------------------------------------------------- config
def _is_abs_path(value: str) -> bool:
    return value.startswith(("/", "~", "file://")) or bool(_WINDOWS_ABS.match(value))


def sanitize_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """The config as it may leave the training machine.

    Load triggers (:data:`LOAD_TRIGGERS`) present in ``cfg`` are reset; any other string
    that is an absolute path (``/...``, ``~...``, ``C:\\...``, ``file://...``), at any depth
    and inside lists, becomes ``"<redacted>"``.

    Returns:
        ``(clean, cleared, redacted)``: a deep copy, and the dotted keys that were cleared
        and redacted (list items as ``key[i]``).
    """
    clean = copy.deepcopy(cfg)
    cleared, redacted = [], []
    for dotted, value in LOAD_TRIGGERS.items():
        *parents, leaf = dotted.split(".")
        node: Any = clean
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            if node[leaf] != value:
                cleared.append(dotted)
            node[leaf] = value

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, f"{where}.{k}" if where else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(node)]
        if isinstance(node, str) and _is_abs_path(node):
            redacted.append(where)
            return REDACTED
        return node

    return walk(clean, ""), cleared, redacted


def read_run_config(run_dir: Path) -> dict[str, Any] | None:
    """``run_dir/config.toml`` as a dict, or None when absent.

    Raises:
        CheckpointError: the file exists but is not valid TOML.
    """
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        return None
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CheckpointError(f"cannot read the run config {path}: {e}") from None


# -------------------------------------------------------------------- export
def _check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise UsageError(f"{out_dir} exists and is not a directory; choose a directory for the export")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise UsageError(f"{out_dir} already exists and is not empty; use --force to replace it")


def export(source: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, weights: str = "raw",
           fmt: str = "safetensors", run_dir: Path | None = None, force: bool = False) -> Path:
    """Export one weight set of a checkpoint into ``out_dir``.

    Args:
        source: any weight source of :func:`~pimm_core.checkpoint.sources.resolve_weight_source`;
            with ``run_dir`` also ``last``, ``best``, ``final`` or ``iter_<step>``.
        out_dir: the directory to create (missing parents are created).
        weights: ``raw`` or ``ema``.
        fmt: ``safetensors`` (``model.safetensors``) or ``bin`` (``model.bin``).
        run_dir: the run the checkpoint belongs to; its ``config.toml`` becomes
            ``config.json``. Default: the nearest directory above the checkpoint file
            (up to 4 levels) that holds ``config.toml``.
        force: replace an existing non-empty ``out_dir``.

    Returns:
        ``out_dir``.

    Raises:
        UsageError: bad ``weights`` or ``fmt``; ``out_dir`` exists and is not empty
            (without ``force``) or is not a directory.
        WeightNotFoundError, IncompleteCheckpointError: ``source`` does not resolve.
        CheckpointError: unreadable or unsafe checkpoint; no such weight set; bad config.toml.
        OSError: a write failed (``out_dir`` is untouched).
    """
    if fmt not in FORMATS:
        raise UsageError(f"format {fmt!r} is not supported; use one of {sorted(FORMATS)}")
    if weights not in WEIGHT_SETS:
        raise UsageError(f"weights {weights!r} is not a weight set; use one of {list(WEIGHT_SETS)}")
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, force)

    resolved = resolve_weight_source(source, run_dir=run_dir)
    sets, info = read_checkpoint(resolved)
    sd = apply_key_rules(select_weight_set(sets, weights, source), DEFAULT_KEY_RULES)
    record = {} if is_remote(source) else checkpoint_record(resolved)
    step = record.get("step", info.get("step"))

    rd = Path(run_dir) if run_dir is not None else (None if is_remote(source) else _run_dir_near(resolved))
    cfg = read_run_config(rd) if rd is not None else None

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    remove_tree(tmp)
    tmp.mkdir(parents=True)
    try:
        model_file = tmp / FORMATS[fmt]
        if fmt == "safetensors":
            meta = {"pimm.weights": weights}
            if step is not None:
                meta["pimm.step"] = str(step)
            aliases = write_safetensors(sd, model_file, metadata=meta)
        else:
            aliases = find_aliases(sd)
            write_bin(sd, model_file)
        cleared: list[str] = []
        redacted: list[str] = []
        if cfg is not None:
            clean, cleared, redacted = sanitize_config(cfg)
            atomic_write_bytes(tmp / CONFIG_JSON, (json.dumps(clean, indent=2) + "\n").encode())

        record_out = {
            "export_version": EXPORT_VERSION,
            "source": os.fspath(source) if is_remote(source) else str(resolved),
            "source_arg": os.fspath(source),
            "source_layout": info.get("layout"),
            "step": step,
            "epoch": record.get("epoch"),
            "metrics": record.get("metrics") or {},
            "weights": weights,
            "format": fmt,
            "file": model_file.name,
            "size": model_file.stat().st_size,
            "sha256": sha256_file(model_file),
            "num_tensors": len(sd),
            "aliases": aliases,
            "aliases_stored": "metadata" if fmt == "safetensors" else "file",
            "config": CONFIG_JSON if cfg is not None else None,
            "config_cleared": cleared,
            "config_redacted": redacted,
            "source_created": record.get("created"),
            "torch_version": torch.__version__,
        }
        atomic_write_bytes(tmp / EXPORT_JSON, (json.dumps(record_out, indent=2) + "\n").encode())
        fsync_tree(tmp)
        _publish(tmp, out_dir)
    except BaseException:
        remove_tree(tmp)
        raise
    return out_dir


def _run_dir_near(path: Path, levels: int = 4) -> Path | None:
    found = find_run_dir(path)
    if found is None:
        return None
    try:
        depth = len(Path(path).absolute().relative_to(found).parts)
    except ValueError:
        return None
    return found if depth <= levels else None


def _publish(tmp: Path, out_dir: Path) -> None:
    """``tmp`` -> ``out_dir``; an existing ``out_dir`` is moved aside first and removed after."""
    parent = out_dir.parent
    old = out_dir.with_name(out_dir.name + ".old")
    if out_dir.exists():
        remove_tree(old)
        os.rename(out_dir, old)
        fsync_dir(parent)
    os.rename(tmp, out_dir)
    fsync_dir(parent)
    remove_tree(old)


# ---------------------------------------------------------------------- load
def load_exported(model: nn.Module, out_dir: str | os.PathLike[str], *, retie_params: bool = True) -> dict[str, str]:
    """Load an export (directory or model file) into ``model`` strictly and restore ties.

    Args:
        model: an unwrapped module of the exported architecture.
        out_dir: an export directory (``model.safetensors``, else ``model.bin``) or the file.
        retie_params: for each recorded alias whose module entries are distinct tensors,
            make the alias name refer to the kept name's parameter/buffer (as in the
            exported model). A model that ties them itself is unchanged.

    Returns:
        The aliases (``{alias: kept}``) found in the export.

    Raises:
        WeightNotFoundError: no model file in ``out_dir``.
        CheckpointError: unreadable file, or keys/shapes that differ from the model.
    """
    _check_unwrapped(model)
    path = resolve_weight_source(out_dir)
    sets, info = read_checkpoint(path)
    sd = dict(sets["raw"])
    aliases = dict(info.get("aliases") or {})
    side = path.parent / EXPORT_JSON
    if side.is_file():
        try:
            aliases.update(json.loads(side.read_text(encoding="utf-8")).get("aliases") or {})
        except (OSError, ValueError, AttributeError):
            pass
    retie(sd, aliases)
    sd = apply_key_rules(sd, DEFAULT_KEY_RULES)
    check_strict(model, sd, str(path))
    with torch.no_grad():
        model.load_state_dict(sd, strict=True)
    if retie_params:
        for alias, kept in sorted(aliases.items()):
            _tie(model, alias, kept)
    return aliases


def _tie(model: nn.Module, alias: str, kept: str) -> None:
    a_mod, _, a_name = alias.rpartition(".")
    k_mod, _, k_name = kept.rpartition(".")
    try:
        am, km = model.get_submodule(a_mod), model.get_submodule(k_mod)
    except AttributeError:
        return
    for table in ("_parameters", "_buffers"):
        at, kt = getattr(am, table), getattr(km, table)
        if a_name in at and k_name in kt and at[a_name] is not kt[k_name] and kt[k_name] is not None:
            at[a_name] = kt[k_name]
            return


def export_weights(checkpoint: str | os.PathLike[str], path: str | os.PathLike[str], *,
                   weights: str = "raw") -> None:
    """Write one weight set of a saved checkpoint as an ordinary state dict.

    No DDP or compile prefixes. The output is chosen by ``path``'s suffix:

    - ``.safetensors``: one safetensors file (tied tensors stored once; the aliases are
      in its ``pimm.aliases`` metadata and :func:`read_weight_sets` re-ties them);
    - ``.bin``, ``.pth``, ``.pt``: ``torch.save`` of the state dict;
    - anything else: an export directory, as :func:`export`
      writes it (``model.safetensors``, ``config.json`` when found, ``export.json``);
      an existing non-empty directory is refused.

    The file is written atomically (temporary name, fsync, rename).

    Raises:
        UsageError: bad ``weights``; ``path`` is an existing non-empty directory.
        WeightNotFoundError, IncompleteCheckpointError, CheckpointError: as :func:`load_weights`.
    """
    out = Path(path)
    if out.suffix in (".safetensors", ".bin", ".pth", ".pt"):
        src = resolve_weight_source(checkpoint)
        sd = apply_key_rules(select_weight_set(read_weight_sets(src), weights, checkpoint))
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix == ".safetensors":
            write_safetensors(sd, out, metadata={"pimm.weights": weights})
        else:
            write_bin(sd, out)
        return
    export(checkpoint, out, weights=weights)
