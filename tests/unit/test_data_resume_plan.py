"""The resume policy when the training data changed between save and resume: ``plan_resume`` alone.

A loader cursor is applied only to the data it was saved for (the recorded ``data_length`` and,
when the dataset gives one, ``data_fingerprint``); otherwise the ``data`` row restarts the saved
epoch over the new data. What is unknown on either side (an older checkpoint) is not compared.
"""

from __future__ import annotations

from pimm_core.run.topology import ROWS, plan_resume


def manifest(it=6, **extra) -> dict:
    return {"step": 6, "epoch": 0, "iter": it, "world_size": 1, "workers_per_rank": 0, "has_loader_state": True,
            "batch_size": 10, "grad_accum": 1, "epoch_start_step": 0, "strategy": "ddp", **extra}


def plan(m: dict, **kw):
    return plan_resume(m, world_size=1, strategy="ddp", workers_per_rank=0, strict=True, grad_accum=1,
                       batch_size=10, **kw)


def test_fingerprint_change_at_the_same_length_restarts_the_epoch():
    p = plan(manifest(data_length=100, data_fingerprint="aaa"), data_length=100, data_fingerprint="bbb")
    assert p.row == "data" and p.description == ROWS["data"]
    assert not p.restore_cursor and p.restore_rng and not p.exact
    assert (p.step, p.epoch, p.iter, p.replay_boundary) == (0, 0, 0, {"epoch": 0, "step": 0, "from_iter": 6})
    assert "loader cursor" in p.discarded
    assert any("data fingerprint aaa -> bbb" in w for w in p.warnings)


def test_same_data_keeps_the_cursor():
    p = plan(manifest(data_length=100, data_fingerprint="aaa"), data_length=100, data_fingerprint="aaa")
    assert (p.row, p.restore_cursor, p.exact, p.iter) == ("same", True, True, 6)


def test_older_checkpoint_without_a_recorded_length_resumes_as_before():
    p = plan(manifest(), data_length=40, data_fingerprint="bbb")
    assert (p.row, p.restore_cursor, p.exact, p.step, p.iter) == ("same", True, True, 6, 6)


def test_epoch_end_checkpoint_has_nothing_to_replay_but_names_the_change():
    p = plan(manifest(it=0, epoch=1, data_length=100), data_length=200)
    assert (p.row, p.replay_boundary, p.restore_rng, p.exact) == ("data", None, True, False)
    assert (p.step, p.epoch, p.iter) == (6, 1, 0)
    assert any("train samples 100 -> 200" in w for w in p.warnings)


def test_an_earlier_row_wins_and_the_data_change_is_still_named():
    p = plan_resume(manifest(data_length=100), world_size=2, strategy="ddp", workers_per_rank=0, strict=True,
                    grad_accum=1, batch_size=10, data_length=40)
    assert p.row == "world_size"
    assert any("train samples 100 -> 40" in w for w in p.warnings)


def test_a_checkpoint_saved_without_its_cursor_names_why():
    m = manifest(data_length=100, has_loader_state=False, loader_state_problem="it holds userpkg.Phase, ...")
    p = plan(m, data_length=100)
    assert p.row == "no_loader_state" and p.replay_boundary == {"epoch": 0, "step": 0, "from_iter": 6}
    assert any("saved without its loader cursor" in w and "userpkg.Phase" in w for w in p.warnings)


def test_load_problem_names_the_class_and_the_fix():
    import enum

    import torch

    from pimm_core.checkpoint.tensors.state import load_problem

    Colour = enum.Enum("Colour", "RED")
    Colour.__module__ = __name__
    globals()["Colour"] = Colour  # picklable by reference
    assert load_problem({"pos": 3, "order": torch.arange(4), "name": "a"}) is None
    problem = load_problem({"pos": 3, "colour": Colour.RED})
    assert f"{__name__}.Colour" in problem and "torch.serialization.add_safe_globals([Colour])" in problem
    with torch.serialization.safe_globals([Colour]):  # what add_safe_globals does, for this block only
        assert load_problem({"colour": Colour.RED}) is None
    assert "cannot be serialised" in load_problem({"f": lambda: 0})
