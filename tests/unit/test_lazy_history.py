"""The console opens a large metrics.jsonl from its tail (first paint) and scans the part before
it a slice per later poll (issue 38): once that scan ends it knows exactly what an eager open
knows (every evaluation in order, the best value of each metric with ties to the earlier,
where each metric stopped being finite and where it recovered), and the first poll read none
of the earlier part, whatever the file's length."""

from __future__ import annotations

import json
import math
from pathlib import Path

from pimm_core.watch.metrics import MetricsTail
from pimm_core.watch.snapshot import RunReader

KiB = 1 << 10


def _line(rec: dict) -> str:
    return json.dumps(rec) + "\n"  # (json writes NaN and Infinity as the trainer's writer does)


def _write(path: Path, steps: int) -> None:
    """Training records every step, an evaluation every 50; loss NaN at 1000-1004 (recovers in the
    early part), lr Infinity from step 1500 on for 10 steps, val/loss NaN at step 1000, acc tied
    at its best at steps 600 and 1800, and grad_norm NaN from step steps-3 (still not finite)."""
    with open(path, "w") as f:
        for s in range(1, steps + 1):
            loss = math.nan if 1000 <= s < 1005 else 1.0 / s
            lr = math.inf if 1500 <= s < 1510 else 1e-3
            grad = math.nan if s >= steps - 3 else 0.5
            f.write(_line({"step": s, "epoch": s // 100, "split": "train", "loss": loss, "lr": lr,
                           "grad_norm": grad, "pad": "x" * 60, "time": float(s)}))
            if s % 50 == 0:
                acc = 0.9 if s in (600, 1800) else 0.5 + s / 10_000
                f.write(_line({"step": s, "epoch": s // 100, "split": "val", "acc": min(acc, 0.9),
                               "loss": math.nan if s == 1000 else 1.0 / s, "time": float(s)}))


def _state(t: MetricsTail) -> dict:
    return {"val": [r["step"] for r in t.val], "last_val": t.last_val, "records": t.records,
            "best": {(k, m): (t.best_val(k, m) or {}).get("step") for k in ("val/acc", "val/loss") for m in ("max", "min")},
            "nonfinite": [(k, n.to_json()) for k, n in t.nonfinite.items()], "last_train": t.last_train}


def test_lazy_history_ends_where_an_eager_open_is(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write(path, 2000)
    small = dict(full_read_bytes=64 * KiB, tail_bytes=32 * KiB, sample_lines=50, chunk=16 * KiB)
    eager = MetricsTail(path, **small)
    eager.poll()
    assert eager.history_pending is None and len(eager.val) == 40  # (every evaluation, by the scan)

    lazy = MetricsTail(path, lazy_history=True, scan_budget=48 * KiB, **small)
    assert lazy.poll()
    assert lazy.history_pending == 0.0  # the first poll: the tail (and the sample) only
    tail_vals = [r["step"] for r in lazy.val]  # only the evaluations in the tail
    assert 0 < len(tail_vals) < 10 and tail_vals == [r["step"] for r in eager.val][-len(tail_vals):]
    assert lazy.last_train == eager.last_train and lazy.nonfinite.keys() == {"grad_norm"}
    fractions = []
    while lazy.history_pending is not None:
        fractions.append(lazy.history_pending)
        assert lazy.poll()  # (nothing was appended: the scan goes on by itself)
    assert len(fractions) > 3 and fractions == sorted(fractions)  # a slice per poll
    assert _state(lazy) == _state(eager)
    assert not lazy.poll()  # done: an idle poll reads nothing
    notes = {k: n.note() for k, n in lazy.nonfinite.items()}
    assert notes["loss"].startswith("loss was not finite at steps 1000-1004 (5 values); finite again from step ")
    assert notes["grad_norm"].startswith("grad_norm not finite from step 1997")
    assert lazy.best_val("val/acc", "max")["step"] == 600  # the earlier of two equal bests


def test_the_console_reader_opens_lazily(tmp_path: Path) -> None:
    """RunReader (the console's) takes the lazy path: its snapshot says how much is scanned."""
    run = tmp_path / "run"
    run.mkdir()
    _write(run / "metrics.jsonl", 2000)
    reader = RunReader(run, full_read_bytes=64 * KiB, tail_bytes=32 * KiB, sample_lines=50, chunk=16 * KiB,
                       scan_budget=64 * KiB)
    snap = reader.poll()
    assert snap.metrics_history == 0.0 and snap.best_val["step"] > 1850
    while snap.metrics_history is not None:
        snap = reader.poll()
    assert snap.best_val["step"] == 600 and len(reader.metrics.val) == 40
    assert [n.key for n in snap.nonfinite] == ["loss", "val/loss", "lr", "grad_norm"]  # (order of first sight)
