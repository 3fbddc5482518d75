"""Warm start: the matching weights of any weight source into a model, non-strictly, with a report.

``--train.weight SOURCE`` (and :func:`warm_start`) fills every model tensor for which
the checkpoint, after the key rules (:mod:`.key_rules`), has a tensor of the same
name and shape; the rest keeps its initial value. Only model weights are loaded:
the optimizer, schedule, step, RNG and loader cursor are not (this is not a resume).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import CheckpointError
from ..tensors.safe_state import is_extra_state_key
from ..tensors.state import load_full_state_dict, unwrap
from ..tensors.ties import follow_model_ties
from .key_rules import DEFAULT_KEY_RULES, apply_key_rules, format_rules, suggest_key_rule, toml_literal
from .read import read_source, select_weight_set

log = logging.getLogger("pimm")

NOT_RESTORED = "optimizer, schedule, step, RNG and loader cursor"


@dataclass
class WarmStartReport:
    """What :func:`warm_start` loaded.

    Attributes:
        source: the weight source as given (path or ``hf://``).
        resolved: the file that was read.
        weight_set: ``raw`` or ``ema``.
        rules: the key rewrite rules applied, in order.
        renamed: how many checkpoint keys the rules changed.
        loaded: model keys filled from the checkpoint (same name and shape), sorted.
        missing: model keys the checkpoint does not have (left as initialised), sorted.
        unexpected: checkpoint keys (after the rules) the model does not have, sorted.
        mismatched: ``(key, checkpoint shape, model shape)`` for names present in both
            whose shapes differ (left as initialised), sorted by key.
        loaded_params: how many of ``loaded`` are parameters (not buffers).
        model_params: parameters of the model (tied ones counted once per name).
    """

    source: str
    resolved: str
    weight_set: str
    rules: list[tuple[str, str]]
    renamed: int = 0
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    loaded_params: int = 0
    model_params: int = 0

    def lines(self, show: int = 5) -> list[str]:
        """The human report, one line per item: rules, then loaded/missing/unexpected/mismatched counts."""

        def names(items: list[str]) -> str:
            if not items:
                return ""
            more = f" (+{len(items) - show} more)" if len(items) > show else ""
            return ": " + ", ".join(items[:show]) + more

        shapes = [f"{k} {list(a)} in checkpoint vs {list(b)} in model" for k, a, b in self.mismatched]
        return [
            f"warm start from {self.source} ({self.resolved}), {self.weight_set} weights",
            f"  key rules: {format_rules(self.rules)} ({self.renamed} keys renamed)",
            f"  loaded {len(self.loaded)} tensors ({self.loaded_params}/{self.model_params} model parameters)",
            f"  missing {len(self.missing)}{names(self.missing)}",
            f"  unexpected {len(self.unexpected)}{names(self.unexpected)}",
            f"  shape-mismatched {len(self.mismatched)}{names(shapes)}",
            f"  warm start loads model weights only: {NOT_RESTORED} are not restored (this is not a resume)",
        ]

    def to_json(self) -> dict[str, Any]:
        """JSON-ready record (for provenance.json): counts plus up to 20 names of each kind."""
        return {
            "source": self.source, "resolved": self.resolved, "weight_set": self.weight_set,
            "rules": [list(r) for r in self.rules], "renamed": self.renamed,
            "loaded": len(self.loaded), "missing": len(self.missing), "unexpected": len(self.unexpected),
            "mismatched": len(self.mismatched), "loaded_params": self.loaded_params,
            "model_params": self.model_params, "missing_keys": self.missing[:20],
            "unexpected_keys": self.unexpected[:20],
            "mismatched_keys": [[k, list(a), list(b)] for k, a, b in self.mismatched[:20]],
        }


def warm_start(model: nn.Module, source: str | os.PathLike[str], *, weight_set: str = "raw",
               rules: list[tuple[str, str]] | None = None, logger: logging.Logger | None = None,
               run_dir: Path | None = None, storage_options: dict[str, Any] | None = None) -> WarmStartReport:
    """Load the matching weights of ``source`` into ``model`` (non-strict) and report.

    A key is loaded when, after the key rules, the checkpoint has a tensor with the
    model's name and shape; everything else keeps its initial value. The report (also
    logged at INFO) gives the rules and the loaded, missing, unexpected and
    shape-mismatched counts with up to 5 names each. Only model weights are loaded: the
    optimizer, schedule, step, RNG and loader cursor are not restored.

    Args:
        model: the model to fill; DDP / ``torch.compile`` wrappers are looked through; a
            sharded (FSDP2) model gets its shards (every rank must call this then).
        source: any weight source :func:`resolve_weight_source` accepts (incl. ``hf://``), or a
            remote URL (``s3://...``: downloaded into a temporary directory, checked against its
            manifest or sidecar, removed after reading; see :mod:`..remote.source`).
        weight_set: ``raw`` or ``ema``.
        rules: key rewrite rules (see :func:`apply_key_rules`); None: :data:`DEFAULT_KEY_RULES`.
        logger: where the report goes (default: the ``pimm`` logger).
        run_dir: resolves ``last``/``best``/``final``/``iter_<step>`` against a run.
        storage_options: the remote filesystem's options (a remote ``source`` only).

    Returns:
        The :class:`WarmStartReport`.

    Raises:
        WeightNotFoundError, IncompleteCheckpointError: ``source`` does not resolve.
        RemoteStoreError: a remote store cannot be read, or a download does not match its record.
        CheckpointError: unreadable or unsafe file; no such weight set; zero model
            parameters matched (``no parameters matched ...``, exit code 2).
    """
    logger = logger or log
    used_rules = [tuple(r) for r in (DEFAULT_KEY_RULES if rules is None else rules)]
    path, sets, info, _ = read_source(source, run_dir=run_dir, storage_options=storage_options)
    raw = select_weight_set(sets, weight_set, source)
    sd = apply_key_rules(raw, used_rules)  # type: ignore[arg-type]
    renamed = sum(1 for a, b in zip(raw, sd) if a != b)

    target = unwrap(model)
    sd = follow_model_ties(target, sd)  # a tied name the file lacks is filled by its twin
    own = target.state_dict()
    param_names = {n for n, _ in target.named_parameters(remove_duplicate=False)}
    # (a module's extra state is opaque: an encoded one's length is its own, safe_state)
    loaded = sorted(k for k in own.keys() & sd.keys() if is_extra_state_key(k) or tuple(own[k].shape) == tuple(sd[k].shape))
    report = WarmStartReport(
        source=os.fspath(source), resolved=info.get("remote_file") or str(path), weight_set=weight_set,
        rules=used_rules, renamed=renamed,
        loaded=loaded, missing=sorted(own.keys() - sd.keys()), unexpected=sorted(sd.keys() - own.keys()),
        mismatched=sorted((k, tuple(sd[k].shape), tuple(own[k].shape)) for k in own.keys() & sd.keys()
                          if not is_extra_state_key(k) and tuple(own[k].shape) != tuple(sd[k].shape)),
        loaded_params=sum(1 for k in loaded if k in param_names), model_params=len(param_names),
    )
    if report.loaded_params == 0:
        ckpt_keys = ", ".join(list(sd)[:3]) or "none"
        model_keys = ", ".join(sorted(param_names)[:3]) or "none"
        what = " (a PyTorch Lightning checkpoint)" if info.get("layout") == "lightning" else ""
        rule = suggest_key_rule(list(sd), own)
        fix = ("its keys match the model's after one key rule: add train.key_rules = "
               f"[[{toml_literal(rule[0])}, {toml_literal(rule[1])}]]" if rule else "fix the source or the key rules")
        raise CheckpointError(
            f"no parameters matched between {source}{what} and the model (0 of {len(param_names)} model parameters "
            f"have a checkpoint tensor of the same name and shape; checkpoint keys e.g. {ckpt_keys}; model keys e.g. "
            f"{model_keys}; key rules: {format_rules(used_rules)}); {fix}", exit_code=2)
    with torch.no_grad():  # (a sharded model: a collective, every rank warm-starts)
        load_full_state_dict(target, {k: sd[k] for k in loaded}, strict=False)
    for line in report.lines():
        logger.info("%s", line)
    return report
