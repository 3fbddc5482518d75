"""checkpoint.remote: published checkpoints uploaded in the background to a real S3 server
(moto on 127.0.0.1), a wiped model/ resumed from it, kills mid-upload, the server going away."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import DIGITS, REPO, launch, read_json
from _s3 import BUCKET, start_s3

# 2 epochs of digits (45 steps each): saves at the end of epoch 1 (step 45) and the final one (step 90),
# iter_<step>.pth snapshots every 20 steps keeping the newest 2
RUN = ("train.epochs=2", "checkpoint.every_steps=20", "checkpoint.keep_iter=2")


@pytest.fixture
def s3():
    server = start_s3()
    yield server
    server.server.stop()


def auto_resume(root: Path, name: str, s3, *overrides: str) -> subprocess.CompletedProcess[str]:
    """``pimm launch --train.auto-resume`` of ``<root>/digits/<name>`` (the cluster job's repeated command)."""
    return subprocess.run([sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(DIGITS),
                           "--run.root", str(root), "--run.name", name, "--run.no-timestamp", "--train.auto-resume",
                           "--", *overrides, *remote(s3)], cwd=REPO, env=s3.env(), capture_output=True, text=True,
                          timeout=300)


def remote(s3) -> list[str]:
    return [f"checkpoint.remote={s3.url}", "checkpoint.remote_timeout=120"]


def run_model(s3, run: str = "r") -> str:
    return f"exp/digits/{run}/model"


def test_uploaded_with_layout_retention_and_resumed_after_model_dir_is_wiped(tmp_path, s3):
    r = launch(tmp_path, "r", *RUN, *remote(s3), env=s3.env())
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "checkpoints uploaded to" in out, out
    model = tmp_path / "digits" / "r" / "model"
    local = read_json(model / "last" / "manifest.json")
    assert local["step"] == 90
    # retention: only the newest step is kept remotely, as locally; the iter snapshots are those kept locally
    names = s3.ls(run_model(s3))
    assert [n for n in names if n.startswith("step_")] == ["step_90"]
    local_iters = sorted(p.name for p in model.glob("iter_*.pth*"))
    assert [n for n in names if n.startswith("iter_")] == local_iters == [
        "iter_60.pth", "iter_60.pth.json", "iter_80.pth", "iter_80.pth.json"]
    assert "model_best.pth" in names and "model_best.pth.json" in names
    # the layout and the bytes of each file, as the manifest records them
    prefix = f"{BUCKET}/{run_model(s3)}/step_90"
    assert s3.fs.exists(f"{prefix}/.complete") and s3.fs.exists(f"{prefix}/trainer.dcp/.complete")
    for rel, want in local["files"].items():
        assert s3.fs.cat_file(f"{prefix}/{rel}") == (model / "last" / rel).read_bytes(), rel
    assert json.loads(s3.fs.cat_file(f"{prefix}/manifest.json")) == local

    shutil.rmtree(model)  # a wiped scratch disk: the run directory without its checkpoints
    r2 = auto_resume(tmp_path, "r", s3, "train.epochs=3", *RUN[1:])
    assert r2.returncode == 0, r2.stderr
    out2 = r2.stdout + r2.stderr
    assert "downloaded" in out2 and "step_90" in out2, out2
    resumes = [e for e in read_json(tmp_path / "digits" / "r" / "provenance.json")["starts"] if e.get("kind") == "resume"]
    assert resumes and resumes[-1]["step"] == 90 and resumes[-1]["exact"], resumes
    assert read_json(model / "last" / "manifest.json")["step"] == 135
    assert [n for n in s3.ls(run_model(s3)) if n.startswith("step_")] == ["step_135"]
