"""The seed's failure modes, each with its message (a resume never silently trains from scratch), and the
warnings a resume writes to ``train.log`` (the recovery checklist, automated)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from _helpers import DIGITS, describe, pimm, pimm_here, read_json, read_jsonl, snapshot
from _resume_driver import BASE, run_job
from conftest import STOPPED_AT, STOPPED_OVERRIDES
from pimm_core.checkpoint.select.resume_path import resolve_resume_path
from pimm_core.errors import CheckpointError

K = 50  # interruption: epoch 1, iter 5 (45 steps per epoch)
OV = ["train.epochs=2", "data.num_workers=0"]
CLI_OV = [*BASE, *OV]  # the same config through `pimm launch ... -- overrides`


@pytest.fixture(scope="module")
def root(tmp_path_factory, stopped_run) -> Path:
    """``<root>/digits/base``: a run interrupted mid-epoch, laid out as ``pimm launch --run.root <root>`` does;
    a copy of conftest's ``stopped_run`` (BASE + OV, stopped at K)."""
    assert (tuple(OV), K) == (STOPPED_OVERRIDES, STOPPED_AT)
    root = tmp_path_factory.mktemp("failures")
    shutil.copytree(stopped_run, root / "digits" / "base")
    return root


@pytest.fixture
def run(root, tmp_path) -> Path:
    """A private copy of the base run (tests damage it), as ``<tmp>/digits/r``."""
    dest = tmp_path / "digits" / "r"
    shutil.copytree(root / "digits" / "base", dest)
    return dest


def resume_cli(root: Path, name: str, *flags: str, overrides: list[str] = CLI_OV, here: bool = True):
    """``pimm launch --train.config configs/digits.toml --run.root ROOT --run.name NAME --run.no-timestamp FLAGS -- OV``,
    in this process (``_helpers.pimm_here``) unless ``here`` is false."""
    return (pimm_here if here else pimm)("launch", "--train.config", str(DIGITS), "--run.root", str(root),
                                         "--run.name", name, "--run.no-timestamp", *flags, "--", *overrides)


RUN_FILES = ("config.toml", "metrics.jsonl", "provenance.json", "status.json", "train.log")


def _unchanged(before: dict, after: dict) -> dict:
    """The entries of a snapshot a failed resume must leave alone: model/ and the run's own files."""
    keep = lambda d: {k: v for k, v in d.items() if k.startswith("model/") or k in RUN_FILES}  # noqa: E731
    assert keep(after) == keep(before)
    return keep(after)


def _no_marker_advice(msg: str) -> None:
    low = msg.lower()
    assert "touch" not in low and "add the marker" not in low and "add a marker" not in low
    assert "create .complete" not in low and "add .complete" not in low


# ------------------------------------------------------------------ "No weight found"
def test_missing_resume_path_fails_and_never_trains_from_scratch(tmp_path):
    run = tmp_path / "fresh"
    missing = tmp_path / "nowhere" / "model" / "last"
    with pytest.raises(CheckpointError) as e:
        run_job(run, OV, resume_from=missing)
    msg = str(e.value)
    assert msg.startswith("No weight found") and str(missing) in msg
    assert not (run / "metrics.jsonl").exists() and not (run / "provenance.json").exists()
    assert not (run / "model" / "last").exists()


def test_missing_path_cli_one_line(root):
    r = resume_cli(root, "base", "--train.resume-from", "/definitely/not/here", "--dry-run")
    assert r.returncode == 2, describe(r)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: No weight found") and "/definitely/not/here" in lines[0]


# ------------------------------------------------------------------ "Incomplete checkpoint directory"
@pytest.mark.parametrize("part", [".complete", "weights.pth", "trainer.dcp/.metadata", "trainer.dcp/.complete"])
def test_incomplete_checkpoint_directory_names_missing_part_and_candidates(run, part):
    model = run / "model"
    shutil.copytree(model / "last", model / "last.prev")  # a complete backup beside the damaged one
    (model / "last" / part).unlink()
    with pytest.raises(CheckpointError) as e:
        resolve_resume_path(model / "last")
    msg = str(e.value)
    assert msg.startswith(f"Incomplete checkpoint directory {model / 'last'}"), msg
    assert f"missing {part}" in msg
    assert f"Complete candidates: {model / 'last.prev'}" in msg
    _no_marker_advice(msg)


def test_incomplete_checkpoint_through_trainer_lists_no_candidates(run):
    before = snapshot(run)
    (run / "model" / "last" / ".complete").unlink()
    with pytest.raises(CheckpointError) as e:
        run_job(run, OV, resume_from=run / "model" / "last")
    msg = str(e.value)
    assert "Incomplete checkpoint directory" in msg and "missing .complete" in msg
    assert "Complete candidates: none" in msg
    _no_marker_advice(msg)
    after = snapshot(run)
    assert {k: v for k, v in after.items() if k != "model/last/.complete"} == \
           {k: v for k, v in before.items() if k != "model/last/.complete"}  # nothing trained or written


