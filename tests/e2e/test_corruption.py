"""Corrupt checkpoints and hostile files: detected, never loaded, never executed.

Truncated or bit-flipped ``weights.pth``, DCP shard, DCP ``.metadata`` and single-format
file: ``pimm checkpoints verify`` exits 1 naming the file (checked against the manifest);
``--train.resume`` falls back to the next complete candidate with a loud warning and a
provenance entry, or fails with one ``error:`` line (exit 1) when nothing intact is left.
A ``.pth`` that is not a pimm checkpoint and a pickle that would run code are refused as
``--train.resume-from`` or ``--train.weight`` with one line; nothing trains, nothing runs.

The launches run in this process (``_helpers.pimm_here``: same code, no subprocess importing
torch) except one fallback and the kills at fail points, and so do ``pimm checkpoints verify``
and ``latest`` (``test_checkpoints_cli.py`` runs them as processes); ``test_hostile_files.py``
refuses hostile files in real processes.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest

from _helpers import DIGITS, REPO, clean_env, describe, hang_s, launch, pimm, pimm_here, read_json
from conftest import SINGLE_OVERRIDES

SINGLE_RUN = ("train.epochs=2", 'checkpoint_format="single"', "data.batch_size=128")


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {"truncated": truncate, "bit-flipped": flip}


def pimm_env(env: dict[str, str], *args):
    """``pimm ARGS`` with extra environment variables (e.g. a fail point)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pimm_core.cli", *map(str, args)], cwd=REPO,
                          env={**clean_env(), **env}, capture_output=True, text=True, timeout=hang_s(240))


def resume(root: Path, name: str, *overrides: str, extra: tuple[str, ...] = ("--train.resume",), here: bool = False):
    """``pimm launch ... --train.resume``; ``here``: in this process (see ``_helpers.pimm_here``)."""
    return (pimm_here if here else pimm)("launch", "--train.config", DIGITS, "--run.root", root, "--run.name", name,
                                         "--run.no-timestamp", *extra, "--", *overrides, timeout=240)


def one_error_line(result) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, describe(result)
    return errors[0]


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    """A private copy of the session's standard run (3 epochs, last at step 135)."""
    return trained_run.copy_to(tmp_path)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("single-format")
    result = launch(root, "s", *SINGLE_RUN, here=True)
    assert result.returncode == 0, describe(result)
    return root / "digits" / "s"


# ----------------------------------------------------------------- standard format
@pytest.mark.parametrize("how", list(DAMAGE))
@pytest.mark.parametrize("rel", ["weights.pth", "trainer.dcp/__0_0.distcp", "trainer.dcp/.metadata"])
def test_verify_names_the_damaged_file(run_copy, rel, how):
    DAMAGE[how](run_copy / "model" / "last" / rel)
    result = pimm_here("checkpoints", "verify", run_copy)
    assert result.returncode == 1, describe(result)
    failed = [line for line in result.stdout.splitlines() if line.startswith("last: FAILED: ")]
    want = "size" if how == "truncated" else "sha256 mismatch"
    assert len(failed) == 1 and f"{rel}: " in failed[0] and want in failed[0], describe(result)
    assert "model_best.pth: ok" in result.stdout.splitlines()


# The first case through the console script in a real process; the others in this process
# (the same code path, without a subprocess importing torch).
@pytest.mark.parametrize("rel, how, here", [("weights.pth", "truncated", False),
                                            ("trainer.dcp/__0_0.distcp", "bit-flipped", True),
                                            ("trainer.dcp/.metadata", "bit-flipped", True)])
def test_resume_falls_back_to_an_intact_candidate(run_copy, rel, how, here):
    model = run_copy / "model"
    shutil.copytree(model / "last", model / "last.prev")  # a complete earlier candidate
    DAMAGE[how](model / "last" / rel)
    # one step more than the run had (step 135): the finished run has something to train (a finished
    # one is a no-op), and the save at its end rotates `last`
    result = resume(run_copy.parents[1], run_copy.name, *SINGLE_OVERRIDES, "train.epochs=4", "train.max_steps=136",
                    here=here)
    assert result.returncode == 0, describe(result)
    loud = [line for line in result.stdout.splitlines() if "ERROR: checkpoint" in line and "failed verification" in line]
    assert loud and str(model / "last") in loud[0] and rel in loud[0], describe(result)
    assert "ERROR: checkpoint" in (run_copy / "train.log").read_text()
    entry = read_json(run_copy / "provenance.json")["starts"][-1]
    assert entry["kind"] == "resume" and entry["checkpoint"] == str(model / "last.prev"), entry
    assert any("failed verification" in w and rel in w for w in entry["warnings"]), entry["warnings"]
    # the run saved again: what is under final names now verifies
    result = pimm_here("checkpoints", "verify", run_copy)
    assert result.returncode == 0, describe(result)
    # the corrupt last was set aside (not deleted), so the rotation never removed the intact last.prev
    corrupt = list(model.glob("last.corrupt-*"))
    assert len(corrupt) == 1 and (corrupt[0] / rel).is_file(), sorted(p.name for p in model.iterdir())


