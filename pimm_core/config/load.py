"""Reading, validating and writing a config: TOML files, dotted overrides, the saved ``config.toml`` (torch-free).

The schema is :mod:`.schema`; the cross-key checks run after the tables are built are
:mod:`.checks` (both imported here, so neither imports this module).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from ..errors import ConfigError
from .checks import validate
from .schema import Config
from .tables import Where, build


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
        origins[key] = "flag"
    where = Where(p, source)
    cfg = build(Config, data, origins, where)
    validate(cfg, where, origins)
    return cfg


def config_from_dict(data: dict[str, Any]) -> Config:
    """Validate a nested dict (e.g. a run's saved ``config.toml``) into a :class:`Config`."""
    cfg = build(Config, data, {}, Where(None, None))
    validate(cfg, Where(None, None), {})
    return cfg


def write_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as TOML (tomli-w) atomically."""
    from ..fsio import atomic_write_bytes

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