# ------------------------------------------------------------------ hf://
def test_resume_from_hub_is_rejected(tmp_path):
    with pytest.raises(CheckpointError) as e:
        run_job(tmp_path / "hub", OV, resume_from="hf://org/repo")
    msg = str(e.value)
    assert "hf://org/repo" in msg and "trainer state" in msg and "warm-start" in msg
    assert not (tmp_path / "hub" / "metrics.jsonl").exists()


# ------------------------------------------------------------------ --train.resume with nothing to resume
def test_resume_without_complete_candidate_lists_what_was_found(run):
    model = run / "model"
    (model / "last" / ".complete").unlink()
    (model / "last.tmp").mkdir()
    assert (model / "model_best.pth").is_file()  # weights only: not resumable
    before = snapshot(run)
    r = resume_cli(run.parents[1], "r", "--train.resume")
    assert r.returncode == 2, describe(r)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, describe(r)
    line = lines[0]
    assert line.startswith(f"error: cannot resume {run}: no complete checkpoint; found:")
    assert "last: rejected: missing .complete" in line
    assert "last.tmp: rejected: temporary leftover" in line
    assert "model_best.pth: rejected: weights only" in line
    assert "Traceback" not in r.stdout + r.stderr
    _unchanged(before, snapshot(run))


# ------------------------------------------------------------------ different config / shape mismatch
def test_changed_config_warns_with_diff_in_provenance(run):
    split = len(read_jsonl(run / "metrics.jsonl"))
    run_job(run, [*OV, "train.lr=0.003"], resume_from=run / "model" / "last", stop_at=K + 1)
    entry = [s for s in read_json(run / "provenance.json")["starts"] if s["kind"] == "resume"][-1]
    diff = [w for w in entry["warnings"] if w.startswith("config differs from the interrupted run")]
    assert len(diff) == 1 and "train.lr: 0.002 -> 0.003" in diff[0]
    # the reported change takes effect, and says so; the restored schedule itself matched the log
    assert entry["schedule"] == ["train.lr changed 0.002 -> 0.003 on resume: applied from step 50"]
    assert not any(w.startswith("LR schedule differs from the interrupted run") for w in entry["warnings"])
    log = (run / "train.log").read_text()
    assert "config differs from the interrupted run" in log and "train.lr: 0.002 -> 0.003" in log
    assert "train.lr changed 0.002 -> 0.003 on resume: applied from step 50" in log
    # a warning, not a refusal: training went on from the saved iteration
    assert [(r["step"], r["iter"]) for r in read_jsonl(run / "metrics.jsonl")[split:] if r["split"] == "train"] == \
           [(K + 1, 6)]


def test_unchanged_config_resumes_without_warnings_and_logs_resume_check(run):
    """The recovery checklist, automated: the resumed run's log compares step and LR with the log before."""
    run_job(run, OV, resume_from=run / "model" / "last", stop_at=K + 1)
    entry = [s for s in read_json(run / "provenance.json")["starts"] if s["kind"] == "resume"][-1]
    assert not [w for w in entry["warnings"] if "LR schedule" in w or "config differs" in w or "cursor" in w]
    log = (run / "train.log").read_text()
    assert "resume check: restored step 50" in log and "log before interruption: step 50" in log
    assert "LR schedule differs" not in log


def test_shape_mismatch_refuses_naming_tensors_and_changes_nothing(run):
    before = snapshot(run)
    r = resume_cli(run.parents[1], "r", "--train.resume", overrides=[*CLI_OV, "model.hidden=64"], here=False)
    assert r.returncode != 0, describe(r)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), describe(r)
    assert "does not match the model" in lines[0] and "shape mismatch" in lines[0]
    assert "net.0.weight (128, 64) vs model (64, 64)" in lines[0]
    assert "Traceback" not in r.stdout + r.stderr
    kept = _unchanged(before, snapshot(run))  # nothing trained, saved, logged or rewritten
    assert "model/last/weights.pth" in kept


# ------------------------------------------------------------------ Python API
def test_sequential_trainers_do_not_share_train_log(tmp_path):
    """Python API: a second Trainer in the same process must not write into the first run's train.log."""
    from pimm_core import Trainer, load_config

    logger = logging.getLogger("pimm")
    before = list(logger.handlers)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        cfg = load_config(Path(__file__).parents[2] / "configs" / "digits.toml",
                          ["train.epochs=1", "train.max_steps=2", "eval.every_epochs=0"])
        for name in ("a", "b"):
            Trainer(cfg, run_dir=tmp_path / name).train(checkpoint_dir=tmp_path / name / "model")
        assert str(tmp_path / "b") not in (tmp_path / "a" / "train.log").read_text()
        assert [h for h in logger.handlers if h not in before] == []  # nothing left open
    finally:
        for h in [h for h in logger.handlers if h not in before]:
            logger.removeHandler(h)
            h.close()
        logger.setLevel(level)
