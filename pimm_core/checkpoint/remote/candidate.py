"""One checkpoint on a run's remote store, as the store lists it (torch-free).

Shared by :mod:`.store` (which lists them) and :mod:`.choice` (which compares the newest with the local
one), so neither imports the other back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STEP_RE = re.compile(r"^step_(\d+)$")


@dataclass
class RemoteCandidate:
    """One checkpoint on the remote: ``name`` (``step_<N>`` or a weights file), its step,
    whether its marker is there (``complete``), its URL-relative path."""

    name: str
    step: int | None
    complete: bool
    kind: str  # "standard" or "weights"
