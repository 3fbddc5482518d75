"""Models that a library defines (Hugging Face ``transformers``): what a run records of them,
and how an export writes them the way that library does.

A run whose model is a ``transformers.PreTrainedModel`` records, in each start entry of
``provenance.json``, ``model_library = {"library": "transformers", "class":
"module:QualName", "config": {...}}`` (:func:`library_record`: the model's own config,
``model.config.to_dict()``). ``pimm export`` then rebuilds that class from that config,
loads the checkpoint's weights into it strictly and calls the library's own
``save_pretrained``: ``config.json`` (with its ``model_type``), ``model.safetensors`` (tied
weights stored once, under the names the library's loaders expect), sharded into
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` above
``max_shard_size``, exactly as ``save_pretrained`` does. ``--format bin`` converts those
files to ``pytorch_model.bin`` (and ``pytorch_model-*.bin`` with
``pytorch_model.bin.index.json``), the names ``from_pretrained`` looks for, holding the
same tensors under the same names.

Nothing here imports ``transformers`` unless the model (or the record) is one of its.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import CheckpointError
from ..tensors.ties import follow_model_ties

#: ``save_pretrained``'s shard size limit for exports (its own default is larger).
MAX_SHARD_SIZE = "5GB"
HF_SAFETENSORS_INDEX = "model.safetensors.index.json"
HF_BIN_INDEX = "pytorch_model.bin.index.json"


def library_record(model: nn.Module) -> dict[str, Any] | None:
    """What an export needs to write ``model`` as its library does, or None for any other model.

    Returns:
        ``{"library": "transformers", "class": "module:QualName", "config": {...}}`` for a
        ``transformers.PreTrainedModel`` (the config as ``to_dict`` gives it, JSON-safe).
    """
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    cls = type(model)
    return {"library": "transformers", "class": f"{cls.__module__}:{cls.__qualname__}",
            "config": json.loads(model.config.to_json_string(use_diff=False))}


def _model_class(record: dict[str, Any]) -> type:
    module, _, name = str(record.get("class", "")).partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise CheckpointError(f"cannot export as {record.get('library')}: the run's model class "
                              f"{record.get('class')!r} cannot be imported here ({e}); install the library "
                              "the run trained with") from None
    return obj


def save_library_model(record: dict[str, Any], sd: dict[str, torch.Tensor], out_dir: Path, *, fmt: str,
                       max_shard_size: int | str = MAX_SHARD_SIZE) -> tuple[list[str], set[str]]:
    """Write ``sd`` into ``out_dir`` as the library's own ``save_pretrained`` does.

    Args:
        record: :func:`library_record` of the run's model.
        sd: the weight set (tied names may both be present, sharing one tensor).
        out_dir: an existing empty directory.
        fmt: ``safetensors`` or ``bin`` (the same files converted to ``pytorch_model*.bin``).
        max_shard_size: ``save_pretrained``'s limit per weight file.

    Returns:
        ``(files, stored)``: the weight files written (names in ``out_dir``, the index first
        when sharded) and the tensor names they hold (a tied group keeps one name).

    Raises:
        CheckpointError: the class cannot be imported, or ``sd`` does not fit the model
            built from the recorded config.
    """
    cls = _model_class(record)
    config = cls.config_class.from_dict(record["config"])
    model = cls(config)
    sd = follow_model_ties(model, dict(sd))
    try:
        with torch.no_grad():
            model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"the checkpoint does not fit {record['class']} built from the run's model config: "
                              f"{str(e).splitlines()[0]}") from None
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    stored = _stored_names(out_dir)
    if fmt == "bin":
        _to_bin(out_dir)
    return _weight_files(out_dir), stored


def _stored_names(out_dir: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for st in out_dir.glob("model*.safetensors"):
        with safe_open(str(st), "pt") as f:
            names.update(f.keys())
    return names


def _to_bin(out_dir: Path) -> None:
    """Each ``model*.safetensors`` -> ``pytorch_model*.bin`` (``torch.save``), index included."""
    from safetensors.torch import load_file

    renamed: dict[str, str] = {}
    for st in sorted(out_dir.glob("model*.safetensors")):
        name = "pytorch_" + st.name[: -len(".safetensors")] + ".bin"
        with open(out_dir / name, "wb") as f:  # through a file: the archive's folder is always archive/
            torch.save(load_file(str(st)), f)
        st.unlink()
        renamed[st.name] = name
    index = out_dir / HF_SAFETENSORS_INDEX
    if index.is_file():
        data = json.loads(index.read_text(encoding="utf-8"))
        data["weight_map"] = {k: renamed.get(v, v) for k, v in data.get("weight_map", {}).items()}
        (out_dir / HF_BIN_INDEX).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        index.unlink()


def _weight_files(out_dir: Path) -> list[str]:
    index = [p.name for p in (out_dir / HF_SAFETENSORS_INDEX, out_dir / HF_BIN_INDEX) if p.is_file()]
    shards = sorted(p.name for p in out_dir.iterdir()
                    if p.suffix in (".safetensors", ".bin") and p.name.startswith(("model", "pytorch_model")))
    return index + shards
