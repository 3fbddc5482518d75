"""``checkpoint.remote`` as a ``file://`` URL (a shared file system mounted on every node): the
mirror creates the directories it writes into. It used to fail every upload with "No such file
or directory" (fsspec's local filesystem makes parents only when asked), retry, and hold the
run's end for ``checkpoint.remote_timeout`` (10 minutes)."""

from __future__ import annotations

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
