"""checkpoint.remote: published checkpoints uploaded in the background to a real S3 server
(moto on 127.0.0.1), a wiped model/ resumed from it, kills mid-upload, the server going away."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import DIGITS, REPO, hang_s, launch, read_json
from _s3 import BUCKET, pimm_here_s3, start_s3

# 2 epochs of digits (45 steps each): saves at the end of epoch 1 (step 45) and the final one (step 90),
# iter_<step>.pth snapshots every 20 steps keeping the newest 2, the 2 best evaluations as best_<step>.pth
RUN = ("train.epochs=2", "checkpoint.every_steps=20", "checkpoint.keep_iter=2", "checkpoint.keep_best=2")


@pytest.fixture
def s3():
    server = start_s3()
    yield server
    try:
        server.server.stop()
    except Exception:
        pass  # stopped by the test (the store going away)


def auto_resume(root: Path, name: str, s3, *overrides: str) -> subprocess.CompletedProcess[str]:
    """``pimm launch --train.auto-resume`` of ``<root>/digits/<name>`` (the cluster job's repeated command)."""
    return subprocess.run([sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(DIGITS),
                           "--run.root", str(root), "--run.name", name, "--run.no-timestamp", "--train.auto-resume",
                           "--", *overrides, *remote(s3)], cwd=REPO, env=s3.env(), capture_output=True, text=True,
                          timeout=hang_s(300))


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
    local_best = sorted(p.name for p in model.glob("best_*.pth*"))  # checkpoint.keep_best: mirrored as iter files
    assert [n for n in names if n.startswith("best_")] == local_best == [
        "best_45.pth", "best_45.pth.json", "best_90.pth", "best_90.pth.json"]
    # the layout and the bytes of each file, as the manifest records them
    prefix = f"{BUCKET}/{run_model(s3)}/step_90"
    assert s3.fs.exists(f"{prefix}/.complete") and s3.fs.exists(f"{prefix}/trainer.dcp/.complete")
    for rel, want in local["files"].items():
        assert s3.fs.cat_file(f"{prefix}/{rel}") == (model / "last" / rel).read_bytes(), rel
    assert json.loads(s3.fs.cat_file(f"{prefix}/manifest.json")) == local

    # `pimm checkpoints ls` lists the remote candidates, torch-free
    code = ("import sys; from pimm_core.cli import main; "
            f"main(['checkpoints', 'ls', {str(model.parent)!r}, '--json']); print('torch' in sys.modules)")
    ls = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=s3.env(), capture_output=True, text=True,
                        timeout=hang_s(120))
    assert ls.returncode == 0, ls.stderr
    *body, torch_loaded = ls.stdout.strip().splitlines()
    assert torch_loaded == "False"
    listed = json.loads("\n".join(body))["remote"]
    assert listed["error"] is None and listed["uploading"] == []
    assert {"name": "step_90", "step": 90, "complete": True, "kind": "standard"} in listed["candidates"]

    evaluations = {45: value_of(model / "best_45.pth.json"), 90: value_of(model / "best_90.pth.json")}
    best_before = (model / "model_best.pth").read_bytes()
    shutil.rmtree(model)  # a wiped scratch disk: the run directory without its checkpoints
    r2 = auto_resume(tmp_path, "r", s3, "train.epochs=3", *RUN[1:])
    assert r2.returncode == 0, r2.stderr
    out2 = r2.stdout + r2.stderr
    assert "downloaded" in out2 and "step_90" in out2, out2
    resumes = [e for e in read_json(tmp_path / "digits" / "r" / "provenance.json")["starts"] if e.get("kind") == "resume"]
    assert resumes and resumes[-1]["step"] == 90 and resumes[-1]["exact"], resumes
    assert read_json(model / "last" / "manifest.json")["step"] == 135
    assert [n for n in s3.ls(run_model(s3)) if n.startswith("step_")] == ["step_135"]
    # the restore brought back the run's whole set, so its retention went on from it as if model/ had
    # never been wiped: the 2 best of the 3 evaluations kept (locally and remotely), the newest 2 snapshots
    evaluations[135] = metric_at(tmp_path / "digits" / "r", 135)
    top2 = sorted(evaluations, key=lambda step: (-evaluations[step], step))[:2]
    local_best = sorted(p.name for p in model.glob("best_*.pth*"))
    assert local_best == sorted(f"best_{step}.pth{ext}" for step in top2 for ext in ("", ".json")), (
        local_best, evaluations)
    assert [n for n in s3.ls(run_model(s3)) if n.startswith("best_")] == local_best
    local_iters = sorted(p.name for p in model.glob("iter_*.pth*"))
    assert local_iters == ["iter_100.pth", "iter_100.pth.json", "iter_120.pth", "iter_120.pth.json"]
    assert [n for n in s3.ls(run_model(s3)) if n.startswith("iter_")] == local_iters
    # model_best.pth: the restored one, unless the resumed evaluation improved on it
    best_now = s3.fs.cat_file(f"{BUCKET}/{run_model(s3)}/model_best.pth")
    assert (model / "model_best.pth").read_bytes() == best_now
    assert (best_now == best_before) == (evaluations[135] <= max(evaluations[45], evaluations[90]))
    assert "iter_60.pth" in out2 and "best_45.pth" in out2 and "model_best.pth" in out2, out2  # said so


