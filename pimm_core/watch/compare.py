"""Runs side by side (torch-free): every metric of a run as a bounded series, and how two configs differ.

:func:`read_series` reads ``metrics.jsonl`` with :class:`~.metrics.MetricsTail` (a large
file: its tail plus an evenly spaced sample of the rest, evaluations by a byte scan), keeping
each metric as a decimated :class:`~.series.Series`: opening a run with a million lines
costs what opening it in the one-run console costs, whatever the number of metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import flatten, read_saved_config
from ..run.layout import CONFIG, METRICS
from ..run.status import read_run_status
from ..run.values import finite_number, json_int
from .metrics import MetricsTail
from .series import NonFinite, Series

#: Record fields that are bookkeeping, not metrics.
_NOT_METRICS = frozenset(("step", "epoch", "iter", "split", "time"))
#: At most this many metric names are kept per run (a run logging thousands of keys stays bounded).
MAX_METRICS = 64
#: Config keys left out of a comparison: where a run is, not how it trained.
_PLACE_KEYS = ("run.",)


class _AllMetrics(MetricsTail):
    """:class:`MetricsTail` that also keeps a series of every numeric field: training ones by
    name (``loss``, ``grad_norm``), evaluation ones as ``val/<name>``."""

    def _reset(self) -> None:
        super()._reset()
        self.series: dict[str, Series] = {}

    def _take(self, rec: dict[str, Any], *, sampled: bool = False, odd: bool = True) -> None:
        super()._take(rec, sampled=sampled, odd=odd)
        split = rec.get("split", "train")
        step = finite_number(rec.get("step"))
        if step is None or split not in ("train", "val"):
            return
        prefix = "" if split == "train" else "val/"
        for k, v in rec.items():
            y = finite_number(v) if k not in _NOT_METRICS and not isinstance(v, bool) else None
            if y is None:
                continue
            s = self.series.get(prefix + k)
            if s is None:
                if len(self.series) >= MAX_METRICS:
                    continue
                s = self.series[prefix + k] = Series(self.max_points)
            s.add(step, y)


@dataclass
class RunSeries:
    """What the compare view plots of one run.

    Attributes:
        run_dir: the run directory.
        series: metric name -> ``(steps, values)``, finite values only, at most ``max_points`` each,
            in file order; training metrics by name (``loss``), evaluation ones as ``val/<name>``.
        samples_per_step: samples in one optimizer step (``data.batch_size`` x ``train.grad_accum``
            x the world size in ``status.json``), or None when the config does not say.
        config: the saved config, flattened (``{"train.lr": 0.002, ...}``); empty when unreadable.
        problem: why the metrics or the config could not be read, or None.
        nonfinite: metric name (as in ``series``) -> where it logged NaN or +-Inf (those values are
            not in ``series``: the view says where the line stops being finite).
    """

    run_dir: Path
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    samples_per_step: int | None = None
    config: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None
    nonfinite: dict[str, NonFinite] = field(default_factory=dict)


def samples_per_step(config: dict[str, Any], world_size: int | None) -> int | None:
    """Samples one optimizer step consumes: per-rank batch x accumulation x ranks (None if unknown)."""
    data, train = config.get("data"), config.get("train")
    batch = json_int(data.get("batch_size")) if isinstance(data, dict) else None
    accum = json_int(train.get("grad_accum", 1)) if isinstance(train, dict) else 1
    if batch is None or accum is None or batch <= 0 or accum <= 0:
        return None
    return batch * accum * max(1, world_size or 1)


def read_series(run_dir: Path, *, max_points: int = 1000, tail_bytes: int = 256 << 10,
                sample_lines: int = 1000) -> RunSeries:
    """Every metric of ``run_dir`` as a bounded series, its config, and samples per step.

    Reads at most ``tail_bytes`` of ``metrics.jsonl`` line by line (its end), ``sample_lines``
    sampled lines before that, and the evaluation records by a byte scan. Never raises for
    missing or damaged files (``problem`` says what could not be read).
    """
    run_dir = Path(run_dir)
    tail = _AllMetrics(run_dir / METRICS, full_read_bytes=tail_bytes, tail_bytes=tail_bytes,
                       sample_lines=sample_lines, max_points=max_points)
    problem = None
    try:
        tail.poll()
    except OSError as e:
        problem = f"metrics.jsonl is unreadable ({e.__class__.__name__}: {e})"
    config, config_problem = read_saved_config(run_dir / CONFIG)
    out = RunSeries(run_dir, {name: s.points() for name, s in tail.series.items()},
                    config=flatten(config) if config else {}, problem=problem or config_problem,
                    nonfinite=dict(tail.nonfinite))
    if config:
        out.samples_per_step = samples_per_step(config, read_run_status(run_dir).world_size)
    return out


def config_diff(base: dict[str, Any], other: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, base value, other value)`` for each flattened config key whose values differ,
    sorted by key; a key missing on one side has None there. ``run.*`` keys (where the run is
    kept, its name) are left out."""
    keys = sorted(set(base) | set(other))
    return [(k, base.get(k), other.get(k)) for k in keys
            if not k.startswith(_PLACE_KEYS) and base.get(k) != other.get(k)]
