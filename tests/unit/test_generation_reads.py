"""One checkpoint generation per read, decided in-process: a rotation is made to land exactly
inside a read (by wrapping pimm's own read step), as a live save does at random in
``tests/e2e/test_live_readers.py``."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import torch

from pimm_core.checkpoint.select import selection
from pimm_core.checkpoint.weights import read as weights
from pimm_core.checkpoint.export.model_dir import export
from pimm_core.checkpoint.records.manifest import describe_files
from pimm_core.cli import main


def _generation(path: Path, step: int) -> Path:
    """A complete standard checkpoint whose one tensor holds ``step`` (real weights.pth, manifest with sha256)."""
    (path / "trainer.dcp").mkdir(parents=True)
    torch.save({"state_dict": {"w": torch.full((4,), float(step))}}, path / "weights.pth")
    (path / "trainer.dcp" / ".metadata").write_bytes(f"meta {step}".encode())
    (path / "trainer.dcp" / ".complete").write_bytes(b"")
    (path / "manifest.json").write_text(json.dumps({"manifest_version": 1, "format": "standard", "kind": "last",
                                                    "step": step, "epoch": 0, "iter": step,
                                                    "files": describe_files(path)}))
    (path / ".complete").write_bytes(b"")
    return path


def _rotate(model: Path, step: int) -> None:
    """What a save does: a new generation as last.tmp, last -> last.prev, last.tmp -> last, last.prev removed."""
    import shutil

    _generation(model / "last.tmp", step)
    os.rename(model / "last", model / "last.prev")
    os.rename(model / "last.tmp", model / "last")
    shutil.rmtree(model / "last.prev")


def _once(fn):
    done = []

    def run() -> None:
        if not done:
            done.append(1)
            fn()
    return run


def test_export_overtaken_by_a_save_has_the_metadata_of_its_tensors(tmp_path: Path, monkeypatch) -> None:
    model = tmp_path / "run" / "model"
    _generation(model / "last", 10)
    real = weights._read
    rotate = _once(lambda: _rotate(model, 11))

    def read_then_save(path: Path):
        out = real(path)
        rotate()  # the save lands after the tensors were read, before the manifest is
        return out

    monkeypatch.setattr(weights, "_read", read_then_save)
    out = export(model / "last", tmp_path / "out")
    rec = json.loads((out / "export.json").read_text())
    from safetensors.torch import load_file

    assert rec["step"] == 11 and load_file(out / "model.safetensors")["w"].tolist() == [11.0] * 4


def test_a_read_that_every_save_overtakes_ends_in_one_line(tmp_path: Path) -> None:
    from pimm_core.checkpoint.records import generation

    model = tmp_path / "model"
    _generation(model / "last", 1)
    steps = iter(range(2, 100))
    with pytest.raises(generation.GenerationChanged) as e:
        generation.read_whole(lambda: model / "last" / "weights.pth", lambda p: _rotate(model, next(steps)),
                              what="model/last")
    assert str(e.value) == "model/last changed while reading (a save replaced it; retried 5 times); try again"
    assert e.value.exit_code == 75  # (CHANGED_EXIT_CODE: a script retries on it)


def test_verify_of_last_rotated_while_hashing_is_ok(tmp_path: Path, monkeypatch) -> None:
    from pimm_core.checkpoint.records import manifest

    model = tmp_path / "model"
    _generation(model / "last", 10)
    real = manifest.verify_files
    rotate = _once(lambda: _rotate(model, 11))

    def rotating(root, files):  # the save lands as `pimm checkpoints verify` starts hashing the old `last`
        rotate()
        return real(root, files)

    monkeypatch.setattr(manifest, "verify_files", rotating)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["checkpoints", "verify", str(model / "last")])
    assert (code, out.getvalue()) == (0, "last: ok\n")


def test_a_damaged_file_is_still_reported(tmp_path: Path) -> None:
    model = tmp_path / "model"
    _generation(model / "last", 10)
    with open(model / "last" / "weights.pth", "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["checkpoints", "verify", str(model / "last")])
    assert code == 1 and out.getvalue() == "last: FAILED: weights.pth: sha256 mismatch\n"


def test_verify_waits_for_the_sidecar_a_save_is_writing(tmp_path: Path, monkeypatch) -> None:
    """model_best.pth is replaced before its sidecar manifest: verify in between is not "cannot verify"."""
    from pimm_core.checkpoint.records import generation
    from pimm_core.checkpoint.records.manifest import sha256_file

    model = tmp_path / "model"
    _generation(model / "last", 10)
    best = model / "model_best.pth"
    torch.save({"state_dict": {"w": torch.ones(4)}}, best)  # just replaced; its sidecar not yet written
    real = generation.identity
    land = _once(lambda: (model / "model_best.pth.json").write_text(json.dumps(
        {"manifest_version": 1, "format": "weights", "kind": "best", "step": 10, "epoch": 1, "iter": 0,
         "files": {"model_best.pth": {"size": best.stat().st_size, "sha256": sha256_file(best)}}})))

    def writer_lands_the_sidecar(path):
        out = real(path)
        if Path(path) == best:
            land()
        return out

    monkeypatch.setattr(generation, "identity", writer_lands_the_sidecar)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["checkpoints", "verify", str(best)])
    assert (code, out.getvalue()) == (0, "model_best.pth: ok\n")
