"""Weight sets from any checkpoint: reading, key rewriting, warm start, strict loading.

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
is decided by :func:`~pimm_core.checkpoint.sources.resolve_weight_source`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, CheckpointParseError, UsageError
from .safe_read import load_torch_file
from .state import is_parallel_wrapper, unwrap
from .sources import (  # noqa: F401  (re-exported: the weights API in one place)
    IncompleteCheckpointError,
    WeightNotFoundError,
    is_remote,
    resolve_weight_source,
)

log = logging.getLogger("pimm")

WEIGHT_SETS = ("raw", "ema")

#: Key rewrite rules applied when none are given: ordered ``(regex, replacement)`` pairs,
#: each applied with :func:`re.sub` to every key in turn.
DEFAULT_KEY_RULES: list[tuple[str, str]] = [
    (r"^module\.", ""),  # DistributedDataParallel / DataParallel
    (r"^_orig_mod\.", ""),  # torch.compile (also the module._orig_mod. of DDP(compile(m)))
    (r"^module\.", ""),  # compile(DDP(m)) leaves module. after _orig_mod.
    (r"\._orig_mod\.", "."),  # a compiled submodule
]

NOT_RESTORED = "optimizer, schedule, step, RNG and loader cursor"

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


def _read(path: Path) -> tuple[dict[str, StateDict], dict[str, Any]]:
    if not path.is_file():  # a directory or pointer: resolve it as a weight source
        path = resolve_weight_source(path)
    if _is_safetensors(path):
        return _read_safetensors(path)
    obj = load_torch_file(path, hint=". If you wrote it yourself, re-save it with "
                          "torch.save(model.state_dict(), path)")
    return _interpret(obj, path)


def _is_safetensors(path: Path) -> bool:
    """Sniff the header: safetensors starts with a u64 length then ``{``; torch files are zip or pickle."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and not head.startswith((b"PK", b"\x80")) and head[8:9] == b"{"


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


# ----------------------------------------------------------------- key rules
def apply_key_rules(sd: dict[str, Any], rules: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Rename the keys of ``sd`` with ordered ``(regex, replacement)`` rules.

    Each key goes through ``re.sub(regex, replacement, key)`` for every rule in order.
    Values are kept as they are (tied tensors stay tied).

    Args:
        rules: the rules; None means :data:`DEFAULT_KEY_RULES` (strip DDP ``module.`` and
            ``torch.compile`` ``_orig_mod.`` prefixes). An empty list renames nothing.

    Returns:
        A new dict in the original key order.

    Raises:
        UsageError: a rule is not a ``(regex, replacement)`` pair or its regex is invalid.
        CheckpointError: two keys are renamed to the same name (the message names them).
    """
    compiled = _compile_rules(DEFAULT_KEY_RULES if rules is None else rules)
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in sd.items():
        new = key
        for rx, repl in compiled:
            new = rx.sub(repl, new)
        if new in out:
            raise CheckpointError(f"key rules map both {origin[new]!r} and {key!r} to {new!r}; adjust the rules")
        out[new], origin[new] = value, key
    return out


def _compile_rules(rules: list[tuple[str, str]]) -> list[tuple[re.Pattern[str], str]]:
    compiled = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and all(isinstance(x, str) for x in rule)):
            raise UsageError(f"key rule {rule!r} is not a (regex, replacement) pair of strings")
        try:
            compiled.append((re.compile(rule[0]), rule[1]))
        except re.error as e:
            raise UsageError(f"key rule regex {rule[0]!r} is invalid: {e}") from None
    return compiled


def _format_rules(rules: list[tuple[str, str]]) -> str:
    return ", ".join(f"{p!r} -> {r!r}" for p, r in rules) or "none"


# ----------------------------------------------------------------- warm start
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
            f"  key rules: {_format_rules(self.rules)} ({self.renamed} keys renamed)",
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
               run_dir: Path | None = None) -> WarmStartReport:
    """Load the matching weights of ``source`` into ``model`` (non-strict) and report.

    A key is loaded when, after the key rules, the checkpoint has a tensor with the
    model's name and shape; everything else keeps its initial value. The report (also
    logged at INFO) gives the rules and the loaded, missing, unexpected and
    shape-mismatched counts with up to 5 names each. Only model weights are loaded: the
    optimizer, schedule, step, RNG and loader cursor are not restored.

    Args:
        model: the model to fill; DDP / ``torch.compile`` wrappers are looked through.
        source: any weight source :func:`resolve_weight_source` accepts (incl. ``hf://``).
        weight_set: ``raw`` or ``ema``.
        rules: key rewrite rules (see :func:`apply_key_rules`); None: :data:`DEFAULT_KEY_RULES`.
        logger: where the report goes (default: the ``pimm`` logger).
        run_dir: resolves ``last``/``best``/``final``/``iter_<step>`` against a run.

    Returns:
        The :class:`WarmStartReport`.

    Raises:
        WeightNotFoundError, IncompleteCheckpointError: ``source`` does not resolve.
        CheckpointError: unreadable or unsafe file; no such weight set; zero model
            parameters matched (``no parameters matched ...``, exit code 2).
    """
    logger = logger or log
    used_rules = [tuple(r) for r in (DEFAULT_KEY_RULES if rules is None else rules)]
    path = resolve_weight_source(source, run_dir=run_dir)
    sets, info = read_checkpoint(path)
    raw = select_weight_set(sets, weight_set, source)
    sd = apply_key_rules(raw, used_rules)  # type: ignore[arg-type]
    renamed = sum(1 for a, b in zip(raw, sd) if a != b)

    target = unwrap(model)
    own = target.state_dict()
    param_names = {n for n, _ in target.named_parameters(remove_duplicate=False)}
    loaded = sorted(k for k in own.keys() & sd.keys() if tuple(own[k].shape) == tuple(sd[k].shape))
    report = WarmStartReport(
        source=os.fspath(source), resolved=str(path), weight_set=weight_set, rules=used_rules, renamed=renamed,
        loaded=loaded, missing=sorted(own.keys() - sd.keys()), unexpected=sorted(sd.keys() - own.keys()),
        mismatched=sorted((k, tuple(sd[k].shape), tuple(own[k].shape)) for k in own.keys() & sd.keys()
                          if tuple(own[k].shape) != tuple(sd[k].shape)),
        loaded_params=sum(1 for k in loaded if k in param_names), model_params=len(param_names),
    )
    if report.loaded_params == 0:
        ckpt_keys = ", ".join(list(sd)[:3]) or "none"
        model_keys = ", ".join(sorted(param_names)[:3]) or "none"
        what = " (a PyTorch Lightning checkpoint)" if info.get("layout") == "lightning" else ""
        rule = suggest_key_rule(list(sd), own)
        fix = ("its keys match the model's after one key rule: add train.key_rules = "
               f"[[{_toml_literal(rule[0])}, {_toml_literal(rule[1])}]]" if rule else "fix the source or the key rules")
        raise CheckpointError(
            f"no parameters matched between {source}{what} and the model (0 of {len(param_names)} model parameters "
            f"have a checkpoint tensor of the same name and shape; checkpoint keys e.g. {ckpt_keys}; model keys e.g. "
            f"{model_keys}; key rules: {_format_rules(used_rules)}); {fix}", exit_code=2)
    with torch.no_grad():
        target.load_state_dict({k: sd[k] for k in loaded}, strict=False)
    for line in report.lines():
        logger.info("%s", line)
    return report


def suggest_key_rule(ckpt_keys: list[str], own: dict[str, torch.Tensor]) -> tuple[str, str] | None:
    """A ``(regex, replacement)`` rule that maps most checkpoint keys onto model keys, or None.

    Tries removing a leading prefix that the checkpoint keys share (``model.``, as
    Lightning writes them; ``encoder.backbone.``...) and adding one the model keys share.
    """
    model_keys = set(own)
    if not ckpt_keys or not model_keys:
        return None
    # a prefix the checkpoint has and the model lacks (strip it), or the other way round (add it)
    rules = [(n, ("^" + re.escape(p), "")) for p, n in _prefix_counts(ckpt_keys, model_keys).items()]
    rules += [(n, ("^", p)) for p, n in _prefix_counts(model_keys, set(ckpt_keys)).items()]
    return max(rules, key=lambda r: r[0])[1] if rules else None


def _prefix_counts(keys, targets: set[str]) -> dict[str, int]:
    """How many of ``keys`` become a member of ``targets`` once each leading dotted prefix is removed."""
    counts: dict[str, int] = {}
    for k in keys:
        parts = k.split(".")
        for i in range(1, len(parts)):
            if ".".join(parts[i:]) in targets:
                prefix = ".".join(parts[:i]) + "."
                counts[prefix] = counts.get(prefix, 0) + 1
    return counts


def _toml_literal(text: str) -> str:
    """``text`` as a TOML string: a literal string ('...') unless it holds a quote."""
    return f"'{text}'" if "'" not in text and "\n" not in text else json.dumps(text)


# --------------------------------------------------------------- strict load
def _check_unwrapped(model: nn.Module) -> None:
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
                    for k in own.keys() & sd.keys() if tuple(own[k].shape) != tuple(sd[k].shape))
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

    Args:
        model: an unwrapped, uncompiled module whose architecture matches the checkpoint.
        checkpoint: any weight source :func:`resolve_weight_source` accepts: a run's
            ``model/last`` directory, ``model_best.pth``, a ``best`` pointer, an export
            directory, ``hf://org/repo``...
        weights: ``raw`` or ``ema`` (the parameter set at that checkpoint position).

    Raises:
        UsageError: ``model`` is a DDP or ``torch.compile`` wrapper; bad ``weights``.
        WeightNotFoundError, IncompleteCheckpointError: ``checkpoint`` does not resolve.
        CheckpointError: unreadable or unsafe file; no such weight set; keys or shapes
            differ from the model (the message names them and both shapes).
    """
    _check_unwrapped(model)
    path = resolve_weight_source(checkpoint)
    sd = apply_key_rules(select_weight_set(read_weight_sets(path), weights, checkpoint))
    check_strict(model, sd, str(path))
    with torch.no_grad():
        model.load_state_dict(sd, strict=True)
