"""JSON objects in small run files, read without ever raising for a missing or torn file (torch-free)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..fsio import atomic_write_bytes


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None if missing, unreadable, not JSON, or not an object."""
    try:
        with open(path, "rb") as f:  # (bytes: json.loads takes UTF-8 as read, no decode step; no Path made)
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: dict[str, Any], *, indent: int | None = None, durable: bool = True) -> None:
    """Replace ``path`` atomically with ``data`` as JSON plus a newline (:func:`pimm_core.fsio.atomic_write_bytes`).

    Raises:
        OSError: the write failed (the old file is untouched).
    """
    atomic_write_bytes(Path(path), (json.dumps(data, indent=indent) + "\n").encode(), durable=durable)
