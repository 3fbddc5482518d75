"""pimm_core.runview: the torch-free readers behind the console (metrics tail, log tail, status)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from pimm_core.runview import LogTail, MetricsTail, RunReader, Series, is_run_dir, read_status


def _rec(step: int, split: str = "train", **kw: float) -> bytes:
    base = {"step": step, "epoch": step // 100, "iter": step % 100, "split": split, "time": 1000.0 + step}
    if split == "train":
        base.update(loss=1.0 / (1 + step), lr=0.001, samples_per_s=500.0)
    return (json.dumps({**base, **kw}) + "\n").encode()


def test_series_keeps_a_bounded_even_sample() -> None:
    s = Series(max_points=100)
    for i in range(10_000):
        s.add(i, i * 2.0)
    assert 50 <= len(s) <= 100
    xs, ys = s.points()
    assert xs[0] == 0 and xs[-1] == 9999 and ys[-1] == 19998
    gaps = {b - a for a, b in zip(xs[:-2], xs[1:-1])}
    assert len(gaps) == 1  # evenly thinned


def test_metrics_tail_is_incremental_and_waits_for_unfinished_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert not tail.poll() and not tail.exists
    path.write_bytes(_rec(1) + _rec(2) + _rec(3)[:7])
    assert tail.poll()
    assert tail.last_train["step"] == 2 and tail.pending == 7 and tail.bad_lines == 0
    with open(path, "ab") as f:
        f.write(_rec(3)[7:] + _rec(4, "val", loss=0.5, acc=0.9) + b"garbage\n")
    assert tail.poll()
    assert tail.last_train["step"] == 3 and tail.last_val["acc"] == 0.9
    assert tail.pending == 0 and tail.bad_lines == 1 and tail.records == 4
    assert not tail.poll()  # nothing new
    # A fresh start replaces the file: read again from the beginning.
    path.unlink()
    path.write_bytes(_rec(1))
    tail.poll()
    assert tail.last_train["step"] == 1 and tail.records == 1 and tail.last_val is None


def test_metrics_tail_samples_a_large_file_and_finds_every_eval(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with open(path, "wb") as f:
        for step in range(1, 50_001):
            f.write(_rec(step))
            if step % 1000 == 0:
                f.write(_rec(step, "val", loss=1.0 / step, acc=step / 50_000))
    tail = MetricsTail(path, full_read_bytes=1 << 20, tail_bytes=256 << 10, sample_lines=500, max_points=400)
    t0 = time.perf_counter()
    tail.poll()
    took = time.perf_counter() - t0
    assert tail.sampled
    assert [r["step"] for r in tail.val] == list(range(1000, 50_001, 1000))
    assert tail.best_val("val/acc", "max")["step"] == 50_000
    assert tail.best_val("val/loss", "min")["step"] == 50_000
    xs, _ = tail.loss.points()
    assert xs[0] < 200 and xs[-1] == 50_000 and len(xs) <= 401
    assert tail.last_train["step"] == 50_000
    assert took < 5, took
    with open(path, "ab") as f:
        f.write(_rec(50_001))
    assert tail.poll() and tail.last_train["step"] == 50_001


def test_log_tail(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    path.write_text("".join(f"line {i}\n" for i in range(5000)))
    tail = LogTail(path, keep=10, tail_bytes=1000)
    tail.poll()
    assert list(tail.lines) == [f"line {i}" for i in range(4990, 5000)]
    with open(path, "a") as f:
        f.write("line 5000\nline 50")
    tail.poll()
    assert tail.lines[-1] == "line 5000"
    with open(path, "a") as f:
        f.write("01\n")
    tail.poll()
    assert tail.lines[-1] == "line 5001"


def _status(run: Path, **kw: object) -> None:
    run.mkdir(parents=True, exist_ok=True)
    base = {"state": "running", "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time()}
    (run / "status.json").write_text(json.dumps({**base, **kw}))


def test_read_status_liveness(tmp_path: Path) -> None:
    run = tmp_path / "r"
    v = read_status(run)
    assert v.state is None and "no status.json" in v.problem and not v.live
    _status(run)
    v = read_status(run)
    assert v.live and v.stoppable and v.display_state == "running" and v.pid_alive
    (run / "control").mkdir()
    (run / "control" / "stop").write_text('{"reason": "operator"}')
    v = read_status(run)
    assert v.display_state == "stopping" and v.stop_request == {"reason": "operator"}
    (run / "control" / "stop").unlink()
    _status(run, heartbeat=time.time() - 300)
    v = read_status(run)
    assert v.stale and not v.live and "no heartbeat for" in v.note
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _status(run, pid=dead.pid)
    v = read_status(run)
    assert v.pid_alive is False and not v.live and f"process {dead.pid} is gone" in v.note
    _status(run, pid=dead.pid, host="some-other-host")  # cannot check a pid elsewhere: trust the heartbeat
    assert read_status(run).live
    _status(run, state="finished")
    v = read_status(run)
    assert not v.live and not v.stale and v.note is None
    (run / "status.json").write_text("{")
    assert "not valid JSON" in read_status(run).problem


def test_run_reader_on_a_half_created_run(tmp_path: Path) -> None:
    run = tmp_path / "r"
    assert not is_run_dir(run)
    run.mkdir()
    assert not is_run_dir(run)
    snap = RunReader(run).poll()
    assert any("empty run directory" in p for p in snap.problems)
    (run / "config.toml").write_text('[eval]\nmetric = "val/loss"\nmode = "min"\n')
    assert is_run_dir(run)
    snap = RunReader(run).poll()
    assert snap.metric == "val/loss" and snap.mode == "min" and snap.step is None
    assert any("no status.json" in p for p in snap.problems)
    (run / "config.toml").write_text("[eval\n")
    assert any("config.toml is unreadable" in p for p in RunReader(run).poll().problems)
