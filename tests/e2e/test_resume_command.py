"""``pimm resume RUN_DIR``, the requeue command (``--train.auto-resume``), and one selection
(sha256 included) for ``checkpoints latest``, the path helper, ``--dry-run`` and the real resume.

A resume and a requeue that train run the console script in real processes; the other
commands run in this process (``_helpers.pimm_here``: same code, no subprocess importing torch).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from _helpers import DIGITS, describe, hang_s, pimm, pimm_here, read_json, read_jsonl
from _resume_driver import run_job
from conftest import STOPPED_AT, STOPPED_OVERRIDES

K = 50  # interruption: epoch 1, iter 5 (45 steps per epoch at world size 1)
OV = ["train.epochs=2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory, stopped_run) -> Path:
    """A run (dropout 0.3, see _resume_driver.BASE) stopped mid-epoch at step K: a copy of
    conftest's ``stopped_run`` (data.num_workers=0 there is the default)."""
    assert K == STOPPED_AT and set(OV) <= set(STOPPED_OVERRIDES)
    run = tmp_path_factory.mktemp("resume_cmd") / "digits" / "base"
    shutil.copytree(stopped_run, run)
    return run


@pytest.fixture
def copy(base, tmp_path) -> Path:
    dest = tmp_path / "digits" / "c"
    shutil.copytree(base, dest)
    return dest


def flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------ pimm resume
def test_resume_dry_run_reads_the_run_directory(base):
    r = pimm_here("resume", base, "--dry-run")
    assert r.returncode == 0, describe(r)
    out = r.stdout.splitlines()
    assert out[0] == "launch: world size 1 (--nproc-per-node 1)"
    assert f"checkpoint: {base / 'model' / 'last'} (step 50, epoch 1, iter 5)" in out
    assert "config diff: none" in out  # the run's own config.toml: nothing to retype
    assert any(line.endswith("(exact continuation)") for line in out), out


def test_resume_reuses_the_recorded_rdzv_conf(copy):
    """``pimm launch --rdzv-conf`` is recorded with the launch; ``pimm resume`` starts the ranks with it again
    (a value given replaces it), and a recorded value that is not one (a hand-edited file) is one line."""
    import json

    prov = read_json(copy / "provenance.json")
    conf = "last_call_timeout=10,keep_alive_interval=1"
    prov["starts"][-1]["launch"] = {"launcher": "pimm", "nproc_per_node": 2, "max_restarts": 1, "rdzv_conf": conf}
    (copy / "provenance.json").write_text(json.dumps(prov))
    r = pimm_here("resume", copy, "--dry-run")
    assert r.returncode == 0, describe(r)
    assert r.stdout.splitlines()[0] == f"launch: world size 2 (--nproc-per-node 2 --max-restarts 1 --rdzv-conf {conf})"
    r = pimm_here("resume", copy, "--dry-run", "--rdzv-conf", "join_timeout=60")
    assert r.stdout.splitlines()[0].endswith("--rdzv-conf join_timeout=60)"), describe(r)
    prov["starts"][-1]["launch"]["rdzv_conf"] = "last_call_timeout=soon"
    (copy / "provenance.json").write_text(json.dumps(prov))
    r = pimm_here("resume", copy, "--dry-run")
    assert r.returncode == 2 and r.stderr == ("error: --rdzv-conf: last_call_timeout must be a whole number of "
                                              "seconds >= 1 (got 'soon')\n"), describe(r)
    # resumed as one process (no torchrun): a --rdzv-conf given would be read by nothing
    prov["starts"][-1]["launch"] = {"launcher": "pimm", "nproc_per_node": 1}
    (copy / "provenance.json").write_text(json.dumps(prov))
    r = pimm_here("resume", copy, "--dry-run", "--rdzv-conf", "join_timeout=60")
    assert r.returncode == 2 and r.stderr.startswith("error: --rdzv-conf sets torchrun's rendezvous, and this "
                                                     "launch starts none"), describe(r)


def test_resume_dry_run_shows_overrides_as_deltas(base):
    r = pimm_here("resume", base, "--dry-run", "--", "train.grad_accum=3", "data.batch_size=16")
    assert r.returncode == 0, describe(r)
    out = r.stdout.splitlines()
    assert "policy: per-rank micro-batch size changes: discard loader cursor, restart the saved epoch" in out
    assert "topology: world size 1 -> 1, strategy ddp -> ddp, per-rank workers 0 -> 0, per-rank micro-batch 32 -> 16, " \
           "grad_accum 1 -> 3" in out
    assert "config diff: data.batch_size: 32 -> 16; train.grad_accum: 1 -> 3" in out
    assert any(line.startswith("continue at: step 45, epoch 1, iter 0 (replay boundary") for line in out), out


