"""Which records of an interrupted run a resume replaces, and that they are kept aside (torch-free)."""

from __future__ import annotations

import json

from pimm_core.run import METRICS, SUPERSEDED, read_metrics, supersede_after


def _write(path, recs, tail=b""):
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in recs) + tail)


def test_records_after_the_resumed_step_move_aside_in_order(tmp_path):
    recs = [{"step": s, "split": "train", "loss": s / 10} for s in range(1, 10)]
    recs.insert(5, {"step": 5, "split": "val", "acc": 0.5})
    _write(tmp_path / METRICS, recs, tail=b'{"step": 10, "spl')  # a line cut short by the kill
    assert supersede_after(tmp_path / METRICS, 5, eval_done=True) == 5
    assert read_metrics(tmp_path / METRICS) == recs[:6]
    aside = (tmp_path / SUPERSEDED).read_bytes().splitlines()
    assert [json.loads(x) for x in aside[:4]] == recs[6:] and aside[4] == b'{"step": 10, "spl'


def test_an_evaluation_at_the_resumed_step_that_is_not_in_the_checkpoint_is_replaced(tmp_path):
    recs = [{"step": 5, "split": "train"}, {"step": 5, "split": "val", "acc": 0.5}]
    _write(tmp_path / METRICS, recs)
    assert supersede_after(tmp_path / METRICS, 5, eval_done=False) == 1
    assert read_metrics(tmp_path / METRICS) == recs[:1]
    assert read_metrics(tmp_path / SUPERSEDED) == recs[1:]


def test_nothing_after_the_resumed_step_leaves_the_file_alone(tmp_path):
    _write(tmp_path / METRICS, [{"step": 1, "split": "train"}])
    ino = (tmp_path / METRICS).stat().st_ino
    assert supersede_after(tmp_path / METRICS, 1, eval_done=True) == 0
    assert (tmp_path / METRICS).stat().st_ino == ino and not (tmp_path / SUPERSEDED).exists()
    assert supersede_after(tmp_path / "missing.jsonl", 1, eval_done=True) == 0
