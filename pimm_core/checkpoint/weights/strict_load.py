"""Strict load: a weight set into a model whose keys and shapes it matches exactly.

:func:`load_weights` (``pimm_core.load_weights``) is the scripting entry; :func:`check_strict`
and :func:`check_unwrapped` are shared with loading an export
(:func:`~pimm_core.checkpoint.export.model_dir.load_exported`).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ...errors import CheckpointError, UsageError
from ..tensors.safe_state import is_extra_state_key
from ..tensors.state import is_parallel_wrapper, load_full_state_dict
from ..tensors.ties import follow_model_ties
from .key_rules import apply_key_rules
from .read import StateDict, read_source, select_weight_set


def check_unwrapped(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise UsageError(f"expected a torch.nn.Module, got {type(model).__name__}")
    if is_parallel_wrapper(model):
        raise UsageError(f"load_weights needs an unwrapped model, got {type(model).__name__}; load into "
                         "model.module, or load before wrapping")
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):
        raise UsageError("load_weights needs an uncompiled model, got a torch.compile wrapper; load into "
                         "model._orig_mod, or load before torch.compile")


def check_strict(model: nn.Module, sd: StateDict, source: str, show: int = 5) -> None:
    """Raise :class:`CheckpointError` unless ``sd`` has exactly the model's keys and shapes.

    The message names up to ``show`` missing, unexpected and shape-mismatched keys
    (with both shapes).
    """
    own = model.state_dict()
    missing = sorted(own.keys() - sd.keys())
    unexpected = sorted(sd.keys() - own.keys())
    shapes = sorted(f"{k} {list(sd[k].shape)} in checkpoint vs {list(own[k].shape)} in model"
                    for k in own.keys() & sd.keys() if not is_extra_state_key(k) and tuple(own[k].shape) != tuple(sd[k].shape))
    if missing or unexpected or shapes:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
            if items:
                more = f" (+{len(items) - show} more)" if len(items) > show else ""
                parts.append(f"{label} {len(items)}: {', '.join(items[:show])}{more}")
        raise CheckpointError(f"{source} does not match the model architecture: " + "; ".join(parts))


def load_weights(model: nn.Module, checkpoint: str | os.PathLike[str], *, weights: str = "raw") -> None:
    """Load a weight set of a checkpoint into ``model``, strictly.

    No optimizer or data loader is needed. DDP ``module.`` and ``torch.compile``
    ``_orig_mod.`` key prefixes are stripped first (:data:`DEFAULT_KEY_RULES`).

    Buffers (BatchNorm statistics) load with the parameters. Names the model ties to one
    tensor stay tied (``load_state_dict`` copies into the model's own tensors) and get
    one value: the canonical name's (see :func:`~pimm_core.checkpoint.tensors.ties.follow_model_ties`);
    a file that stores a tied tensor under one of its names only loads too.

    Args:
        model: an unwrapped, uncompiled module whose architecture matches the checkpoint.
        checkpoint: any weight source :func:`resolve_weight_source` accepts: a run's
            ``model/last`` directory, ``model_best.pth``, a ``best`` pointer, an export
            directory, ``hf://org/repo``, a remote ``s3://...`` (:mod:`..remote.source`)...
        weights: ``raw`` or ``ema`` (the parameter set at that checkpoint position).

    Raises:
        UsageError: ``model`` is a DDP or ``torch.compile`` wrapper; bad ``weights``.
        WeightNotFoundError, IncompleteCheckpointError: ``checkpoint`` does not resolve.
        CheckpointError: unreadable or unsafe file; no such weight set; keys or shapes
            differ from the model (the message names them and both shapes).
    """
    check_unwrapped(model)
    path, sets, info, _ = read_source(checkpoint)
    sd = follow_model_ties(model, apply_key_rules(select_weight_set(sets, weights, checkpoint)))
    check_strict(model, sd, info.get("remote_file") or str(path))
    with torch.no_grad():  # (a sharded model: a collective, every rank loads)
        load_full_state_dict(model, sd, strict=True)
