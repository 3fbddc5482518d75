"""Values out of the run's JSON records, as Python's json module writes them (torch-free).

``metrics.jsonl`` may hold ``NaN``, ``Infinity`` and ``-Infinity`` (a diverged loss), and
a hand-edited or damaged file may hold anything where a number belongs; readers take
numbers through these instead of trusting the type.
"""

from __future__ import annotations

import math
from typing import Any


def json_number(v: Any) -> float | None:
    """``v`` as a float when it is a JSON number (NaN and +-Inf included; booleans are not), else None."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def finite_number(v: Any) -> float | None:
    """``v`` as a float when it is a finite number, else None (NaN and +-Inf are None)."""
    f = json_number(v)
    return f if f is not None and math.isfinite(f) else None


def json_int(v: Any) -> int | None:
    """``v`` as an int: an int as it is, a finite float truncated, anything else None."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    f = finite_number(v)
    return None if f is None else int(f)
