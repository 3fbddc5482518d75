"""Export: a portable model directory from a saved checkpoint.

``pimm export --run-dir RUN last OUT_DIR`` (and :func:`export`) writes::

    OUT_DIR/
      model.safetensors   one weight set (raw or EMA), no module./_orig_mod. prefixes
                          (or pytorch_model.bin: torch.save of the same tensors, --format bin)
      config.json         the run's training config when discoverable, load triggers
                          cleared (train.weight = "", train.resume = false) and every
                          other absolute path replaced by "<redacted>"
      export.json         source checkpoint (path, layout, step, epoch, metrics, its
                          creation time from its manifest), weight set, format, size and
                          sha256 of each weight file, tied-tensor aliases, torch version

A model that a library defines (a ``transformers`` model, recorded by the run: see
:mod:`.library_model`) is written by that library's own ``save_pretrained``: its
``config.json`` and weights (sharded with an index above a size limit), so
``from_pretrained(OUT_DIR)`` loads it. That ``config.json`` is the library's (the model's
architecture, which ``from_pretrained`` reads), so the training config is written as
``pimm_config.json`` instead; ``export.json`` names the file under ``config``.

An export is reproducible: the same checkpoint exported again (same options, same torch
and safetensors versions) gives the same bytes in every file. Nothing records the time
of the export, and the model file's writers give equal bytes for equal contents.

Tied tensors are stored once, in either format (see :mod:`.files`), as
``safetensors.torch.load_model`` and ``from_pretrained`` expect; the aliases are recorded
in ``export.json`` too, and :func:`load_exported` puts them back
and re-ties the model's parameters. The config is sanitized by :mod:`.config`.

The directory is written under a fresh hidden name beside ``OUT_DIR``, fsynced and renamed
into place; an existing non-empty ``OUT_DIR`` is replaced only with ``force``, and only when
it is a previous export (see :mod:`..records.outputs`). The weights and the metadata come from one
generation of the checkpoint, even while a live run rotates it (:func:`..weights.read.read_source`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ...errors import UsageError
from ...faults import point, register
from ...fsio import atomic_write_bytes, fsync_tree, remove_tree
from ...run.layout import find_run_dir
from ...run.provenance import read_provenance
from ..records.foreign import HF_BIN, SAFETENSORS
from ..records.generation import read_whole
from ..records.manifest import sha256_file
from ..records.outputs import (
    CONFIG_JSON,
    EXPORT_JSON,
    PIMM_CONFIG_JSON,
    check_output_dir,
    check_output_file,
    new_temp_dir,
    replace_dir,
)
from ..records.scratch import make_owned_dir, release
from ..remote.output import check_remote_output, upload_export
from ..remote.source import is_store_url
from ..tensors.state import load_full_state_dict
from ..tensors.ties import find_aliases, follow_model_ties, tie_parameters
from ..weights.hub import is_remote
from ..weights.key_rules import DEFAULT_KEY_RULES, apply_key_rules
from ..weights.read import WEIGHT_SETS, read_checkpoint, read_source, retie, select_weight_set
from ..weights.sources import resolve_weight_source
from ..weights.strict_load import check_strict, check_unwrapped
from .config import read_run_config, sanitize_config
from .files import write_bin, write_safetensors
from .library_model import MAX_SHARD_SIZE, save_library_model

register("export.written")

FORMATS = {"safetensors": SAFETENSORS, "bin": HF_BIN}
EXPORT_VERSION = 1


def export(source: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, weights: str = "raw",
           fmt: str = "safetensors", run_dir: Path | None = None, force: bool = False,
           max_shard_size: int | str = MAX_SHARD_SIZE) -> Path | str:
    """Export one weight set of a checkpoint into ``out_dir``.

    ``source`` and ``out_dir`` may be remote URLs (``s3://...``). A remote source is downloaded
    into a temporary directory and checked (:mod:`..remote.source`); a remote ``out_dir`` gets
    the export written locally first, then uploaded with ``export.json`` last, the export's
    completion marker (:mod:`..remote.output`: an object store has no rename).

    Args:
        source: any weight source of :func:`~pimm_core.checkpoint.weights.sources.resolve_weight_source`;
            with ``run_dir`` also ``last``, ``best``, ``final`` or ``iter_<step>``.
        out_dir: the directory to create (missing parents are created), or a remote prefix.
        weights: ``raw`` or ``ema``.
        fmt: ``safetensors`` (``model.safetensors``) or ``bin`` (``pytorch_model.bin``).
        run_dir: the run the checkpoint belongs to; its ``config.toml`` becomes
            ``config.json`` (``pimm_config.json`` beside a library's own ``config.json``), and the model its ``provenance.json`` records as a
            library's is written by that library. Default: the nearest directory above the checkpoint file
            (up to 4 levels) that holds ``config.toml``.
        force: replace an existing non-empty ``out_dir`` that is a previous export.
        max_shard_size: for a library's model, its ``save_pretrained`` limit per weight file
            (bytes, or text such as ``"5GB"``); larger weights are sharded with an index.

    Returns:
        ``out_dir`` (a ``Path``, or the URL as given).

    Raises:
        UsageError: bad ``weights`` or ``fmt``; ``out_dir`` is refused by
            :func:`~pimm_core.checkpoint.records.outputs.check_output_dir` (not empty without
            ``force``; with it, not a previous export; inside a checkpoint; not a directory).
        GenerationChanged: a live run replaced the checkpoint during every read (exit code 75: try again).
        WeightNotFoundError, IncompleteCheckpointError: ``source`` does not resolve.
        CheckpointError: unreadable or unsafe checkpoint; no such weight set; bad config.toml.
        OSError: a write failed (``out_dir`` is untouched).
        RemoteStoreError: a remote store cannot be read or written (a remote ``out_dir`` is then
            left without ``export.json``: incomplete, refused by readers).
    """
    if fmt not in FORMATS:
        raise UsageError(f"format {fmt!r} is not supported; use one of {sorted(FORMATS)}")
    if weights not in WEIGHT_SETS:
        raise UsageError(f"weights {weights!r} is not a weight set; use one of {list(WEIGHT_SETS)}")
    remote_out = is_store_url(out_dir)
    if remote_out:  # checked before anything is read or downloaded
        store, remote_path = check_remote_output(os.fspath(out_dir), force=force)
        out_dir = os.fspath(out_dir)
    else:
        out_dir = Path(out_dir)
        target = check_output_dir(out_dir, force=force)

    resolved, sets, info, record = read_source(source, run_dir=run_dir)
    sd = apply_key_rules(select_weight_set(sets, weights, source), DEFAULT_KEY_RULES)
    if is_remote(source):
        record = {}
    step = record.get("step", info.get("step"))

    elsewhere = is_remote(source) or is_store_url(source)  # no run directory near the file read
    rd = Path(run_dir) if run_dir is not None else (None if elsewhere else _run_dir_near(resolved))
    cfg = read_run_config(rd) if rd is not None else None
    library = _library_record(rd) if rd is not None else None

    # a remote export is written in $TMPDIR first (pimm-export-*: a later one removes it if this is killed)
    owned = make_owned_dir("pimm-export-") if remote_out else None
    owned = owned or new_temp_dir(target, "export")  # .OUT.pimm-export-*.tmp: cleaned by the next export if killed
    tmp = owned[0]
    try:
        aliases = find_aliases(sd)
        if library is not None:
            files, stored = save_library_model(library, sd, tmp, fmt=fmt, max_shard_size=max_shard_size)
            aliases = _aliases_of(aliases, stored)
        elif fmt == "safetensors":
            meta = {"pimm.weights": weights}
            if step is not None:
                meta["pimm.step"] = str(step)
            write_safetensors(sd, tmp / SAFETENSORS, metadata=meta)
            files = [SAFETENSORS]
        else:  # the same rule as safetensors: each tied tensor once, under the name that file keeps
            write_bin({k: v for k, v in sd.items() if k not in aliases}, tmp / HF_BIN)
            files = [HF_BIN]
        model_file = tmp / next(f for f in files if not f.endswith(".index.json"))
        cleared: list[str] = []
        redacted: list[str] = []
        # the training config is config.json, unless the library's own config.json must sit there
        config_name = PIMM_CONFIG_JSON if library is not None else CONFIG_JSON
        if cfg is not None:
            clean, cleared, redacted = sanitize_config(cfg)
            atomic_write_bytes(tmp / config_name, (json.dumps(clean, indent=2) + "\n").encode())

        record_out = {
            "export_version": EXPORT_VERSION,
            "source": os.fspath(source) if is_remote(source) else info.get("remote_file") or str(resolved),
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
            "files": {f: {"size": (tmp / f).stat().st_size, "sha256": sha256_file(tmp / f)} for f in files},
            "library": library["library"] if library is not None else None,
            "num_tensors": len(sd),
            "aliases": aliases,
            "aliases_stored": "once",
            "config": config_name if cfg is not None else None,
            "config_cleared": cleared,
            "config_redacted": redacted,
            "source_created": record.get("created"),
            "torch_version": torch.__version__,
        }
        atomic_write_bytes(tmp / EXPORT_JSON, (json.dumps(record_out, indent=2) + "\n").encode())
        if remote_out:
            upload_export(tmp, store, remote_path, os.fspath(out_dir))
            remove_tree(tmp)
        else:
            fsync_tree(tmp)
            point("export.written")
            replace_dir(tmp, target)
    except BaseException:
        remove_tree(tmp)
        raise
    finally:
        release(*owned)
    return out_dir


def _aliases_of(aliases: dict[str, str], stored: set[str]) -> dict[str, str]:
    """``aliases`` ({alias: kept}) re-keyed so that each group keeps the name that was ``stored``."""
    groups: dict[str, list[str]] = {}
    for alias, kept in aliases.items():
        groups.setdefault(kept, [kept]).append(alias)
    out: dict[str, str] = {}
    for names in groups.values():
        keep = next((n for n in sorted(names) if n in stored), sorted(names)[0])
        out.update({n: keep for n in names if n != keep})
    return dict(sorted(out.items()))


def _library_record(run_dir: Path) -> dict | None:
    """The ``model_library`` of the run's latest start (``provenance.json``), if any."""
    for entry in reversed((read_provenance(run_dir) or {}).get("starts") or []):
        if isinstance(entry, dict) and "model_library" in entry:
            record = entry["model_library"]
            return record if isinstance(record, dict) and record.get("library") == "transformers" else None
    return None


def _run_dir_near(path: Path, levels: int = 4) -> Path | None:
    found = find_run_dir(path)
    if found is None:
        return None
    try:
        depth = len(Path(path).absolute().relative_to(found).parts)
    except ValueError:
        return None
    return found if depth <= levels else None


# ---------------------------------------------------------------------- load
def load_exported(model: nn.Module, out_dir: str | os.PathLike[str], *, retie_params: bool = True) -> dict[str, str]:
    """Load an export (directory or model file) into ``model`` strictly and restore ties.

    Args:
        model: an unwrapped module of the exported architecture.
        out_dir: an export directory (``model.safetensors``, else ``pytorch_model.bin``) or the file.
        retie_params: for each recorded alias whose module entries are distinct tensors,
            make the alias name refer to the kept name's parameter/buffer (as in the
            exported model). A model that ties them itself is unchanged.

    Returns:
        The aliases (``{alias: kept}``) found in the export.

    Raises:
        WeightNotFoundError: no model file in ``out_dir``.
        CheckpointError: unreadable file, or keys/shapes that differ from the model.
    """
    check_unwrapped(model)

    def read(path: Path) -> tuple[Path, dict[str, torch.Tensor], dict[str, str]]:
        sets, info = read_checkpoint(path)
        aliases = dict(info.get("aliases") or {})
        side = path.parent / EXPORT_JSON
        if side.is_file():
            try:
                aliases.update(json.loads(side.read_text(encoding="utf-8")).get("aliases") or {})
            except (OSError, ValueError, AttributeError):
                pass
        return path, dict(sets["raw"]), aliases

    # the model file and export.json of one export, even while `pimm export --force` replaces it
    path, sd, aliases = read_whole(lambda: resolve_weight_source(out_dir), read, what=os.fspath(out_dir))
    retie(sd, aliases)
    sd = follow_model_ties(model, apply_key_rules(sd, DEFAULT_KEY_RULES))
    check_strict(model, sd, str(path))
    with torch.no_grad():
        load_full_state_dict(model, sd, strict=True)
    if retie_params:
        tie_parameters(model, aliases)
    return aliases


def export_weights(checkpoint: str | os.PathLike[str], path: str | os.PathLike[str], *,
                   weights: str = "raw") -> None:
    """Write one weight set of a saved checkpoint as an ordinary state dict.

    No DDP or compile prefixes. The output is chosen by ``path``'s suffix:

    - ``.safetensors``: one safetensors file (tied tensors stored once; the aliases are
      in its ``pimm.aliases`` metadata and :func:`read_weight_sets` re-ties them);
    - ``.bin``, ``.pth``, ``.pt``: ``torch.save`` of the state dict;
    - anything else: an export directory, as :func:`export`
      writes it (``model.safetensors``, ``config.json`` when found, ``export.json``);
      an existing non-empty directory is refused; a remote prefix (``s3://...``) too.

    The file is written atomically (temporary name, fsync, rename).

    Raises:
        UsageError: bad ``weights``; ``path`` is an existing non-empty directory (not a
            previous export), or lies in a checkpoint or a run's ``model/`` directory.
        WeightNotFoundError, IncompleteCheckpointError, CheckpointError: as :func:`load_weights`.
    """
    if is_store_url(path):  # a remote prefix: an export directory, uploaded with export.json last
        if Path(str(path)).suffix in (".safetensors", ".bin", ".pth", ".pt"):
            raise UsageError(f"{path}: a single weights file is written locally only; export to a remote prefix "
                             "(an export directory) instead")
        export(checkpoint, path, weights=weights)
        return
    out = Path(path)
    if out.suffix in (".safetensors", ".bin", ".pth", ".pt"):
        check_output_file(out)
        _, sets, _, _ = read_source(checkpoint)
        sd = apply_key_rules(select_weight_set(sets, weights, checkpoint))
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix == ".safetensors":
            write_safetensors(sd, out, metadata={"pimm.weights": weights})
        else:
            write_bin(sd, out)
        return
    export(checkpoint, out, weights=weights)
