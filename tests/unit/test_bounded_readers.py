"""Readers of metrics.jsonl and train.log hold memory bounded by what they show, not by the
file's size (issue 21): a 20 MB log, a 30 MB line without a newline, a large append between
two polls. Memory is measured with tracemalloc (allocations of this process's Python code).
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

from pimm_core.run.log import LogTail
from pimm_core.run.metrics import MAX_LINE, iter_metrics, parse_record, records_from_end
from pimm_core.watch.metrics import MetricsTail

MiB = 1 << 20


def _rec(step: int, split: str = "train") -> bytes:
    extra = {"loss": 1.0 / step, "lr": 1e-3} if split == "train" else {"acc": step / 1e6}
    return (json.dumps({"step": step, "epoch": 0, "iter": step, "split": split, **extra, "time": 1.0}) + "\n").encode()


def _big_log(path: Path, steps: int) -> None:
    with open(path, "wb") as f:
        f.write(b"".join(_rec(s) + (_rec(s, "val") if s % 1000 == 0 else b"") for s in range(1, steps + 1)))


def _peak(fn) -> tuple[object, int]:
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_line_nested_too_deeply_is_a_damaged_line() -> None:
    assert parse_record('{"a": ' + "[" * 5000 + "]" * 5000 + "}") is None
    assert parse_record(b'{"step": 1}') == {"step": 1}


def test_reading_from_the_end_holds_a_block_not_the_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _big_log(path, 200_000)  # about 20 MB; memory: a block of 1 MiB, its lines, one line of at most MAX_LINE
    assert path.stat().st_size > 18 * MiB
    with open(path, "ab") as f:
        f.write(b"x" * (3 * MAX_LINE) + b"\n" + _rec(200_001) + b'{"step": 200002, "spl')  # a long line, an unfinished one
    first, peak = _peak(lambda: next(r for r in records_from_end(path) if r is not None and r["step"] <= 100_000))
    assert first["step"] == 100_000 and first["split"] == "val"  # the newest record at or before step 100,000
    assert peak < 8 * MiB, peak
    newest = list(zip(range(3), records_from_end(path)))
    assert [r for _, r in newest] == [parse_record(_rec(200_001)), None, parse_record(_rec(200_000, "val"))]
    count, peak = _peak(lambda: sum(1 for r in iter_metrics(path) if r is not None))
    assert count == 200_000 + 200 + 1 and peak < 8 * MiB, (count, peak)


def test_the_console_tail_holds_what_it_shows(tmp_path: Path) -> None:
    """With 1 MiB chunks and a 1 MiB tail (the console's are 8 and 2), a 20 MB file and a
    20 MB append cost a few MiB, not their size."""
    path = tmp_path / "metrics.jsonl"
    _big_log(path, 200_000)
    tail = MetricsTail(path, full_read_bytes=2 * MiB, tail_bytes=MiB, chunk=MiB, max_points=500)
    _, peak = _peak(tail.poll)
    assert peak < 6 * MiB, peak
    assert tail.best_val("val/acc", "max")["step"] == 200_000 and len(tail.val) == 200
    with open(path, "ab") as f:  # a huge append between two polls, a line of 30 MB in it
        f.write(b"".join(_rec(s) for s in range(200_001, 300_001)) + b"y" * (30 * MiB) + b"\n")
        f.write(b"".join(_rec(s) for s in range(300_001, 310_001)))
    _, peak = _peak(tail.poll)
    assert peak < 6 * MiB, peak
    assert tail.last_train["step"] == 310_000 and tail.pending == 0
    with open(path, "ab") as f:  # a line still being written, longer than any record
        f.write(b"z" * (MAX_LINE + MiB // 2))
    _, peak = _peak(tail.poll)
    assert peak < 6 * MiB and tail.pending <= MAX_LINE, (peak, tail.pending)
    with open(path, "ab") as f:
        f.write(b"z\n" + _rec(310_001))
    tail.poll()
    assert tail.last_train["step"] == 310_001 and tail.bad_lines == 1 and tail.pending == 0


def test_the_log_tail_holds_its_window(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    path.write_bytes(b"start\n")
    tail = LogTail(path, keep=5, tail_bytes=32 << 10)
    tail.poll()
    with open(path, "ab") as f:
        f.write(b"".join(b"line %d\n" % i for i in range(5_000_000)))  # about 60 MB appended
    _, peak = _peak(tail.poll)
    assert peak < 1 * MiB, peak
    assert list(tail.lines) == [f"line {i}" for i in range(4_999_995, 5_000_000)]
    with open(path, "ab") as f:
        f.write(b"z" * (10 * MiB))  # a line longer than the window: its start is kept, marked
    _, peak = _peak(tail.poll)
    assert peak < 1 * MiB, peak
    with open(path, "ab") as f:
        f.write(b"zz\nafter\n")
    tail.poll()
    assert list(tail.lines)[-2:] == ["[...] " + "z" * ((32 << 10) - 7) + " [...]", "after"] or \
        list(tail.lines)[-1] == "after"
