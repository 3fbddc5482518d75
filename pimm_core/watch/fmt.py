"""Numbers, sizes and durations as the CLI and the console show them (torch-free)."""

from __future__ import annotations

import math
from typing import Any

from ..run.values import json_number


def fmt_size(n: int | None) -> str:
    """A byte count in binary units: ``512 B``, ``1.5 KiB`` ... ``2.0 TiB``; ``-`` for None."""
    if n is None or not math.isfinite(n):
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


def fmt_value(v: Any) -> str:
    """A logged number for a note: ``NaN``, ``inf``, ``-inf`` as Python's json writes them, else ``%g``;
    ``-`` when ``v`` is not a number."""
    f = json_number(v)
    if f is None:
        return "-"
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return f"{f:g}"


def human_duration(seconds: float | None) -> str:
    """A duration in words: ``42 s``, ``3 min 5 s``, ``2 h 10 min``, ``3 d 4 h``; ``-`` for None."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def fmt_age(seconds: float | None) -> str:
    """An age for a table cell, in its largest unit: ``12s``, ``5m``, ``3h``, ``2d``; ``-`` for None."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"