def value_of(sidecar: Path) -> float:
    return read_json(sidecar)["selection_metric"]["value"]


def metric_at(run_dir: Path, step: int) -> float:
    """The selection metric (accuracy on val, mode max: the digits config) of the evaluation at ``step``."""
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("split") == "val" and rec.get("step") == step and "acc" in rec:
            return rec["acc"]
    raise AssertionError(f"no evaluation at step {step} in metrics.jsonl")


def test_the_mirror_removes_only_what_this_run_held_and_removed_and_a_restore_checks_each_file(tmp_path, s3):
    from pimm_core.checkpoint.remote.upload import Uploader

    def weights(where: Path, name: str, data: bytes, sha: str | None = None) -> None:
        (where / name).write_bytes(data)
        (where / f"{name}.json").write_text(json.dumps({"format": "weights", "step": 1, "files": {
            name: {"size": len(data), "sha256": sha or hashlib.sha256(data).hexdigest()}}}))

    prefix = f"{BUCKET}/{run_model(s3)}"
    older = tmp_path / "older"  # what an earlier life of the run uploaded: its model/ is gone
    older.mkdir()
    weights(older, "iter_5.pth", b"five")
    weights(older, "best_5.pth", b"best five")
    weights(older, "iter_6.pth", b"six!", sha="0" * 64)  # damaged on the store: same size, other bytes
    for p in older.iterdir():
        s3.fs.put_file(str(p), f"{prefix}/{p.name}")
    model = tmp_path / "model"
    model.mkdir()
    weights(model, "iter_10.pth", b"ten")
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3.endpoint},
               "skip_instance_cache": True}
    up = Uploader(s3.url, options, model, f"{s3.url}/digits/r/model")
    assert up.close(hang_s(60)) == []
    # nothing this process did not see in model/ is removed: the older life's files stay
    assert [n for n in s3.ls(run_model(s3)) if n.endswith(".pth")] == [
        "best_5.pth", "iter_10.pth", "iter_5.pth", "iter_6.pth"]
    # a run (re)started with iter_10 in model/: its retention removes it before the upload thread looks
    up = Uploader(s3.url, options, model, f"{s3.url}/digits/r/model")
    weights(model, "iter_20.pth", b"twenty")
    for name in ("iter_10.pth", "iter_10.pth.json"):
        (model / name).unlink()
    assert up.close(hang_s(60)) == []
    assert [n for n in s3.ls(run_model(s3)) if n.endswith(".pth")] == [
        "best_5.pth", "iter_20.pth", "iter_5.pth", "iter_6.pth"]

    # a restore into a wiped model/: every complete weights file, each checked against its sidecar
    from pimm_core.checkpoint.remote.store import download_weights_files

    restored = tmp_path / "restored"
    restored.mkdir()
    got, failed = download_weights_files(s3.fs, prefix, restored)
    assert sorted(got) == ["best_5.pth", "iter_20.pth", "iter_5.pth"]
    assert len(failed) == 1 and failed[0].startswith("iter_6.pth: sha256"), failed
    assert sorted(p.name for p in restored.iterdir()) == [
        "best_5.pth", "best_5.pth.json", "iter_20.pth", "iter_20.pth.json", "iter_5.pth", "iter_5.pth.json"]
    assert (restored / "iter_5.pth").read_bytes() == b"five"


