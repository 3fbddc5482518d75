"""The resolved config as TOML, each value that differs from pimm's default marked (torch-free).

``pimm config show`` prints it; the reference of every key is :class:`~pimm_core.config.Config`
itself, so the listing cannot drift from the schema: every key is printed, an unset optional
one as a comment (TOML has no null).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tomli_w

from .schema import Config
from .tables import toml_key


def _value(v: Any) -> str:
    """``v`` in TOML value syntax on one line (tomli-w's own rendering of ``k = v``, the ``k = `` cut;
    arrays joined here, as tomli-w writes one item per line)."""
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return tomli_w.dumps({"k": v}).split("=", 1)[1].strip()


def _lines(cfg: Any, default: Any) -> list[str]:
    out = []
    for f in dataclasses.fields(cfg):
        v, d = getattr(cfg, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(v):
            continue
        key = toml_key(f.name)
        mark = "" if v == d else f"  # changed; default: {'unset' if d is None else _value(d)}"
        if v is None or (isinstance(v, dict) and not v and d in (None, {})):
            out.append(f"# {key} = (unset){mark}")
        else:
            out.append(f"{key} = {_value(v)}{mark}")
    return out


def _tables(cfg: Any, default: Any, path: str) -> list[str]:
    """``[path]`` with its keys, then its nested tables (``[log.tensorboard]``), depth first."""
    parts = []
    lines = _lines(cfg, default)
    if lines or path:
        parts.append((f"[{path}]\n" if path else "") + "\n".join(lines))
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            sub = f"{path}.{toml_key(f.name)}" if path else toml_key(f.name)
            d = getattr(default, f.name)  # None: an optional table ([log.wandb]) the default leaves out
            parts += _tables(v, type(v)() if d is None else d, sub)
    return parts


def render(cfg: Config) -> str:
    """``cfg`` as TOML text: top-level keys, then one ``[table]`` per section, in the schema's
    order; a value that differs from ``Config()``'s is followed by ``# changed; default: ...``."""
    return "\n\n".join(_tables(cfg, Config(), "")) + "\n"
