"""The training config as it may leave the training machine with an export (torch-free).

``config.json`` of an export is the run's ``config.toml`` with its load triggers cleared
(``train.weight = ""``, ``train.resume = false``: a model built from it must not load
weights or resume from a path on the training machine) and every other absolute path
replaced by ``"<redacted>"``.
"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any

from ...errors import CheckpointError

REDACTED = "<redacted>"

#: Config keys that would make a model built from the exported config load weights
#: (or resume) from a path on the training machine, and the value that disables them.
LOAD_TRIGGERS: dict[str, Any] = {"train.weight": "", "train.resume": False}

_WINDOWS_ABS = re.compile(r"^[A-Za-z]:[\\/]|^\\\\")


def _is_abs_path(value: str) -> bool:
    return value.startswith(("/", "~", "file://")) or bool(_WINDOWS_ABS.match(value))


def sanitize_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """The config as it may leave the training machine.

    Load triggers (:data:`LOAD_TRIGGERS`) present in ``cfg`` are reset; any other string
    that is an absolute path (``/...``, ``~...``, ``C:\\...``, ``file://...``), at any depth
    and inside lists, becomes ``"<redacted>"``.

    Returns:
        ``(clean, cleared, redacted)``: a deep copy, and the dotted keys that were cleared
        and redacted (list items as ``key[i]``).
    """
    clean = copy.deepcopy(cfg)
    cleared, redacted = [], []
    for dotted, value in LOAD_TRIGGERS.items():
        *parents, leaf = dotted.split(".")
        node: Any = clean
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            if node[leaf] != value:
                cleared.append(dotted)
            node[leaf] = value

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, f"{where}.{k}" if where else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(node)]
        if isinstance(node, str) and _is_abs_path(node):
            redacted.append(where)
            return REDACTED
        return node

    return walk(clean, ""), cleared, redacted


def read_run_config(run_dir: Path) -> dict[str, Any] | None:
    """``run_dir/config.toml`` as a dict, or None when absent.

    Raises:
        CheckpointError: the file exists but is not valid TOML.
    """
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        return None
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CheckpointError(f"cannot read the run config {path}: {e}") from None
