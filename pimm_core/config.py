"""Typed run configuration: TOML files, dotted overrides, validation, writing.

A config is a TOML file read with :mod:`tomllib`. Its tables map onto the
dataclasses below; unknown keys, wrong types and out-of-range values raise
:class:`~pimm_core.errors.ConfigError` with one line naming the key (and the
file line where it can be found) plus a suggestion for near-miss keys.

Overrides are ``dotted.key=value`` strings whose value uses TOML value syntax
(``train.lr=3e-4``, ``run.group="ablation"``); a value that is not valid TOML
is taken as a bare string, so ``checkpoint_format=standard`` works too.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomli_w

from .errors import ConfigError


@dataclass
class RunConfig:
    """Where the run directory goes: ``<root>/<group>/<name>[-YYYYmmdd-HHMMSS]``."""

    root: str = "exp"
    group: str = "default"
    name: str = ""  # empty: the config file's stem
    no_timestamp: bool = False


@dataclass
class TrainConfig:
    """Optimisation settings. Steps are optimizer steps (one per accumulation window)."""

    epochs: int = 10
    seed: int = 0
    lr: float = 1e-3
    grad_accum: int = 1
    max_steps: int | None = None  # optional cap on global steps: an endpoint, not a pause
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: float = 0.01
    momentum: float = 0.9  # SGD only
    scheduler: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = 0
    min_lr: float = 0.0
    grad_clip: float | None = 1.0  # max global L2 norm; None disables clipping
    on_nonfinite: Literal["stop", "skip", "continue"] = "stop"  # a NaN/Inf gradient norm: stop before applying it,
    # skip that step, or apply it anyway
    amp: Literal["none", "bf16", "fp16"] = "none"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every_steps: int = 10
    resume: bool = False
    weight: str = ""  # warm-start weights (not a resume): a path, a run keyword source or hf://org/repo[/file]
    weight_set: Literal["raw", "ema"] = "raw"  # which weights of `weight` to load
    key_rules: list[list[str]] | None = None  # ordered [regex, replacement]; None: strip module. and _orig_mod.


@dataclass
class DataConfig:
    """Dataset and loader. ``batch_size`` is per rank and per micro-batch."""

    name: str = "digits"
    batch_size: int = 32
    num_workers: int = 0  # per rank
    val_fraction: float = 0.2
    split_seed: int = 0


@dataclass
class ModelConfig:
    name: str = "mlp"
    hidden: int = 128
    dropout: float = 0.1


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0: no step-based saves
    every_epochs: int = 1  # 0: no epoch-end saves (the end of training still saves)
    keep_iter: int = 3  # how many iter_<step>.pth snapshots to keep; 0 keeps none
    keep_last: int = 3  # single format: how many step_<step>.pth files to keep (pointer targets always kept)
    on_error: Literal["stop", "continue"] = "stop"  # a failed periodic save stops the run (or only warns)
    async_: bool = False  # TOML key `async`: write periodic standard saves in the background


@dataclass
class EvalConfig:
    every_epochs: int = 1
    metric: str = "val/acc"
    mode: Literal["max", "min"] = "max"
    weights: Literal["raw", "ema"] = "raw"  # evaluate the raw or the EMA weights


@dataclass
class EmaConfig:
    """EMA of the parameters, updated after each optimizer step (see pimm_core.ema)."""

    enabled: bool = False
    decay: float = 0.999
    warmup: bool = True  # decay ramps up as min(decay, (1 + n) / (10 + n)) over n updates


@dataclass
class Config:
    """The whole run configuration (one TOML file)."""

    run: RunConfig = field(default_factory=RunConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    checkpoint_format: Literal["standard", "legacy", "single"] = "standard"
    resume_strict_state: bool = True

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict with TOML key names, ``None`` values dropped (TOML has no null)."""
        return _drop_none(dataclasses.asdict(self))


def _toml_key(name: str) -> str:
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


# Metrics the evaluator produces (the selection metric must be one of them).
EVAL_METRICS = ("val/acc", "val/loss")