def test_kill_during_an_upload_leaves_no_candidate_that_selection_accepts(tmp_path, s3):
    from pimm_core.checkpoint.remote.store import download_newest, remote_candidates

    # SIGKILL after every file of the first step_<N>/ uploaded is uploaded and checked, before its
    # manifest and .complete (uploads are coalesced: N is whichever `last` the uploader took first)
    env = {**s3.env(), "PIMM_FAILPOINT": "remote.step_markers@1=kill"}
    r = launch(tmp_path, "r", *RUN, *remote(s3), env=env)
    assert r.returncode == -9, r.stderr
    prefix = f"{BUCKET}/{run_model(s3)}"
    partial = [c for c in remote_candidates(s3.fs, prefix) if c.kind == "standard"]
    # (an earlier one whose local copy was rotated away mid-upload may be there too, as incomplete)
    assert partial and not any(c.complete for c in partial), partial
    s3.fs.invalidate_cache()
    assert s3.fs.exists(f"{prefix}/{partial[0].name}/weights.pth")  # cut short mid-upload, not never started
    assert download_newest(s3.fs, prefix, tmp_path / "dl") is None and not (tmp_path / "dl").exists()

    # a fresh node (model/ wiped) finds nothing on the remote to resume: it starts the run fresh
    model = tmp_path / "digits" / "r" / "model"
    kept = tmp_path / "kept"
    shutil.copytree(model, kept)
    shutil.rmtree(model)
    r2 = auto_resume(tmp_path, "r", s3, *RUN)
    assert r2.returncode == 0, r2.stderr
    assert "downloaded" not in r2.stdout + r2.stderr
    starts = read_json(tmp_path / "digits" / "r" / "provenance.json")["starts"]
    assert [e["kind"] for e in starts] == ["start", "start"]
    # and the remote ends with the new run's final checkpoint alone, complete (the partial step_45 pruned)
    assert [c.name for c in remote_candidates(s3.fs, prefix) if c.kind == "standard"] == ["step_90"]
    assert remote_candidates(s3.fs, prefix)[0].complete


def test_server_going_away_is_a_warning_training_continues_and_the_end_says_what_is_missing(tmp_path, s3):
    from pimm_core.checkpoint.remote.store import remote_candidates
    from pimm_core.checkpoint.select.selection import select_resume

    run_dir = tmp_path / "digits" / "r"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(DIGITS), "--run.root", str(tmp_path),
         "--run.name", "r", "--run.no-timestamp", "--", "train.epochs=1000", f"checkpoint.remote={s3.url}",
         "checkpoint.remote_timeout=5"], cwd=REPO, env=s3.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        wait_for(lambda: any(c.complete for c in remote_candidates(s3.fs, f"{BUCKET}/{run_model(s3)}")),
                 "the first upload")
        s3.server.stop()  # the store goes away mid-run
        log = run_dir / "train.log"
        wait_for(lambda: "checkpoint upload to" in log.read_text() and "failed" in log.read_text(), "the warning")
        status = read_json(run_dir / "status.json")
        step = status.get("step", status.get("global_step"))
        wait_for(lambda: (s := read_json(run_dir / "status.json")).get("step", s.get("global_step")) > step,
                 "training going on after the warning")
        stop = subprocess.run([sys.executable, "-m", "pimm_core.cli", "stop", str(run_dir)], cwd=REPO,
                              env=s3.env(), capture_output=True, text=True, timeout=hang_s(60))
        assert stop.returncode == 0, stop.stderr
        out, _ = proc.communicate(timeout=hang_s(300))
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    end = [line for line in out.splitlines() if "not on the remote" in line]
    assert end and "model/last (step" in end[0], out
    chosen, _ = select_resume(run_dir / "model")
    assert chosen is not None and chosen.step > 0  # the local checkpoint is intact


