"""The seed's topology table, row by row: ``plan_resume`` unit tests, then real resumes (world size 1).

World-size changes (2 -> 1, 1 -> 2) are exercised on real runs in ``test_resume_exact.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from _helpers import read_json, read_jsonl, resumed_records
from _resume_driver import run_job
from conftest import STOPPED_AT, STOPPED_OVERRIDES
from pimm_core.checkpoint.records.manifest import write_manifest
from pimm_core.run.topology import ROWS, plan_resume

STEPS = 45  # optimizer steps per epoch at world size 1
K = 50  # interruption: epoch 1, iter 5
OV = ["train.epochs=2", "data.num_workers=0"]


# ------------------------------------------------------------------ plan_resume
def manifest(step=50, epoch=1, it=5, ws=1, workers=0, loader=True) -> dict:
    return {"step": step, "epoch": epoch, "iter": it, "world_size": ws, "workers_per_rank": workers,
            "has_loader_state": loader}


def plan(m: dict, ws=1, workers=0, strict=True, grad_accum=1, legacy=False):
    return plan_resume(m, world_size=ws, strategy="ddp", workers_per_rank=workers, strict=strict, grad_accum=grad_accum,
                       legacy=legacy)


REPLAY = {"epoch": 1, "step": 45, "from_iter": 5}


@pytest.mark.parametrize("name,m,kw,row,cursor,rng", [
    ("same", manifest(), {}, "same", True, True),
    ("world size 1->2", manifest(), {"ws": 2}, "world_size", False, False),
    ("world size 2->1", manifest(ws=2), {}, "world_size", False, False),
    ("workers 0->2", manifest(), {"workers": 2}, "workers", False, True),
    ("no loader state", manifest(loader=False), {}, "no_loader_state", False, True),
    ("non-strict", manifest(), {"strict": False}, "non_strict", False, True),
    ("non-strict, other world size", manifest(ws=2), {"strict": False}, "non_strict", False, False),
    ("legacy mid-epoch", manifest(loader=False), {"legacy": True}, "legacy", False, True),
    ("legacy ignores a cursor", manifest(loader=True), {"legacy": True}, "legacy", False, True),
])
def test_plan_rows_mid_epoch(name, m, kw, row, cursor, rng):
    p = plan(m, **kw)
    assert p.row == row and p.description == ROWS[row]
    assert p.restore_cursor is cursor and p.restore_rng is rng
    assert p.exact is (row == "same")
    if row == "same":
        assert (p.step, p.epoch, p.iter, p.replay_boundary) == (50, 1, 5, None)
        assert "loader cursor" in p.restored and p.discarded == [] and p.warnings == []
    else:  # cursor skipped: restart the saved epoch, say so
        assert (p.step, p.epoch, p.iter) == (45, 1, 0)
        assert p.replay_boundary == REPLAY
        assert "loader cursor" in p.discarded and "loader cursor" not in p.restored
        assert any("loader cursor skipped" in w and "restarting epoch 1 at step 45" in w and "5 batches" in w
                   for w in p.warnings), p.warnings
    assert ("per-rank RNG" in p.restored) is rng
    assert any(d.startswith("per-rank RNG") for d in p.discarded) is (not rng)
    ws_changed = p.topology["saved_world_size"] != p.topology["world_size"]
    assert any("world size changed" in w for w in p.warnings) is ws_changed
    assert any("per-rank workers changed" in w for w in p.warnings) is (row == "workers")
    assert p.to_json()["description"] == ROWS[row]


def test_plan_world_size_reshards_optimizer_and_records_topology():
    p = plan(manifest(ws=2, workers=2), ws=1, workers=2)
    assert "optimizer (resharded through DCP)" in p.restored
    assert "per-rank RNG (ranks differ)" in p.discarded
    assert p.topology == {"saved_world_size": 2, "world_size": 1, "saved_strategy": "ddp", "strategy": "ddp",
                          "saved_workers_per_rank": 2, "workers_per_rank": 2,
                          "saved_batch_size": None, "batch_size": None, "saved_grad_accum": 1, "grad_accum": 1}


def test_plan_non_strict_is_best_effort():
    p = plan(manifest(), strict=False)
    assert all(r.endswith("(best effort)") for r in p.restored if r != "per-rank RNG")


@pytest.mark.parametrize("kw", [{}, {"ws": 2}, {"workers": 2}, {"strict": False}, {"legacy": True}])
def test_plan_at_epoch_end_has_nothing_to_replay(kw):
    """A checkpoint at an epoch end (iter 0) continues at the next epoch's first batch under every row."""
    p = plan(manifest(step=45, epoch=1, it=0, loader=False), **kw)
    assert (p.step, p.epoch, p.iter, p.replay_boundary) == (45, 1, 0, None)
    assert "loader cursor" not in p.discarded
    assert not any("cursor skipped" in w for w in p.warnings)


