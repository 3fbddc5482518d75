"""The resume policy for a change of ``train.strategy`` (ddp <-> fsdp): ``plan_resume`` alone.

A strategy change at the same world size keeps the loader cursor and per-rank RNG (the
sample order and RNG streams depend on rank and world size only); with a world-size (or
batching, workers...) change, that row applies and the strategy change is still named.
"""

from __future__ import annotations

import pytest

from pimm_core.run.topology import ROWS, plan_resume
from pimm_core.watch.resume_diff import plan_rows


def manifest(step=50, epoch=1, it=5, ws=1, strategy="ddp", **extra) -> dict:
    m = {"step": step, "epoch": epoch, "iter": it, "world_size": ws, "workers_per_rank": 0,
         "has_loader_state": True, "batch_size": 32, "grad_accum": 1, "epoch_start_step": 45, **extra}
    if strategy is not None:
        m["strategy"] = strategy
    return m


def plan(m: dict, *, ws=1, strategy="ddp", **kw):
    kw = {"workers_per_rank": 0, "strict": True, "grad_accum": 1, "batch_size": 32, **kw}
    return plan_resume(m, world_size=ws, strategy=strategy, **kw)


@pytest.mark.parametrize("saved,planned", [("ddp", "fsdp"), ("fsdp", "ddp")])
def test_strategy_change_alone_keeps_cursor_and_rng(saved, planned):
    p = plan(manifest(strategy=saved), strategy=planned)
    assert p.row == "strategy" and p.description == ROWS["strategy"]
    assert p.restore_cursor and p.restore_rng
    assert (p.step, p.epoch, p.iter, p.replay_boundary) == (50, 1, 5, None)  # continues at the saved iteration
    assert not p.exact  # same state and data order, but gradients are reduced another way
    assert "loader cursor" in p.restored and "per-rank RNG" in p.restored and p.discarded == []
    for part in ("model weights (resharded through DCP)", "optimizer (resharded through DCP)", "scheduler",
                 "epoch/step counters", "EMA (when the run keeps one; resharded through DCP)"):
        assert part in p.restored, p.restored
    assert (p.topology["saved_strategy"], p.topology["strategy"]) == (saved, planned)
    assert (p.topology["saved_world_size"], p.topology["world_size"]) == (1, 1)
    [w] = p.warnings
    assert w.startswith(f"strategy changed {saved} -> {planned}: model weights, optimizer state, schedule, "
                        "counters and EMA are kept, resharded exactly through DCP")
    assert "loader cursor and RNG are kept" in w
    assert p.to_json()["topology"]["saved_strategy"] == saved


def test_strategy_change_at_epoch_end_has_nothing_to_replay():
    p = plan(manifest(step=45, it=0, has_loader_state=False), strategy="fsdp")
    assert p.row == "strategy" and (p.step, p.epoch, p.iter, p.replay_boundary) == (45, 1, 0, None)
    assert p.discarded == [] and "loader cursor" not in p.restored and p.restore_rng


@pytest.mark.parametrize("saved_ws,ws", [(2, 1), (1, 2)])
def test_strategy_and_world_size_change_follow_the_world_size_row(saved_ws, ws):
    p = plan(manifest(ws=saved_ws, strategy="ddp"), ws=ws, strategy="fsdp")
    assert p.row == "world_size" and not p.restore_cursor and not p.restore_rng and not p.exact
    assert p.replay_boundary == {"epoch": 1, "step": 45, "from_iter": 5} and (p.step, p.iter) == (45, 0)
    assert "loader cursor" in p.discarded and "per-rank RNG (ranks differ)" in p.discarded
    assert "model weights (resharded through DCP)" in p.restored
    assert (p.topology["saved_strategy"], p.topology["strategy"]) == ("ddp", "fsdp")
    assert any(f"world size changed {saved_ws} -> {ws}" in w for w in p.warnings), p.warnings
    assert any(w.startswith("strategy changed ddp -> fsdp") and "world size changed too" in w
               for w in p.warnings), p.warnings


def test_strategy_change_under_a_batching_change_follows_the_batching_row():
    p = plan(manifest(strategy="fsdp"), strategy="ddp", batch_size=16)
    assert p.row == "batch_size" and not p.restore_cursor and p.restore_rng  # same ranks: RNG kept
    assert any(w.startswith("strategy changed fsdp -> ddp") and "per-rank micro-batch size changes decides" in w
               for w in p.warnings), p.warnings


def test_manifest_without_strategy_counts_as_ddp():
    old = manifest(strategy=None)
    same = plan(old, strategy="ddp")
    assert same.row == "same" and same.exact and same.topology["saved_strategy"] == "ddp"
    assert same.warnings == [] and "model weights" in same.restored
    changed = plan(old, strategy="fsdp")
    assert changed.row == "strategy" and changed.topology["saved_strategy"] == "ddp"


def test_fsdp_world_size_change_reshards_the_model_too():
    """FSDP on both sides: the shards of the weights move to other ranks as well."""
    p = plan(manifest(ws=2, strategy="fsdp"), ws=1, strategy="fsdp")
    assert p.row == "world_size" and "model weights (resharded through DCP)" in p.restored
    assert not any(w.startswith("strategy changed") for w in p.warnings)
    ddp = plan(manifest(ws=2), ws=1)
    assert "model weights" in ddp.restored  # DDP replicas: nothing to reshard but the optimizer
    assert "optimizer (resharded through DCP)" in ddp.restored


def test_legacy_or_non_strict_with_a_strategy_change_is_not_exact_and_named():
    legacy = plan(manifest(step=45, it=0, has_loader_state=False), strategy="fsdp", legacy=True)
    assert legacy.row == "legacy" and not legacy.exact
    assert any(w.startswith("strategy changed ddp -> fsdp") for w in legacy.warnings)
    loose = plan(manifest(), strategy="fsdp", strict=False)
    assert loose.row == "non_strict" and any(w.startswith("strategy changed") for w in loose.warnings)


def test_plan_rows_name_the_strategy_change():
    rows = plan_rows(plan(manifest(), strategy="fsdp").to_json())
    by = {}
    for label, text, tone in rows:
        by.setdefault(label, []).append((text, tone))
    assert by["policy"] == [(ROWS["strategy"], "info")]
    assert by["discard"] == [("nothing", "ok")]
    assert by["replay boundary"] == [("none (loader cursor restored; not bitwise: the strategy changed) "
                                      "at step 50, epoch 1, iter 5", "ok")]
    assert any(text.startswith("strategy changed ddp -> fsdp") for text, _ in by["warning"])
