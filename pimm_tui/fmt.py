"""Formatting helpers of the console: numbers, rates, ages, steps, and one-line errors."""

from __future__ import annotations

import math
from typing import Any

from pimm_core.errors import PimmError, first_line
from pimm_core.watch.fmt import fmt_value


def nonfinite(v: Any) -> bool:
    """``v`` is a float that is NaN or infinite (shown in bold red)."""
    return isinstance(v, float) and not math.isfinite(v)


def fmt_num(v: Any, digits: int = 4) -> str:
    """A metric value: ``0.8969``, ``1.27e-03``; ``NaN``, ``inf``, ``-inf`` as logged; ``-`` for missing."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return fmt_value(v)
    if v == 0:
        return "0"
    if abs(v) < 1e-3 or abs(v) >= 1e5:
        return f"{v:.2e}"
    return f"{v:.{digits}f}"


def fmt_rate(v: float | None) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):
        return fmt_value(v)
    if v >= 1e6:
        return f"{v / 1e6:.1f}M"
    if v >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.1f}"


def fmt_step(v: float) -> str:
    """A global step on an axis: ``950``, ``12k``, ``1.25M``."""
    n = int(round(v))
    a = abs(n)
    if a < 10_000:
        return str(n)
    if a < 1_000_000:
        return f"{n / 1000:.4g}k"
    return f"{n / 1_000_000:.4g}M"


def error_line(e: BaseException) -> str:
    """A readable one-line message for an exception raised by pimm_core (or anything else)."""
    if isinstance(e, PimmError):
        return str(e)
    if isinstance(e, OSError):
        return f"{e.strerror or e.__class__.__name__}: {e.filename or ''}".rstrip(": ")
    return f"{e.__class__.__name__}: {first_line(e, empty='')}".rstrip(": ")