def test_plan_epoch_end_same_topology_is_exact():
    p = plan(manifest(step=45, epoch=1, it=0, loader=False))
    assert p.row == "same" and p.exact and not p.restore_cursor


def test_plan_maps_replayed_micro_batches_to_optimizer_steps():
    # grad_accum 4: iter 12 of epoch 2 is 3 optimizer steps into the epoch
    p = plan(manifest(step=33, epoch=2, it=12), ws=2, grad_accum=4)
    assert p.replay_boundary == {"epoch": 2, "step": 30, "from_iter": 12}
    assert (p.step, p.iter) == (30, 0)


@pytest.mark.parametrize("key,saved,now", [("batch_size", 32, 16), ("grad_accum", 1, 3)])
def test_plan_batching_change_is_a_row_and_replays_from_the_recorded_epoch_start(key, saved, now):
    """Case accum-change-on-resume A: epoch 1 began after step 45; with any new batching the
    boundary is that recorded step, not one re-derived from the new window."""
    m = {**manifest(step=55, epoch=1, it=10), "batch_size": 32, "grad_accum": 1, "epoch_start_step": 45, key: saved}
    kw = {"batch_size": 32, "grad_accum": 1, key: now}
    p = plan_resume(m, world_size=1, strategy="ddp", workers_per_rank=0, strict=True, **kw)
    assert p.row == key and p.description == ROWS[key]
    assert not p.restore_cursor and p.restore_rng and not p.exact
    assert (p.step, p.epoch, p.iter) == (45, 1, 0) and p.replay_boundary == {"epoch": 1, "step": 45, "from_iter": 10}
    assert (p.topology[f"saved_{key}"], p.topology[key]) == (saved, now)
    assert any(f"changed {saved} -> {now}" in w for w in p.warnings), p.warnings


def test_plan_world_size_and_accum_change_uses_recorded_epoch_start():
    # 2 ranks -> 1 rank and grad_accum 1 -> 2: the boundary is the recorded 23, not 27 - 8 // 2
    m = {**manifest(step=27, epoch=1, it=4, ws=2), "grad_accum": 1, "epoch_start_step": 23}
    p = plan_resume(m, world_size=1, strategy="ddp", workers_per_rank=0, strict=True, grad_accum=2)
    assert p.row == "world_size" and p.step == 23 and p.replay_boundary["step"] == 23


def test_plan_manifest_without_loader_flag_infers_it():
    m = manifest()
    del m["has_loader_state"]
    assert plan(m).row == "same"  # a mid-epoch standard checkpoint carries its cursor


# ------------------------------------------------------------------ real resumes
@pytest.fixture(scope="module")
def base(tmp_path_factory, stopped_run) -> Path:
    """A world-size-1 run interrupted mid-epoch at step K (model/last: epoch 1, iter 5, with loader state):
    a copy of conftest's ``stopped_run`` (BASE + OV, stopped at K)."""
    assert (tuple(OV), K) == (STOPPED_OVERRIDES, STOPPED_AT)
    run = tmp_path_factory.mktemp("topology") / "base"
    shutil.copytree(stopped_run, run)
    m = read_json(run / "model" / "last" / "manifest.json")
    assert (m["step"], m["epoch"], m["iter"], m["has_loader_state"]) == (K, 1, 5, True)
    return run


