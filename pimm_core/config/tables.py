"""TOML tables onto dataclasses: type coercion, unknown keys with a near-miss suggestion,
and the file line a key is on, for :mod:`pimm_core.config`'s one-line messages."""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError

#: The range of a TOML integer (signed 64 bits); :mod:`tomllib` itself reads larger ones.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def toml_key(name: str) -> str:
    """A field's TOML key: ``async_`` (a Python keyword with ``_``) is ``async``."""
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key the schema accepts, e.g. ``["run.root", ..., "resume_strict_state"]``."""
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            keys += all_keys(hint, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{toml_key(f.name)}")
    return keys


def line_of(source: str | None, dotted: str) -> int | None:
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


class Where:
    """Formats the location part of a message: file and line when known."""

    def __init__(self, path: Path | None, source: str | None):
        self.path, self.source = path, source

    def __call__(self, dotted: str, origin: str) -> str:
        if origin == "override":
            return "override"
        if origin == "flag":  # set by a command-line flag such as --run.name
            return f"--{dotted}"
        line = line_of(self.source, dotted)
        if self.path is None:
            return "config"
        return f"{self.path}:{line}" if line else str(self.path)


def type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if args:  # Optional[X]
        return " or ".join(type_name(a) for a in args if a is not type(None))
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(hint, str(hint))


def coerce(value: Any, hint: Any, dotted: str, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{where}: {dotted} = {value!r} is not allowed; use {type_name(hint)}")
    if origin is dict:  # an args table: any TOML values, checked against the target's signature later
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {dotted} must be a table of keyword arguments, got {value!r}")
        return value
    if hint == list[str]:
        if not (isinstance(value, list) and all(isinstance(x, str) and x for x in value)):
            raise ConfigError(f"{where}: {dotted} must be a list of non-empty strings, got {value!r}")
        return value
    if origin is list:  # list[list[str]]: key rules
        if not (isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                                                for p in value)):
            raise ConfigError(f"{where}: {dotted} must be a list of [regex, replacement] string pairs, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return coerce(value, inner[0], dotted, where)
        first: ConfigError | None = None
        for one in inner:  # several types (float | str): the first that takes the value
            try:
                return coerce(value, one, dotted, where)
            except ConfigError as e:
                # a value of one of the types that is refused for what it is (a NaN float) says why
                if first is None and isinstance(value, one) and not isinstance(value, bool):
                    first = e
        raise first or ConfigError(f"{where}: {dotted} must be {type_name(hint)}, got {value!r}")
    ok = (
        (hint is bool and isinstance(value, bool))
        or (hint is int and isinstance(value, int) and not isinstance(value, bool))
        or (hint is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (hint is str and isinstance(value, str))
    )
    if not ok:
        raise ConfigError(f"{where}: {dotted} must be {type_name(hint)}, got {value!r}")
    if hint is float and not math.isfinite(value):
        raise ConfigError(f"{where}: {dotted} = {value!r} is not a finite number; write a number such as 0.001")
    if hint is int and not INT64_MIN <= value <= INT64_MAX:
        raise ConfigError(f"{where}: {dotted} = {value!r} does not fit in 64 bits (TOML integers are between "
                          f"{INT64_MIN} and {INT64_MAX})")
    return float(value) if hint is float else value


def origin_of(origins: dict[str, str], dotted: str) -> str:
    """Where ``dotted`` (or a key under it) was set: ``override``, ``flag`` or ``file``."""
    if dotted in origins:
        return origins[dotted]
    return next((o for key, o in origins.items() if key.startswith(dotted + ".")), "file")


def build(cls: type, data: dict[str, Any], origins: dict[str, str], where: Where, prefix: str = "",
          root: type | None = None) -> Any:
    """``cls(**data)`` with every value coerced to its field's type, nested tables built
    recursively; ``root`` (default ``cls``) is the schema whose keys near-miss suggestions use.

    Raises:
        ConfigError: unknown key or table, wrong type, value outside a ``Literal``.
    """
    root = root or cls
    # A TOML key that is a Python keyword (checkpoint.async) maps to the field with a trailing "_".
    data = {f"{k}_" if keyword.iskeyword(k) else k: v for k, v in data.items()}
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            dotted = f"{prefix}{key}"
            is_table = isinstance(data[key], dict)
            choices = sorted({k.rsplit(".", 1)[0] for k in all_keys(root) if "." in k}) if is_table else all_keys(root)
            close = difflib.get_close_matches(dotted, choices, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else "; see configs/digits.toml for the known keys"
            origin = origin_of(origins, dotted)
            kind = "table" if is_table else "key"
            raise ConfigError(f"{where(dotted, origin)}: unknown {kind} {dotted}{hint}")
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        dotted = f"{prefix}{toml_key(name)}"
        hint = hints[name]
        value = data[name]
        optional = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(optional) == 1 \
                and dataclasses.is_dataclass(optional[0]) and value is not None:
            hint = optional[0]  # an optional table ([log.mlflow]): present means used
        if typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            item = typing.get_args(hint)[0]  # an array of tables: [[callbacks]]
            if not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
                raise ConfigError(f"{where(dotted, origins.get(dotted, 'file'))}: {dotted} must be an array of "
                                  f"tables ([[{dotted}]])")
            kwargs[name] = [build(item, v, origins, where, f"{dotted}[{i}].", item) for i, v in enumerate(value)]
        elif dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{where(dotted, origins.get(dotted, 'file'))}: {dotted} must be a table")
            kwargs[name] = build(hint, value, origins, where, f"{dotted}.", root)
        else:
            kwargs[name] = coerce(value, hint, dotted, where(dotted, origins.get(dotted, "file")))
    return cls(**kwargs)