def test_kill_in_the_first_save_after_a_fallback_leaves_a_resumable_checkpoint(run_copy):
    """Seen: the first save after resuming from last.prev (last bit-flipped) removed last.prev to rotate
    the corrupt last into its place; a kill there left nothing to resume from."""
    model = run_copy / "model"
    shutil.copytree(model / "last", model / "last.prev")
    flip(model / "last" / "weights.pth")
    for spec in ("rotate.old_prev_removed=kill", "rotate.renamed_to_prev=kill", "rotate.renamed_into_place=kill"):
        env_run = pimm_env({"PIMM_FAILPOINT": spec}, "launch", "--train.config", DIGITS, "--run.root",
                           run_copy.parents[1], "--run.name", run_copy.name, "--run.no-timestamp", "--train.resume",
                           "--", *SINGLE_OVERRIDES, "train.epochs=4")
        latest = pimm_here("checkpoints", "latest", model)
        assert latest.returncode == 0, (spec, describe(env_run), describe(latest))


def test_resume_with_nothing_intact_fails_with_one_line(run_copy):
    weights = run_copy / "model" / "last" / "weights.pth"
    flip(weights)
    before = (weights.read_bytes(), (run_copy / "metrics.jsonl").read_bytes())
    result = resume(run_copy.parents[1], run_copy.name, *SINGLE_OVERRIDES, here=True)
    assert result.returncode == 1, describe(result)
    line = one_error_line(result)
    assert "no intact checkpoint" in line and "weights.pth: sha256 mismatch" in line, line
    assert (weights.read_bytes(), (run_copy / "metrics.jsonl").read_bytes()) == before  # nothing trained or written


# ------------------------------------------------------------------- single format
@pytest.mark.parametrize("how", list(DAMAGE))
def test_single_file_corruption_verify_and_fallback(single_run, tmp_path, how):
    run = tmp_path / "digits" / "s"
    shutil.copytree(single_run, run, symlinks=True)
    model = run / "model"
    newest = model / os.readlink(model / "last")
    assert newest.name == "step_24.pth" and (model / "step_12.pth").is_file()
    DAMAGE[how](newest)
    result = pimm_here("checkpoints", "verify", run)
    assert result.returncode == 1, describe(result)
    assert any(line.startswith("step_24.pth: FAILED: step_24.pth: ") for line in result.stdout.splitlines()), \
        describe(result)
    assert "step_12.pth: ok" in result.stdout.splitlines(), describe(result)
    result = resume(tmp_path, "s", *SINGLE_RUN, here=True)
    assert result.returncode == 0, describe(result)
    assert any("ERROR: checkpoint" in line and "step_24.pth" in line for line in result.stdout.splitlines()), \
        describe(result)
    entry = read_json(run / "provenance.json")["starts"][-1]
    assert entry["checkpoint"] == str(model / "step_12.pth") and entry["checkpoint_step"] == 12, entry
    assert any("failed verification" in w for w in entry["warnings"]), entry["warnings"]


def test_single_with_every_file_damaged_fails_with_one_line(single_run, tmp_path):
    run = tmp_path / "digits" / "s"
    shutil.copytree(single_run, run, symlinks=True)
    for p in (run / "model").glob("step_*.pth"):
        truncate(p)
    result = resume(tmp_path, "s", *SINGLE_RUN, here=True)
    assert result.returncode == 1, describe(result)
    line = one_error_line(result)
    assert "no intact checkpoint" in line and "step_24.pth" in line and "step_12.pth" in line, line


# ----------------------------------------------------------------- hostile inputs
class Evil:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile(kind: str, path: Path, marker: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "list":
        torch.save([1, 2, 3], path)  # loads fine with weights_only, but is not a pimm checkpoint
    elif kind == "evil-torch":
        torch.save({"format": "single", "weights": {"raw": Evil(marker)}}, path)
    else:  # a raw pickle
        with open(path, "wb") as f:
            pickle.dump(Evil(marker), f)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("kind", ["list", "evil-torch", "evil-pickle"])
@pytest.mark.parametrize("flag", ["--train.resume-from", "--train.weight"])
def test_hostile_file_is_refused_and_nothing_runs(tmp_path, flag, kind):
    marker = tmp_path / "pwned"
    # named like a single-format checkpoint so a resume gets as far as loading it
    path = tmp_path / "elsewhere" / ("step_7.pth" if flag == "--train.resume-from" else "weights.pth")
    _hostile(kind, path, marker)
    result = resume(tmp_path / "exp", "h", "train.epochs=1", extra=(flag, str(path)), here=True)
    assert result.returncode in (1, 2), describe(result)
    line = one_error_line(result)
    assert str(path) in line, line
    if kind != "list":
        assert "weights_only" in line or "UnpicklingError" in line, line
    else:
        assert "not a pimm" in line or "state dict" in line, line
    assert not marker.exists()
    run = tmp_path / "exp" / "digits" / "h"
    assert not (run / "metrics.jsonl").exists() and not list((run / "model").glob("*") if (run / "model").is_dir()
                                                             else [])
