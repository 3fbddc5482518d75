"""Selection while a save rotates ``last``: a listing taken before the rotation must not end in "nothing"."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pimm_core.checkpoint.select import selection


def _complete(path: Path, step: int) -> Path:
    """A complete standard checkpoint directory (opaque bytes; the manifest records sizes and sha256)."""
    (path / "trainer.dcp").mkdir(parents=True)
    payload = f"weights {step}".encode()
    (path / "weights.pth").write_bytes(payload)
    (path / "trainer.dcp" / "__0_0.distcp").write_bytes(payload[::-1])
    (path / "trainer.dcp" / ".metadata").write_bytes(b"meta")
    (path / "trainer.dcp" / ".complete").write_bytes(b"")
    files = {rel: {"size": (path / rel).stat().st_size, "sha256": hashlib.sha256((path / rel).read_bytes()).hexdigest()}
             for rel in ("trainer.dcp/.complete", "trainer.dcp/.metadata", "trainer.dcp/__0_0.distcp", "weights.pth")}
    (path / "manifest.json").write_text(json.dumps({"manifest_version": 1, "format": "standard", "kind": "last",
                                                    "step": step, "epoch": 0, "iter": step, "world_size": 1,
                                                    "workers_per_rank": 0, "files": files}))
    (path / ".complete").write_bytes(b"")
    return path


def test_a_rotation_between_listing_and_reading_selects_the_rotated_checkpoint(tmp_path: Path, monkeypatch) -> None:
    model = tmp_path / "model"
    _complete(model / "last", 10)
    real_list = selection.list_candidates
    calls = []

    def list_then_rotate(model_dir: Path):
        cands = real_list(model_dir)
        if not calls:  # the save rotates right after this listing: last -> last.prev, a new last not yet there
            os.rename(model / "last", model / "last.prev")
        calls.append(len(cands))
        return cands

    monkeypatch.setattr(selection, "list_candidates", list_then_rotate)
    chosen, _ = selection.select_resume(model)
    assert chosen is not None and chosen.name == "last.prev" and chosen.step == 10
    assert len(calls) == 2  # listed again once the listed `last` had vanished


def test_nothing_to_select_is_answered_after_one_listing(tmp_path: Path, monkeypatch) -> None:
    model = tmp_path / "model"
    (model / "last").mkdir(parents=True)  # incomplete, and it stays there: no reason to list again
    calls = []
    real_list = selection.list_candidates
    monkeypatch.setattr(selection, "list_candidates", lambda d: calls.append(1) or real_list(d))
    chosen, cands = selection.select_resume(model)
    assert chosen is None and [c.name for c in cands] == ["last"] and len(calls) == 1
