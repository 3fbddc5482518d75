"""pimm_core.watch (and pimm_core.run.log.LogTail): the torch-free readers behind the console (metrics tail, log tail, status)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from _helpers import hang_s
from pimm_core.run.layout import is_run_dir
from pimm_core.run.log import LogTail
from pimm_core.watch.candidates import candidate_identity, find_candidate, verify_checkpoint
from pimm_core.watch.metrics import MetricsTail
from pimm_core.watch.series import Series
from pimm_core.watch.snapshot import RunReader
from pimm_core.watch.status import read_status
from tui_support import rotate


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


# ------------------------------------------------------------ non-finite values
def test_metrics_tail_keeps_nonfinite_values_out_of_the_plot_and_says_where(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [_rec(s) for s in range(1, 6)]
    lines.append(_rec(6, loss=float("inf")))  # Python's json writes Infinity / NaN / -Infinity
    lines.append(_rec(7, loss=float("nan"), lr=float("-inf")))
    lines.append(_rec(7, "val", loss=float("nan"), acc=0.1))
    path.write_bytes(b"".join(lines))
    assert b'"loss": Infinity' in path.read_bytes() and b'"lr": -Infinity' in path.read_bytes()
    tail = MetricsTail(path)
    tail.poll()
    xs, ys = tail.loss.points()
    assert xs == [1, 2, 3, 4, 5] and all(math.isfinite(y) for y in ys)
    loss, lr, val = tail.nonfinite["loss"], tail.nonfinite["lr"], tail.nonfinite["val/loss"]
    assert (loss.first_step, loss.last_step, loss.count, loss.recovered) == (6, 7, 2, False)
    assert loss.note() == "loss not finite from step 6 (NaN at step 7)"
    assert lr.note() == "lr not finite from step 7 (-inf)"
    assert val.note() == "val/loss not finite from step 7 (NaN)"
    assert tail.best_val("val/loss", "min") is None  # NaN is never best
    assert tail.best_val("val/acc", "max")["step"] == 7
    # Finite again (an AMP step skipped on an inf loss): the note says so.
    with open(path, "ab") as f:
        f.write(_rec(8) + _rec(9))
    tail.poll()
    assert tail.nonfinite["loss"].note() == "loss was not finite at steps 6-7 (2 values); finite again from step 8"
    assert tail.loss.points()[0][-2:] == [8, 9]


def test_run_reader_with_nonfinite_status_and_metrics(tmp_path: Path) -> None:
    run = tmp_path / "r"
    _status(run, state="failed", step=float("inf"), heartbeat=float("nan"), total_steps=float("nan"),
            error="TrainingError: loss is not finite")
    (run / "metrics.jsonl").write_bytes(_rec(1) + _rec(2, loss=float("nan"), samples_per_s=float("inf"),
                                                      time=float("inf")))
    snap = RunReader(run).poll()
    assert snap.step == 2 and snap.total_steps is None and snap.status.heartbeat_age is None
    assert snap.nonfinite_of("loss").first_step == 2 and snap.samples_per_s is None
    assert "loss not finite from step 2 (NaN)" in snap.problems[-1]
    assert snap.loss == ((1.0,), (0.5,))


def test_large_metrics_file_finds_nonfinite_records_in_the_sampled_head(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with open(path, "wb") as f:
        for step in range(1, 30_001):
            f.write(_rec(step, loss=float("nan")) if step in (1234, 1300) else _rec(step))
    tail = MetricsTail(path, full_read_bytes=1 << 20, tail_bytes=256 << 10, sample_lines=300)
    tail.poll()
    assert tail.sampled
    nf = tail.nonfinite["loss"]
    assert (nf.first_step, nf.last_step, nf.count) == (1234, 1300, 2)
    assert nf.recovered and all(math.isfinite(y) for y in tail.loss.points()[1])


# ------------------------------------------------------------ verify on a live run
def test_verify_checkpoint_rotated_while_hashing_checks_the_new_generation(tmp_path: Path, monkeypatch) -> None:
    import pimm_core.checkpoint.select.selection as selection

    model = tmp_path / "model"
    model.mkdir()
    rotate(model, 10, b"a" * 5000)
    real = selection.verify_candidate
    pending = [20]

    def rotating(c):  # a save publishes a new `last` just as the hash starts
        if pending:
            rotate(model, pending.pop(), b"b" * 7000)
        return real(c)

    monkeypatch.setattr(selection, "verify_candidate", rotating)
    r = verify_checkpoint(model, "last", settle_s=0.01)
    assert (r.outcome, r.step, r.tries, r.problems) == ("ok", 20, 2, [])
    assert r.identity == candidate_identity(find_candidate(model, "last"))

    def always(c):
        rotate(model, (c.step or 0) + 10, os.urandom(3000))
        return real(c)

    monkeypatch.setattr(selection, "verify_candidate", always)
    r = verify_checkpoint(model, "last", settle_s=0.01)
    assert r.outcome == "changed" and r.tries == 3 and "changed while it was checked" in r.problems[0]


def test_verify_checkpoint_never_reports_a_mismatch_while_saves_rotate_last(tmp_path: Path) -> None:
    import threading

    model = tmp_path / "model"
    model.mkdir()
    rotate(model, 1, os.urandom(2 << 20))
    stop = threading.Event()
    saves = [1]

    def saver() -> None:
        while not stop.is_set():
            saves[0] += 1
            rotate(model, saves[0], os.urandom((2 << 20) + saves[0]))

    t = threading.Thread(target=saver)
    t.start()
    results = []
    deadline = time.monotonic() + hang_s(30)
    try:
        while (len(results) < 20 or saves[0] < 10) and time.monotonic() < deadline:
            results.append(verify_checkpoint(model, "last", settle_s=0.05))
    finally:
        stop.set()
        t.join()
    assert saves[0] >= 10 and len(results) >= 20
    assert not [r for r in results if r.outcome == "failed"], [r.problems for r in results]
    assert any(r.ok for r in results) or all(r.outcome == "changed" for r in results)
    # A damaged generation is still a failure.
    rotate(model, 1000, b"c" * 4000)
    (model / "last" / "weights.pth").write_bytes(b"d" * 4000)
    r = verify_checkpoint(model, "last", settle_s=0.01)
    assert r.outcome == "failed" and r.problems == ["weights.pth: sha256 mismatch"] and r.step == 1000
