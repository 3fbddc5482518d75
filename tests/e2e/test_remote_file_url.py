"""``checkpoint.remote`` as a ``file://`` URL (a shared file system mounted on every node): the
mirror creates the directories it writes into. It used to fail every upload with "No such file
or directory" (fsspec's local filesystem makes parents only when asked), retry, and hold the
run's end for ``checkpoint.remote_timeout`` (10 minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import shutil

from _helpers import describe, launch, pimm, pimm_here


def test_a_file_url_remote_receives_each_checkpoint_complete(tmp_path: Path) -> None:
    remote = tmp_path / "shared" / "ckpt"  # does not exist yet
    r = launch(tmp_path / "exp", "f", "train.epochs=1", f"checkpoint.remote=file://{remote}",
               "checkpoint.remote_timeout=60", here=True)
    assert r.returncode == 0, describe(r)
    assert "upload" not in r.stderr or "failed" not in r.stderr, describe(r)
    model = remote / "digits" / "f" / "model"
    assert (model / "step_45" / "trainer.dcp" / ".complete").is_file(), sorted(p.name for p in remote.rglob("*"))
    assert (model / "model_best.pth").is_file()


def test_checkpoints_ls_lists_the_remote_of_a_run_whose_model_dir_is_gone(tmp_path: Path) -> None:
    """A fresh node or a wiped scratch disk: the run directory is there, model/ is not; `pimm
    checkpoints ls` still shows the remote's candidates and that a resume restores from it."""
    remote = tmp_path / "shared"
    r = launch(tmp_path / "exp", "g", "train.epochs=1", f"checkpoint.remote=file://{remote}", here=True)
    assert r.returncode == 0, describe(r)
    run = tmp_path / "exp" / "digits" / "g"
    shutil.rmtree(run / "model")
    ls = pimm("checkpoints", "ls", str(run))
    assert ls.returncode == 0, describe(ls)
    assert f"remote file://{remote}/digits/g/model:" in ls.stdout, ls.stdout
    assert "step_45  step 45  complete" in ls.stdout, ls.stdout
    assert "the remote holds step 45 (step_45): restoring it" in ls.stdout, ls.stdout
    dry = pimm_here("resume", str(run), "--dry-run", "--", "train.epochs=2")  # says the same, downloads nothing
    assert dry.returncode == 0, describe(dry)
    assert "remote: model/ holds no intact checkpoint; the remote holds step 45 (step_45): restoring it" in dry.stdout
    assert not (run / "model").exists()


def test_a_remote_newer_than_model_last_is_what_the_dry_run_describes_and_the_restore_is_in_train_log(
        tmp_path: Path) -> None:
    """A requeued job on a node whose model/ holds an older copy of the run (last at step 20) while
    the remote holds step 30: `pimm resume --dry-run` describes the remote checkpoint (checkpoint:,
    continue at:), as the resume restores it; and the resume's line saying so is in train.log too."""
    remote = tmp_path / "shared"
    root, run = tmp_path / "exp", tmp_path / "exp" / "digits" / "n"
    r = launch(root, "n", "train.epochs=1", "train.max_steps=20", "eval.every_epochs=0",
               f"checkpoint.remote=file://{remote}", here=True)
    assert r.returncode == 0, describe(r)
    shutil.copytree(run / "model", tmp_path / "model-20", symlinks=True)
    r = pimm_here("resume", str(run), "--", "train.max_steps=30")
    assert r.returncode == 0, describe(r)
    assert (remote / "digits" / "n" / "model" / "step_30" / "trainer.dcp" / ".complete").is_file()
    shutil.rmtree(run / "model")
    shutil.copytree(tmp_path / "model-20", run / "model", symlinks=True)  # this node's older copy

    dry = pimm_here("resume", str(run), "--dry-run", "--", "train.max_steps=40")
    assert dry.returncode == 0, describe(dry)
    lines = {ln.split(":", 1)[0]: ln for ln in dry.stdout.splitlines() if ":" in ln}
    assert lines["checkpoint"].startswith(f"checkpoint: file://{remote}/digits/n/model/step_30 (step 30, epoch 0, "
                                          "iter 30)"), dry.stdout
    assert lines["continue at"].startswith("continue at: step 30, epoch 0, iter 30"), dry.stdout
    assert "the remote holds step 30, newer than model/last at step 20: restoring it" in lines["remote"], dry.stdout
    assert "horizon moves from step 30 to the step this resume ends at" in dry.stdout, dry.stdout
    assert (run / "model" / "last").resolve().name != "step_30"  # nothing downloaded

    r = pimm_here("resume", str(run), "--", "train.max_steps=40")
    assert r.returncode == 0, describe(r)
    log = (run / "train.log").read_text()
    assert "the remote holds step 30, newer than model/last at step 20: restoring it" in log, log[-3000:]
    assert "done:" in r.stdout and "steps 40" in r.stdout, describe(r)


