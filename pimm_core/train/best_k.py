"""``checkpoint.keep_best = k``: the k best evaluations kept as ``best_<step>.pth`` weights files.

``model_best.pth`` stays the best (written as before, by :class:`~.best.BestTracker`); with
``k >= 2`` each evaluation that ranks among the k best by the selection metric is also written
as ``model/best_<step>.pth`` (the same weights file and sidecar as ``model_best.pth``), and the
files ranked below the k-th are removed. The ranking follows the selection metric's rules
(:class:`~.best.BestTracker`): strict improvement in ``eval.mode``, so of equal values the
earlier evaluation ranks first and a later equal one does not displace it; NaN or ±Inf never
enters.

Nothing is kept in memory: the ranking is rebuilt from the sidecars on disk at each decision,
so a resume continues it and a file removed by hand is forgotten. Only files this kind of run
writes are ranked or removed: ``best_<step>.pth`` whose sidecar is readable, says ``kind:
best`` and names the same metric and mode; any other file of that name is left alone.
Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.records.manifest import ManifestError, read_manifest
from ..checkpoint.select.selection import BEST_K_RE
from .best import BestTracker


@dataclass(frozen=True)
class RankedFile:
    """One kept ``best_<step>.pth``: its name, global step and selection-metric value."""

    name: str
    step: int
    value: float


def best_name(step: int) -> str:
    """The file name of the kept best at global step ``step``: ``best_<step>.pth``."""
    return f"best_{step}.pth"


def ranked_best(model_dir: Path, metric: str, mode: str) -> list[RankedFile]:
    """The ``best_<step>.pth`` files in ``model_dir`` written for ``metric`` in ``mode``, best first
    (equal values: the earlier step first). Files without a readable matching sidecar are not
    listed (never ranked, never removed). An absent ``model_dir`` has none."""
    out: list[RankedFile] = []
    try:
        entries = list(model_dir.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return out
    for entry in entries:
        m = BEST_K_RE.match(entry.name)
        if not m or not entry.is_file():
            continue
        try:
            side = read_manifest(entry.with_name(entry.name + ".json"))
        except (ManifestError, OSError):
            continue  # removed meanwhile, half-written by someone else, or not ours: not judged
        sel = side.get("selection_metric")
        if side.get("kind") != "best" or not isinstance(sel, dict) or sel.get("name") != metric \
                or sel.get("mode") != mode:
            continue
        value = sel.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        out.append(RankedFile(entry.name, int(m.group(1)), float(value)))
    sign = -1.0 if mode == "max" else 1.0
    return sorted(out, key=lambda f: (sign * f.value, f.step))


class BestKeeper:
    """Decides which evaluations become ``best_<step>.pth`` and which kept files go (see the module docstring).

    Args:
        keep: ``checkpoint.keep_best`` (1: only ``model_best.pth``; no ``best_<step>.pth`` files).
        metric, mode: the selection metric (``eval.metric``, ``eval.mode``: ``"max"`` or ``"min"``).
    """

    def __init__(self, keep: int, metric: str, mode: str):
        self.keep, self.metric, self.mode = keep, metric, mode

    @property
    def enabled(self) -> bool:
        return self.keep >= 2

    def admits(self, model_dir: Path, step: int, value: float) -> bool:
        """The evaluation at global ``step`` with ``value`` ranks among the ``keep`` best of those on disk.

        A file already kept for the same step (a resume that evaluates that step again) is not
        counted against it: the new evaluation replaces it when it is admitted."""
        if not self.enabled:
            return False
        others = [f for f in ranked_best(model_dir, self.metric, self.mode) if f.step != step]
        worst = others[self.keep - 1].value if len(others) >= self.keep else None
        return BestTracker(self.metric, self.mode, best=worst).is_improvement(value)

    def surplus(self, model_dir: Path) -> list[RankedFile]:
        """The kept files ranked below the ``keep``-th, to remove (none when disabled)."""
        if not self.enabled:
            return []
        return ranked_best(model_dir, self.metric, self.mode)[self.keep:]

    def rotate(self, model_dir: Path) -> list[str]:
        """Remove :meth:`surplus` (file, then sidecar); returns the names removed. A file already
        gone (removed by hand) is skipped."""
        removed = []
        for f in self.surplus(model_dir):
            path = model_dir / f.name
            path.unlink(missing_ok=True)
            path.with_name(f.name + ".json").unlink(missing_ok=True)
            removed.append(f.name)
        return removed