def wait_for(cond, what: str, timeout: float = 240) -> None:
    """Wait for an event (catches hangs only; no machine-speed assumption)."""
    deadline = time.monotonic() + hang_s(timeout)
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_wiped_then_a_stale_local_model_dir_resumes_from_the_newer_remote_step_and_the_mirror_keeps_it(
        tmp_path, s3):
    """``pimm resume RUN`` of a run whose model/ was wiped downloads the newest complete remote step
    (step 45) and goes on from it exactly. Then a requeued job lands on a node whose model/ holds an
    earlier copy of the run (last at step 45) while the remote holds step 90: the resume takes the newest
    (the remote's), every tool says so, and the mirror never removes a remote step newer than the local one.
    (One run for both: the stale copy is the model/ saved before the wipe.)"""
    from pimm_core.checkpoint.remote.upload import Uploader

    r = launch(tmp_path, "r", "train.epochs=1", *remote(s3), env=s3.env())
    assert r.returncode == 0, r.stderr
    run_dir = tmp_path / "digits" / "r"
    model = run_dir / "model"
    older = tmp_path / "older"
    shutil.copytree(model, older, symlinks=True)  # the earlier copy on the other node's scratch disk
    shutil.rmtree(model)  # a wiped scratch disk
    # in this process (a plain one-rank resume; the download in a fresh process is the first test's auto-resume)
    r2 = pimm_here_s3("resume", str(run_dir), "--", "train.epochs=2", env=s3.env())
    assert r2.returncode == 0, r2.stdout + r2.stderr
    assert "step_45" in r2.stdout + r2.stderr
    resumes = [e for e in read_json(run_dir / "provenance.json")["starts"] if e.get("kind") == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 45 and resumes[0]["exact"], resumes
    assert read_json(model / "last" / "manifest.json")["step"] == 90
    assert [n for n in s3.ls(run_model(s3)) if n.startswith("step_")] == ["step_90"]

    # the mirror of a model/ whose last is older than the remote's newest step keeps that step
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3.endpoint},
               "skip_instance_cache": True}
    best_90 = s3.fs.cat_file(f"{BUCKET}/{run_model(s3)}/model_best.pth")
    assert read_json(model / "model_best.pth.json")["step"] > 45  # the best evaluation is a later one
    up = Uploader(s3.url, options, older, f"{s3.url}/digits/r/model")
    assert up.close(hang_s(120)) == []
    assert [n for n in s3.ls(run_model(s3)) if n.startswith("step_")] == ["step_45", "step_90"]
    assert s3.fs.cat_file(f"{BUCKET}/{run_model(s3)}/model_best.pth") == best_90  # not replaced by the older one

    shutil.rmtree(model)
    shutil.copytree(older, model, symlinks=True)
    why = "the remote holds step 90, newer than model/last at step 45"
    # the dry run and `pimm checkpoints ls` (torch-free) say the choice the resume makes
    dry = pimm_here_s3("resume", str(run_dir), "--dry-run", "--", "train.epochs=3", env=s3.env())
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert why in dry.stdout, dry.stdout
    code = ("import sys; from pimm_core.cli import main; "
            f"main(['checkpoints', 'ls', {str(run_dir)!r}]); print('torch' in sys.modules)")
    ls = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=s3.env(), capture_output=True, text=True,
                        timeout=hang_s(120))
    assert ls.returncode == 0, ls.stderr
    assert why in ls.stdout and ls.stdout.strip().splitlines()[-1] == "False", ls.stdout
    assert [n for n in s3.ls(run_model(s3)) if n.startswith("step_")] == ["step_45", "step_90"]  # nothing written

    r3 = auto_resume(tmp_path, "r", s3, "train.epochs=3")
    assert r3.returncode == 0, r3.stderr
    out3 = r3.stdout + r3.stderr
    assert f"{why}: restoring it" in out3, out3
    restored = next(line for line in out3.splitlines() if "downloaded from the remote into" in line)
    assert "model_best.pth" in restored, restored  # the later best came back too
    resumes = [e for e in read_json(run_dir / "provenance.json")["starts"] if e.get("kind") == "resume"]
    assert resumes[-1]["step"] == 90 and resumes[-1]["exact"], resumes
    assert read_json(model / "last" / "manifest.json")["step"] == 135
    assert [n for n in s3.ls(run_model(s3)) if n.startswith("step_")] == ["step_135"]
    # the older local last was set aside, not deleted
    assert any(read_json(p / "manifest.json").get("step") == 45 for p in (run_dir / "abandoned").iterdir()
               if (p / "manifest.json").is_file())