def test_resume_trains_from_the_run_directory(copy):
    split = len(read_jsonl(copy / "metrics.jsonl"))
    r = pimm("resume", copy, "--", "train.max_steps=52")
    assert r.returncode == 0, describe(r)
    after = [(x["step"], x["iter"]) for x in read_jsonl(copy / "metrics.jsonl")[split:] if x["split"] == "train"]
    assert after == [(51, 6), (52, 7)]  # exact continuation from the saved cursor
    entry = read_json(copy / "provenance.json")["starts"][-1]
    assert entry["kind"] == "resume" and entry["policy"] == "same" and entry["exact"] is True
    assert any("train.max_steps: '<unset>' -> 52" in w for w in entry["warnings"]), entry["warnings"]
    saved = (copy / "config.toml").read_text()
    assert "max_steps = 52" in saved and "dropout = 0.3" in saved  # the run's own config, plus the delta


def test_resume_of_a_non_run_directory_is_one_line(tmp_path):
    r = pimm_here("resume", tmp_path)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and "has no config.toml" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------ requeue
def requeue(root: Path, name: str, *overrides: str, here: bool = True):
    """The command a job script repeats on every (re)start (``here``: in this process)."""
    return (pimm_here if here else pimm)("launch", "--train.config", DIGITS, "--run.root", root, "--run.name", name, "--run.no-timestamp",
                "--train.auto-resume", "--", "train.epochs=1", *overrides)


def test_requeue_starts_fresh_then_resumes_then_does_nothing(tmp_path):
    run = tmp_path / "digits" / "job"
    r = requeue(tmp_path, "job", "train.max_steps=4")
    assert r.returncode == 0, describe(r)
    assert [s["kind"] for s in read_json(run / "provenance.json")["starts"]] == ["start"]
    r = requeue(tmp_path, "job", "train.max_steps=6", here=False)  # the requeued job, through the console script
    assert r.returncode == 0, describe(r)
    entry = read_json(run / "provenance.json")["starts"][-1]
    assert entry["kind"] == "resume" and entry["checkpoint_step"] == 4
    assert read_json(run / "model" / "last" / "manifest.json")["step"] == 6
    metrics = (run / "metrics.jsonl").read_bytes()
    r = requeue(tmp_path, "job", "train.max_steps=6")  # requeued after the end: nothing to do, exit 0
    assert r.returncode == 0, describe(r)
    assert "the run finished at step 6" in r.stdout
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_requeue_moves_leftovers_aside_and_starts_fresh(tmp_path):
    run = tmp_path / "digits" / "job"
    leftover = run / "model" / "last.tmp"
    leftover.mkdir(parents=True)
    (leftover / "weights.pth").write_bytes(b"half a save")
    plain = pimm_here("launch", "--train.config", DIGITS, "--run.root", tmp_path, "--run.name", "job",
                 "--run.no-timestamp", "--", "train.epochs=1", "train.max_steps=3")
    assert plain.returncode == 2 and "--train.auto-resume" in plain.stderr  # a plain launch refuses, and says so
    r = requeue(tmp_path, "job", "train.max_steps=3")
    assert r.returncode == 0, describe(r)
    moved = list((run / "abandoned").iterdir())
    assert len(moved) == 1 and (moved[0] / "last.tmp" / "weights.pth").read_bytes() == b"half a save"
    assert f"to {moved[0]} and starting the run fresh" in r.stdout + r.stderr
    assert read_json(run / "model" / "last" / "manifest.json")["step"] == 3


# ------------------------------------------------------------------ one selection
def _latest(model: Path, *flags: str):
    return (pimm("checkpoints", "latest", model, *flags),
            pimm_path_helper(model, *flags))


def pimm_path_helper(model: Path, *flags: str):
    import subprocess

    from _helpers import REPO, clean_env

    return subprocess.run([sys.executable, "-m", "pimm_core.utils.path", "latest-checkpoint", str(model), *flags],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=hang_s(60))