def _resume_two_steps(base: Path, dest: Path, overrides: list[str], boundary: int, edit=None) -> tuple[dict, list]:
    """Copy ``base``, resume it with ``overrides`` for two optimizer steps; returns (provenance entry, new train records)."""
    shutil.copytree(base, dest)
    if edit is not None:
        edit(dest)
    run_job(dest, [*OV, *overrides], resume_from=dest / "model" / "last", stop_at=boundary + 2)
    entry = [s for s in read_json(dest / "provenance.json")["starts"] if s["kind"] == "resume"][-1]
    after = [(r["step"], r["epoch"], r["iter"]) for r in resumed_records(dest / "metrics.jsonl", entry["step"])
             if r["split"] == "train"]
    return entry, after


def _check_restart(entry: dict, after: list, row: str) -> None:
    assert entry["kind"] == "resume" and entry["policy"] == row and entry["exact"] is False
    assert entry["checkpoint_step"] == K
    assert entry["replay_boundary"] == {"epoch": 1, "step": STEPS, "from_iter": 5}
    assert (entry["step"], entry["epoch"], entry["iter"]) == (STEPS, 1, 0)
    assert "loader cursor" in entry["discarded"]
    assert any("loader cursor skipped" in w and "restarting epoch 1 at step 45" in w for w in entry["warnings"])
    # the saved epoch restarts: its first batch is trained again, as step boundary + 1
    assert after == [(STEPS + 1, 1, 1), (STEPS + 2, 1, 2)]


def test_same_topology_continues_from_saved_iteration(base, tmp_path):
    entry, after = _resume_two_steps(base, tmp_path / "run", [], K)
    assert entry["policy"] == "same" and entry["exact"] is True and entry["replay_boundary"] is None
    assert (entry["step"], entry["epoch"], entry["iter"]) == (K, 1, 5)
    assert after == [(K + 1, 1, 6), (K + 2, 1, 7)]


def test_worker_count_change_discards_cursor_and_restarts_epoch(base, tmp_path):
    entry, after = _resume_two_steps(base, tmp_path / "run", ["data.num_workers=2"], STEPS)
    _check_restart(entry, after, "workers")
    assert entry["topology"] == {"saved_world_size": 1, "world_size": 1, "saved_strategy": "ddp", "strategy": "ddp",
                                 "saved_workers_per_rank": 0,
                                 "workers_per_rank": 2, "saved_batch_size": 32, "batch_size": 32,
                                 "saved_grad_accum": 1, "grad_accum": 1,
                                 "saved_data_length": 1438, "data_length": 1438}  # digits: 1,438 train samples
    assert "per-rank RNG" in entry["restored"]  # same ranks: RNG still applies
    assert any("per-rank workers changed 0 -> 2" in w for w in entry["warnings"])
    prov = read_json(tmp_path / "run" / "provenance.json")
    assert prov["workers_per_rank"] == 2
    # seed: "The saved epoch restarted -- Read the warning": the resumed run's log says so and why
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"resuming from {tmp_path / 'run' / 'model' / 'last'} at step 45, epoch 1, iter 0" in log
    assert "loader cursor skipped (per-rank worker count changes): restarting epoch 1 at step 45" in log
    assert "5 batches already completed in that epoch will replay" in log


def test_non_strict_skips_cursor(base, tmp_path):
    entry, after = _resume_two_steps(base, tmp_path / "run", ["resume_strict_state=false"], STEPS)
    _check_restart(entry, after, "non_strict")
    assert any("(best effort)" in r for r in entry["restored"])


def test_checkpoint_without_loader_state_restarts_epoch(base, tmp_path):
    def drop_loader_state(run: Path) -> None:
        path = run / "model" / "last" / "manifest.json"
        write_manifest(path, {**read_json(path), "has_loader_state": False})

    entry, after = _resume_two_steps(base, tmp_path / "run", [], STEPS, edit=drop_loader_state)
    _check_restart(entry, after, "no_loader_state")
