"""Checks of a built :class:`~pimm_core.config.Config` that span keys: ranges, the target
keys, the objective and its selection metric, and combinations that cannot work together
(each a :class:`~pimm_core.errors.ConfigError` naming the key and the fix)."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..fsio import url_scheme
from ..process.stop import parse_signals
from ..process.time_limit import parse_duration
from ..run.layout import NAME_SUFFIX_MAX, name_problem
from ..targets import is_target
from .tables import Where, origin_of

if TYPE_CHECKING:
    from .schema import Config

#: The built-in objectives and the validation metrics each produces (``val/<name>``);
#: :mod:`pimm_core.objectives` implements them.
OBJECTIVES: dict[str, tuple[str, ...]] = {
    "classification": ("acc", "loss"),
    "regression": ("mae", "loss"),
    "language_modeling": ("loss", "perplexity"),
}

#: The config keys that name a user target, and the keys of their args tables.
TARGET_KEYS = (("model.target", "model.args"), ("data.target", "data.args"),
               ("optimizer.target", "optimizer.args"), ("scheduler.target", "scheduler.args"))


#: Inclusive ranges of the numeric keys (None: unbounded). Every float key must also be finite
#: and every integer fit in 64 bits (:func:`pimm_core.config.tables.coerce`). ``train.seed``
#: stays below 2**63 because the rank and the epoch are added to it before it reaches
#: ``torch.Generator.manual_seed`` (which takes at most 2**64 - 1); ``data.split_seed`` seeds
#: NumPy's ``RandomState`` (at most 2**32 - 1).
RANGES: dict[str, tuple[float | None, float | None]] = {
    "train.epochs": (1, None),
    "train.seed": (0, 2**63 - 1),
    "data.split_seed": (0, 2**32 - 1),
    "train.lr": (0, None),
    "train.grad_accum": (1, None),
    "train.global_batch": (1, None),
    "train.max_steps": (1, None),
    "train.weight_decay": (0, None),
    "train.momentum": (0, 1),
    "train.warmup_steps": (0, None),
    "train.min_lr": (0, None),
    "train.grad_clip": (0, None),
    "train.log_every_steps": (1, None),
    "train.threads": (1, None),
    "data.batch_size": (1, None),
    "data.num_workers": (0, None),
    "data.timeout": (0, None),
    "eval.batch_size": (1, None),
    "data.val_fraction": (0, 1),
    "model.hidden": (1, None),
    "model.dropout": (0, 1),
    "checkpoint.every_steps": (0, None),
    "checkpoint.memory_every_steps": (0, None),
    "checkpoint.every_epochs": (0, None),
    "checkpoint.keep_iter": (0, None),
    "checkpoint.keep_best": (1, None),
    "checkpoint.keep_last": (1, None),
    "checkpoint.keep_full": (1, None),
    "eval.every_epochs": (0, None),
    "checkpoint.remote_timeout": (0, None),
    "dist.timeout": (0.01, None),  # minutes (0.6 s): a collective needs some time even when all is well
    "ema.decay": (0, 1),
    "parallel.tp": (1, None),
}



def validate(cfg: Config, where: Where, origins: dict[str, str]) -> None:
    for dotted, (lo, hi) in RANGES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value is None:
            continue
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise ConfigError(f"{where(dotted, origins.get(dotted, 'file'))}: {dotted} = {value!r} is out of range; it must be {bound}")
    if cfg.data.target is None and not 0 < cfg.data.val_fraction < 1:
        raise ConfigError(f"{where('data.val_fraction', origins.get('data.val_fraction', 'file'))}: data.val_fraction = "
                          f"{cfg.data.val_fraction!r} leaves the {'validation' if cfg.data.val_fraction <= 0 else 'training'}"
                          " split empty; it must be greater than 0 and less than 1 (e.g. 0.2)")
    _validate_names(cfg, where, origins)
    _validate_places(cfg, where, origins)
    _validate_plugins(cfg, where, origins)
    _validate_time_and_signals(cfg, where, origins)
    if cfg.checkpoint.async_ and cfg.checkpoint_format != "standard":
        raise ConfigError(f"{where('checkpoint.async', origins.get('checkpoint.async', 'file'))}: checkpoint.async "
                          f"needs checkpoint_format = 'standard' (got {cfg.checkpoint_format!r})")
    if cfg.train.strategy == "fsdp" and cfg.checkpoint_format != "standard":
        raise ConfigError(f"{where('checkpoint_format', origins.get('checkpoint_format', 'file'))}: checkpoint_format = "
                          f"{cfg.checkpoint_format!r} writes the whole model and optimizer from rank 0 and cannot hold "
                          "FSDP's sharded state; use checkpoint_format = 'standard' with train.strategy = 'fsdp'")
    if cfg.train.strategy == "fsdp" and cfg.train.amp == "fp16":
        raise ConfigError(f"{where('train.amp', origins.get('train.amp', 'file'))}: train.amp = 'fp16' (loss scaling) is "
                          "not supported with train.strategy = 'fsdp'; use train.amp = 'bf16' or "
                          "fsdp.param_dtype = 'bfloat16'")
    if cfg.train.activation_checkpointing and not cfg.train.blocks:
        raise ConfigError(f"{where('train.activation_checkpointing', origins.get('train.activation_checkpointing', 'file'))}: "
                          "train.activation_checkpointing needs train.blocks, the model's block classes to recompute "
                          "(e.g. train.blocks = [\"Block\"])")
    if cfg.parallel.tp > 1 and cfg.checkpoint_format != "standard":
        raise ConfigError(f"{where('checkpoint_format', origins.get('checkpoint_format', 'file'))}: checkpoint_format = "
                          f"{cfg.checkpoint_format!r} cannot hold tensor-parallel (parallel.tp > 1) sharded state; use "
                          "checkpoint_format = 'standard'")
    if cfg.parallel.tp_plan is not None and not is_target(cfg.parallel.tp_plan):
        raise ConfigError(f"{where('parallel.tp_plan', origins.get('parallel.tp_plan', 'file'))}: parallel.tp_plan = "
                          f"{cfg.parallel.tp_plan!r} is not a target; write 'package.module:function'")
    if cfg.eval.weights == "ema" and not cfg.ema.enabled:
        raise ConfigError(f"{where('eval.weights', origins.get('eval.weights', 'file'))}: eval.weights = 'ema' "
                          "needs ema.enabled = true")



def _validate_time_and_signals(cfg: Config, where: Where, origins: dict[str, str]) -> None:
    for key, value, check in (("train.stop_signals", cfg.train.stop_signals, parse_signals),
                              ("train.max_time", cfg.train.max_time, parse_duration)):
        if value is None:
            continue
        try:
            check(value)
        except ValueError as e:
            raise ConfigError(f"{where(key, origins.get(key, 'file'))}: {key}: {e}") from None
    if not cfg.train.stop_signals:
        raise ConfigError(f"{where('train.stop_signals', origins.get('train.stop_signals', 'file'))}: "
                          "train.stop_signals is empty; name at least one, e.g. [\"SIGINT\", \"SIGTERM\"]")


def _validate_names(cfg: Config, where: Where, origins: dict[str, str]) -> None:
    """``run.group`` and ``run.name`` (unless empty: the config file's stem) are one path component each."""
    for key, value, suffix in (("run.group", cfg.run.group, 0),
                               ("run.name", cfg.run.name, 0 if cfg.run.no_timestamp else NAME_SUFFIX_MAX)):
        if key == "run.name" and value == "":
            continue
        problem = name_problem(value, suffix=suffix)
        if problem:
            shown = repr(value if len(value) <= 60 else value[:40] + "...")
            raise ConfigError(f"{where(key, origins.get(key, 'file'))}: {key} = {shown} {problem}; a run name and "
                              "its group are each one directory name under run.root (e.g. run.name = 'lr-sweep-3')")


def _validate_places(cfg: Config, where: Where, origins: dict[str, str]) -> None:
    """``run.root`` is a local (or shared POSIX) path, never a URL; ``checkpoint.remote`` is a URL."""
    root = cfg.run.root
    if url_scheme(root):
        raise ConfigError(f"{where('run.root', origins.get('run.root', 'file'))}: run.root = {root!r} is a remote URL; "
                          "the run directory (logs, metrics, status) must be a local or shared POSIX path: use "
                          f"a local run.root and checkpoint.remote = {root!r} to upload the checkpoints there")
    remote = cfg.checkpoint.remote
    if remote and not url_scheme(remote):
        raise ConfigError(f"{where('checkpoint.remote', origins.get('checkpoint.remote', 'file'))}: checkpoint.remote = "
                          f"{remote!r} is not a URL; write e.g. checkpoint.remote = 's3://bucket/prefix'")
    if cfg.checkpoint.remote_options is not None and not remote:
        raise ConfigError(f"{where('checkpoint.remote_options', 'file')}: checkpoint.remote_options is set but "
                          "checkpoint.remote is not")


def _validate_plugins(cfg: Config, where: Where, origins: dict[str, str]) -> None:
    """Checks of the target keys, the objective and the selection metric that need no import."""
    def at(dotted: str) -> str:
        return where(dotted, origin_of(origins, dotted))

    for key, args_key in TARGET_KEYS:
        section, name = key.split(".")
        table = getattr(cfg, section)
        target = getattr(table, name)
        if target is not None and not is_target(target):
            raise ConfigError(f"{at(key)}: {key} = {target!r} is not a target; write 'package.module:attr'")
        has_name = section in ("optimizer", "scheduler") and table.name is not None
        if target is not None and has_name:
            raise ConfigError(f"{at(key)}: {section}.name and {key} are both set; use one")
        if table.args is not None and target is None and not has_name:
            needs = f"{key} or {section}.name" if section in ("optimizer", "scheduler") else key
            raise ConfigError(f"{at(args_key)}: {args_key} is set but {needs} is not")
    for arg, instead in (("lr", "train.lr"), ("weight_decay", "train.weight_decay")):
        if arg in (cfg.optimizer.args or {}):
            raise ConfigError(f"{at('optimizer.args.' + arg)}: optimizer.args.{arg}: pimm sets it from {instead}; "
                              f"set {instead} instead")
    if cfg.scheduler.name == "onecycle" and cfg.train.warmup_steps:
        raise ConfigError(f"{at('scheduler.name')}: scheduler.name = 'onecycle' has its own warm-up "
                          "(scheduler.args.pct_start); set train.warmup_steps = 0")
    objective, metric = cfg.objective, cfg.eval.metric
    if objective in OBJECTIVES:
        produced = [f"val/{m}" for m in OBJECTIVES[objective]]
        if metric not in produced:
            raise ConfigError(f"{at('eval.metric')}: eval.metric = {metric!r} is not produced by the evaluator; "
                              f"use one of {produced}")
    elif not is_target(objective):
        close = difflib.get_close_matches(objective, list(OBJECTIVES), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"{at('objective')}: objective = {objective!r} is not a built-in objective; {hint}use one "
                          f"of {list(OBJECTIVES)} or a target 'package.module:function'")
    elif not metric.startswith("val/"):
        raise ConfigError(f"{at('eval.metric')}: eval.metric = {metric!r} must name a validation metric "
                          "'val/<name>' of the objective")