def test_bit_flipped_last_is_refused_by_every_selection(copy):
    model = copy / "model"
    flip_byte(model / "last" / "weights.pth")
    for r in _latest(model):
        assert r.returncode == 1 and r.stdout == "", describe(r)
    for r in _latest(model, "--explain"):
        assert "last: rejected: failed verification (weights.pth: sha256 mismatch)" in r.stderr, describe(r)
    for r in _latest(model, "--no-verify"):  # the explicit opt-out sees only completeness
        assert r.returncode == 0 and r.stdout == f"{model / 'last'}\n", describe(r)
    dry = pimm_here("resume", copy, "--dry-run")
    real = pimm_here("resume", copy)
    for r in (dry, real):
        assert r.returncode == 1, describe(r)  # complete but damaged: an operation failed (exit 1)
        assert "failed verification (weights.pth: sha256 mismatch)" in r.stderr and "Traceback" not in r.stderr
    assert "exact continuation" not in dry.stdout


def test_fallback_names_the_candidate_actually_used(tmp_path):
    run = tmp_path / "digits" / "single"
    run_job(run, ["train.epochs=2", "checkpoint_format=single", "checkpoint.every_steps=10"], stop_at=35)
    model = run / "model"
    assert sorted(p.name for p in model.glob("step_*.pth")) == ["step_20.pth", "step_30.pth", "step_35.pth"]
    flip_byte(model / "step_35.pth")
    for r in _latest(model):
        assert r.returncode == 0 and r.stdout == f"{model / 'step_30.pth'}\n", describe(r)
    dry = pimm_here("resume", run, "--dry-run")
    assert dry.returncode == 0, describe(dry)
    assert f"checkpoint: {model / 'step_30.pth'} (step 30, epoch 0, iter 30)" in dry.stdout
    warning = f"failed verification (step_35.pth: sha256 mismatch); using {model / 'step_30.pth'} (step 30) instead"
    assert warning in dry.stdout
    run_job(run, ["train.epochs=2", "checkpoint_format=single", "checkpoint.every_steps=10"], resume_from=model,
            stop_at=31)
    entry = [s for s in read_json(run / "provenance.json")["starts"] if s["kind"] == "resume"][-1]
    assert entry["checkpoint"] == str(model / "step_30.pth") and entry["checkpoint_step"] == 30
    assert any(warning in w for w in entry["warnings"]), entry["warnings"]


def test_requeue_refuses_a_complete_but_corrupt_checkpoint(copy):
    """A bit-flipped `last` is not a leftover: auto-resume must not abandon the run's progress with it."""
    flip_byte(copy / "model" / "last" / "weights.pth")
    metrics = (copy / "metrics.jsonl").read_bytes()
    r = requeue(copy.parents[1], copy.name)
    assert r.returncode == 1, describe(r)
    assert "no intact checkpoint" in r.stderr and "failed verification" in r.stderr, describe(r)
    assert not (copy / "abandoned").exists() and (copy / "model" / "last").is_dir()
    assert (copy / "metrics.jsonl").read_bytes() == metrics


def test_requeue_abandon_moves_the_attempts_log_with_its_leftovers(tmp_path):
    run = tmp_path / "digits" / "job"
    (run / "model" / "last.tmp").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 2.3}\n')
    r = requeue(tmp_path, "job", "train.max_steps=2")
    assert r.returncode == 0, describe(r)
    moved = next((run / "abandoned").iterdir())
    assert (moved / "metrics.jsonl").read_text().startswith('{"step": 1,') and (moved / "last.tmp").is_dir()
    kinds = [s["kind"] for s in read_json(run / "provenance.json")["starts"]]
    assert kinds == ["abandoned", "start"]


@pytest.mark.parametrize("override", ['run.root="/elsewhere"', 'run.name="zz"', 'train.weight="/x.pth"'])
def test_resume_refuses_to_move_or_rewire_the_run(base, override):
    r = pimm_here("resume", base, "--dry-run", "--", override)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot change on pimm resume" in r.stderr, describe(r)


def test_checkpoints_diff_plans_the_recorded_launch(copy):
    """`pimm checkpoints diff RUN` compares with what `pimm resume RUN` would start: the recorded world size."""
    import json

    prov = read_json(copy / "provenance.json")
    prov["starts"][-1]["launch"] = {"launcher": "pimm", "nproc_per_node": 2}
    (copy / "provenance.json").write_text(json.dumps(prov))
    diff = pimm("checkpoints", "diff", copy, "--json")
    assert diff.returncode == 0, describe(diff)
    assert json.loads(diff.stdout)["planned"]["world_size"] == 2
    dry = pimm_here("resume", copy, "--dry-run")
    assert "topology: world size 1 -> 2," in dry.stdout, describe(dry)