def test_the_dry_run_warns_that_more_epochs_on_a_finished_run_move_the_lr_horizon(trained_run) -> None:
    """As the real resume says ("LR schedule horizon moved from step 45 to step 90"): the horizon is
    status.json's total_steps and moves by one epoch's steps per extra epoch."""
    status = json.loads((trained_run.run_dir / "status.json").read_text())
    assert status["state"] == "finished"
    before, spe = status["total_steps"], status["steps_per_epoch"]
    epochs = status["epochs"]
    dry = pimm_here("resume", str(trained_run.run_dir), "--dry-run", "--", f"train.epochs={epochs + 1}")
    assert dry.returncode == 0, describe(dry)
    assert (f"warning: the LR schedule's horizon moves from step {before} to step {before + spe} (where this resume "
            f"ends)") in dry.stdout, dry.stdout
    same = pimm_here("resume", str(trained_run.run_dir), "--dry-run", "--", f"train.epochs={epochs}")
    assert "horizon" not in same.stdout, same.stdout


def test_a_snapshot_the_retention_dropped_before_a_crash_is_removed_remotely_by_the_next_session(
        tmp_path: Path) -> None:
    """The local retention removed iter_10.pth, then the process died before the mirror removed it from the
    remote (the state is made by removing it locally by hand). The next session's mirror removes it once
    model/ holds checkpoint.keep_iter newer snapshots; a remote snapshot newer than those (a later life of
    the run on another node) stays."""
    remote = tmp_path / "shared"
    root, run = tmp_path / "exp", tmp_path / "exp" / "digits" / "s"
    common = ("train.epochs=1", "checkpoint.every_steps=10", "checkpoint.keep_iter=2", "eval.every_epochs=0",
              f"checkpoint.remote=file://{remote}")
    r = launch(root, "s", *common, "train.max_steps=20", here=True)
    assert r.returncode == 0, describe(r)
    model, mirror = run / "model", remote / "digits" / "s" / "model"
    assert {p.name for p in mirror.glob("iter_*")} == {"iter_10.pth", "iter_10.pth.json", "iter_20.pth",
                                                       "iter_20.pth.json"}
    for name in ("iter_10.pth", "iter_10.pth.json"):
        (model / name).unlink()  # what the retention did just before the crash
    for suffix in ("", ".json"):  # a later life's snapshot, on the remote only
        shutil.copy(mirror / f"iter_20.pth{suffix}", mirror / f"iter_90.pth{suffix}")
    r = pimm_here("resume", str(run), "--", "train.max_steps=30")
    assert r.returncode == 0, describe(r)
    assert sorted(p.name for p in model.glob("iter_*.pth")) == ["iter_20.pth", "iter_30.pth"]
    assert sorted(p.name for p in mirror.glob("iter_*.pth")) == ["iter_20.pth", "iter_30.pth", "iter_90.pth"]
    assert not (mirror / "iter_10.pth.json").exists()
