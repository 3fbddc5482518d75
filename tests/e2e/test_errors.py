"""Errors cross process boundaries as typed objects, not strings to parse."""

from __future__ import annotations

import json
import pickle

import pytest

from pimm_core.errors import CheckpointError, CheckpointSaveError, ConfigError, PimmError, rank_errors, report


@pytest.mark.parametrize("error", [CheckpointError("no intact checkpoint", exit_code=1),
                                   CheckpointError("hostile file", exit_code=2), CheckpointSaveError("disk full"),
                                   ConfigError("bad key"), PimmError("x", exit_code=3)])
def test_errors_pickle_with_their_class_and_exit_code(error: PimmError) -> None:
    back = pickle.loads(pickle.dumps(error))  # what dist.broadcast_object does
    assert type(back) is type(error) and str(back) == str(error) and back.exit_code == error.exit_code


def test_a_rank_hands_its_error_to_the_launcher_through_a_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PIMM_RANK_ERRORS", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    report(CheckpointError("checkpoint save failed: disk full"), secondary=True)
    assert [p.name for p in tmp_path.iterdir()] == ["rank3.json"]
    assert json.loads((tmp_path / "rank3.json").read_text()) == {
        "code": 1, "message": "checkpoint save failed: disk full", "secondary": True}
    assert rank_errors(str(tmp_path)) == {3: {"code": 1, "message": "checkpoint save failed: disk full",
                                               "secondary": True}}
