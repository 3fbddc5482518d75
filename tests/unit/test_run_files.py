"""The run directory's small files, written and read back with their typed readers:
``status.json`` (:class:`RunStatus`), ``metrics.jsonl``, and what counts as a run
directory. Fast, no subprocess."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest

from pimm_core.errors import UsageError
from pimm_core.run import (CONFIG, METRICS, STATUS, MetricsWriter, RunStatus, check_run_dir, find_run_dir, is_run_dir,
                           model_dir_of, read_json, read_metrics, read_run_status, was_started, write_status)
from pimm_core.watch.metrics import MetricsTail
from pimm_core.watch.status import read_status

TRAINER_FIELDS = dict(pids=[11, 12], step=40, epoch=2, iter=5, total_steps=90, steps_per_epoch=30, epochs=3,
                      world_size=2, stop_reason=None)


# ------------------------------------------------------------------ status.json
def test_status_written_then_read_back_as_the_same_record(tmp_path: Path) -> None:
    write_status(tmp_path, "running", **TRAINER_FIELDS)
    rec = read_run_status(tmp_path)
    assert rec.problem is None
    assert (rec.state, rec.host, rec.pid) == ("running", socket.gethostname(), os.getpid())
    assert (rec.pids, rec.step, rec.epoch, rec.iter) == ([11, 12], 40, 2, 5)
    assert (rec.total_steps, rec.steps_per_epoch, rec.epochs, rec.world_size) == (90, 30, 3, 2)
    assert rec.stop_reason is None and rec.error is None and rec.extra == {}
    assert isinstance(rec.heartbeat, float) and rec.updated.endswith("+00:00")
    assert RunStatus.from_json(rec.to_json()) == rec


def test_status_file_keeps_the_keys_readers_and_scripts_use(tmp_path: Path) -> None:
    """The file's JSON: the same keys in the same order as before the typed record; stop_reason
    is written as null (scripts test for it), error only when the run failed."""
    write_status(tmp_path, "finished", **TRAINER_FIELDS)
    data = json.loads((tmp_path / STATUS).read_text())
    assert list(data) == ["state", "host", "pid", "updated", "heartbeat", "pids", "step", "epoch", "iter",
                          "total_steps", "steps_per_epoch", "epochs", "world_size", "stop_reason"]
    assert data["stop_reason"] is None
    write_status(tmp_path, "failed", **TRAINER_FIELDS, error="RuntimeError: boom")
    data = json.loads((tmp_path / STATUS).read_text())
    assert data["error"] == "RuntimeError: boom" and read_run_status(tmp_path).error == "RuntimeError: boom"


def test_status_tolerates_unknown_missing_and_mistyped_keys(tmp_path: Path) -> None:
    (tmp_path / STATUS).write_text(json.dumps({"state": "stopped", "step": 7.0, "epoch": "two", "pids": [1, "x", 3],
                                               "stop_reason": "operator", "future_key": {"a": 1}}))
    rec = read_run_status(tmp_path)
    assert (rec.state, rec.step, rec.epoch, rec.pids, rec.stop_reason) == ("stopped", 7, None, [1, 3], "operator")
    assert rec.host is None and rec.heartbeat is None and rec.total_steps is None
    assert rec.extra == {"future_key": {"a": 1}}
    assert rec.to_json()["future_key"] == {"a": 1}  # written back unchanged


def test_an_unknown_extra_field_is_written_as_given(tmp_path: Path) -> None:
    write_status(tmp_path, "running", step=1, note="warming up")
    assert read_json(tmp_path / STATUS)["note"] == "warming up"
    assert read_run_status(tmp_path).extra == {"note": "warming up"}


@pytest.mark.parametrize("content,problem", [
    (None, "no status.json"),
    (b'{"state": "runn', "not valid JSON"),  # torn by a crash mid-write (not atomic: e.g. copied)
    (b"\xff\xfe not utf-8", "not valid JSON"),
    (b'["running"]', "not a JSON object"),
])
def test_a_missing_or_damaged_status_reads_as_no_state_and_why(tmp_path: Path, content, problem) -> None:
    if content is not None:
        (tmp_path / STATUS).write_bytes(content)
    rec = read_run_status(tmp_path)
    assert rec.state is None and problem in rec.problem
    view = read_status(tmp_path)  # the watcher's view says the same and is not live
    assert view.state is None and problem in view.problem and not view.live and view.display_state == "unknown"


def test_a_live_status_with_a_fresh_heartbeat_of_this_process_is_live(tmp_path: Path) -> None:
    write_status(tmp_path, "running", **TRAINER_FIELDS)
    view = read_status(tmp_path)
    assert view.live and view.stoppable and view.pid_alive is True and view.record.step == 40


# ---------------------------------------------------------------- metrics.jsonl
def test_metrics_written_then_read_back_skipping_damage(tmp_path: Path) -> None:
    path = tmp_path / METRICS
    w = MetricsWriter(path)
    w.write({"step": 1, "split": "train", "loss": 2.5})
    w.write({"step": 2, "split": "train", "loss": float("nan")})
    w.write({"step": 2, "split": "val", "acc": 0.5})
    w.close()
    with open(path, "ab") as f:
        f.write(b"not json\n[1, 2]\n")
        f.write(b'{"step": 3, "split": "tr')  # a crash mid-line
    recs = read_metrics(path)
    assert [(r["step"], r["split"]) for r in recs] == [(1, "train"), (2, "train"), (2, "val")]
    assert math.isnan(recs[1]["loss"]) and all(isinstance(r["time"], float) for r in recs)
    assert read_metrics(tmp_path / "missing.jsonl") == []

    tail = MetricsTail(path)  # the console's reader agrees on what is damaged and what is pending
    tail.poll()
    assert tail.records == 3 and tail.bad_lines == 2 and tail.pending > 0
    assert tail.last_val["acc"] == 0.5 and tail.nonfinite["loss"].first_step == 2


# ------------------------------------------------------------- run directories
def test_run_dir_detection_has_one_meaning_per_name(tmp_path: Path) -> None:
    run = tmp_path / "exp" / "g" / "r"
    run.mkdir(parents=True)
    assert not is_run_dir(run) and not was_started(run) and find_run_dir(run) is None
    with pytest.raises(UsageError, match="is not a run directory"):
        check_run_dir(run)
    (run / "model").mkdir()  # checkpoints only: something to watch, but no trainer started here
    assert is_run_dir(run) and check_run_dir(run) == run and not was_started(run)
    assert model_dir_of(run) == run / "model" and model_dir_of(run / "model") == run / "model"
    (run / CONFIG).write_text("")
    assert was_started(run) and find_run_dir(run / "model" / "last" / "x.pt") == run.absolute()
    assert not is_run_dir(run / CONFIG)
    with pytest.raises(UsageError, match="does not exist"):
        check_run_dir(tmp_path / "nope")
    with pytest.raises(UsageError, match="is a file"):
        check_run_dir(run / CONFIG)