_RANGES: dict[str, tuple[float | None, float | None]] = {
    "train.epochs": (1, None),
    "train.lr": (0, None),
    "train.grad_accum": (1, None),
    "train.max_steps": (1, None),
    "train.weight_decay": (0, None),
    "train.momentum": (0, 1),
    "train.warmup_steps": (0, None),
    "train.min_lr": (0, None),
    "train.grad_clip": (0, None),
    "train.log_every_steps": (1, None),
    "data.batch_size": (1, None),
    "data.num_workers": (0, None),
    "data.val_fraction": (0, 1),
    "model.hidden": (1, None),
    "model.dropout": (0, 1),
    "checkpoint.every_steps": (0, None),
    "checkpoint.every_epochs": (0, None),
    "checkpoint.keep_iter": (0, None),
    "checkpoint.keep_last": (1, None),
    "eval.every_epochs": (0, None),
    "ema.decay": (0, 1),
}


def _drop_none(d: Any) -> Any:
    if isinstance(d, dict):
        return {_toml_key(k): _drop_none(v) for k, v in d.items() if v is not None}
    return d


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key the schema accepts, e.g. ``["run.root", ..., "resume_strict_state"]``."""
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            keys += all_keys(hint, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{_toml_key(f.name)}")
    return keys


def _line_of(source: str | None, dotted: str) -> int | None:
    """Best-effort 1-based line of ``dotted`` key in TOML ``source`` (for messages)."""
    if not source:
        return None
    *tables, key = dotted.split(".")
    table = ".".join(tables)
    current = ""
    for no, line in enumerate(source.splitlines(), 1):
        m = re.match(r"\s*\[\s*([^\]]+?)\s*\]", line)
        if m:
            current = m.group(1)
            if current == dotted:
                return no
            continue
        m = re.match(r"\s*([A-Za-z0-9_.\-\"]+)\s*=", line)
        if m:
            full = ".".join(p for p in (current, m.group(1).replace('"', "")) if p)
            if full == dotted or (current == table and m.group(1) == key):
                return no
    return None


class _Where:
    """Formats the location part of a message: file and line when known."""

    def __init__(self, path: Path | None, source: str | None):
        self.path, self.source = path, source

    def __call__(self, dotted: str, origin: str) -> str:
        if origin == "override":
            return "override"
        line = _line_of(self.source, dotted)
        if self.path is None:
            return "config"
        return f"{self.path}:{line}" if line else str(self.path)


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if args:  # Optional[X]
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(hint, str(hint))


def _coerce(value: Any, hint: Any, dotted: str, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{where}: {dotted} = {value!r} is not allowed; use {_type_name(hint)}")
    if origin is list:  # only list[list[str]] (key rules) exists in the schema
        if not (isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                                                for p in value)):
            raise ConfigError(f"{where}: {dotted} must be a list of [regex, replacement] string pairs, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], dotted, where)
    ok = (
        (hint is bool and isinstance(value, bool))
        or (hint is int and isinstance(value, int) and not isinstance(value, bool))
        or (hint is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (hint is str and isinstance(value, str))
    )
    if not ok:
        raise ConfigError(f"{where}: {dotted} must be {_type_name(hint)}, got {value!r}")
    return float(value) if hint is float else value


def _build(cls: type, data: dict[str, Any], origins: dict[str, str], where: _Where, prefix: str = "") -> Any:
    # A TOML key that is a Python keyword (checkpoint.async) maps to the field with a trailing "_".
    data = {f"{k}_" if keyword.iskeyword(k) else k: v for k, v in data.items()}
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            dotted = f"{prefix}{key}"
            is_table = isinstance(data[key], dict)
            choices = sorted({k.rsplit(".", 1)[0] for k in all_keys() if "." in k}) if is_table else all_keys()
            close = difflib.get_close_matches(dotted, choices, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else "; see configs/digits.toml for the known keys"
            origin = "override" if any(o == dotted or o.startswith(dotted + ".") for o in origins) else "file"
            kind = "table" if is_table else "key"
            raise ConfigError(f"{where(dotted, origin)}: unknown {kind} {dotted}{hint}")
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        dotted = f"{prefix}{_toml_key(name)}"
        hint = hints[name]
        value = data[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{where(dotted, origins.get(dotted, 'file'))}: {dotted} must be a table")
            kwargs[name] = _build(hint, value, origins, where, f"{dotted}.")
        else:
            kwargs[name] = _coerce(value, hint, dotted, where(dotted, origins.get(dotted, "file")))
    return cls(**kwargs)


def _validate_ranges(cfg: Config, where: _Where, origins: dict[str, str]) -> None:
    for dotted, (lo, hi) in _RANGES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value is None:
            continue
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise ConfigError(f"{where(dotted, origins.get(dotted, 'file'))}: {dotted} = {value!r} is out of range; it must be {bound}")
    if cfg.eval.metric not in EVAL_METRICS:
        raise ConfigError(f"{where('eval.metric', origins.get('eval.metric', 'file'))}: eval.metric = "
                          f"{cfg.eval.metric!r} is not produced by the evaluator; use one of {list(EVAL_METRICS)}")
    if cfg.checkpoint.async_ and cfg.checkpoint_format != "standard":
        raise ConfigError(f"{where('checkpoint.async', origins.get('checkpoint.async', 'file'))}: checkpoint.async "
                          f"needs checkpoint_format = 'standard' (got {cfg.checkpoint_format!r})")
    if cfg.eval.weights == "ema" and not cfg.ema.enabled:
        raise ConfigError(f"{where('eval.weights', origins.get('eval.weights', 'file'))}: eval.weights = 'ema' "
                          "needs ema.enabled = true")



def parse_override(text: str) -> tuple[str, Any]:
    """Parse one ``dotted.key=value`` override.

    Returns:
        ``(dotted_key, value)``; ``value`` parsed as a TOML value, else the raw string.

    Raises:
        ConfigError: no ``=`` or an empty key.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not key=value; write e.g. train.epochs=3")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted}: {part} is not a table")
        node = nxt
    node[parts[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), extra: dict[str, Any] | None = None) -> Config:
    """Read, merge and validate a config.

    Args:
        path: a TOML file, or ``None`` for the built-in defaults.
        overrides: ``dotted.key=value`` strings applied after the file.
        extra: dotted keys set by CLI flags (e.g. ``{"train.resume": True}``), applied last.

    Raises:
        ConfigError: missing/unreadable file, bad TOML (with line and column), unknown
            key (with a near-miss suggestion), wrong type or out-of-range value.
    """
    data: dict[str, Any] = {}
    source = None
    p = Path(path) if path is not None else None
    if p is not None:
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist; pass an existing TOML file, e.g. --train.config configs/digits.toml")
        if p.is_dir():
            raise ConfigError(f"config path {p} is a directory; pass a TOML file")
        try:
            source = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read config file {p}: {e}") from None
        try:
            data = tomllib.loads(source)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
    origins: dict[str, str] = {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
        origins[key] = "override"
    for key, value in (extra or {}).items():
        _set_dotted(data, key, value)
        origins[key] = "override"
    where = _Where(p, source)
    cfg = _build(Config, data, origins, where)
    _validate_ranges(cfg, where, origins)
    return cfg


def config_from_dict(data: dict[str, Any]) -> Config:
    """Validate a nested dict (e.g. a run's saved ``config.toml``) into a :class:`Config`."""
    cfg = _build(Config, data, {}, _Where(None, None))
    _validate_ranges(cfg, _Where(None, None), {})
    return cfg


def write_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as TOML (tomli-w) atomically."""
    from .fsio import atomic_write_bytes

    atomic_write_bytes(path, tomli_w.dumps(cfg.to_dict()).encode())


def read_saved_config(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A run's saved ``config.toml`` as a nested dict, for readers that must not fail on it (never raises).

    Returns:
        ``(data, None)``; ``(None, None)`` when the file does not exist; ``(None, problem)``
        when it cannot be read or is not valid TOML (``problem``: one line, for an operator).
    """
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8")), None
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        return None, f"config.toml is unreadable ({e.__class__.__name__}: {e})"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
