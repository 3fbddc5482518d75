"""``checkpoint.async = true``: background saves that change nothing a user relies on.

A real launch with async saves every 10 steps is stopped with SIGTERM while training (a
save is then usually in flight): it exits 0 once the in-flight save is published and
``last`` is saved, ``last`` is complete and verifies, and the resumed run ends with
weights bit-for-bit equal to an uninterrupted synchronous run of the same config (so
the background write neither perturbed training nor lost state). Kills in the middle of
a background write are in ``test_crash.py`` (``async`` cases).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import torch

from _helpers import DIGITS, REPO, clean_env, describe, launch, pimm, read_json
from pimm_core.checkpoint.selection import select_resume
from test_stop_runs import Session

OV = ("train.epochs=2", "checkpoint.every_steps=10", "data.num_workers=0", "train.log_every_steps=1")


def final_weights(run_dir):
    return torch.load(run_dir / "model" / "last" / "weights.pth", weights_only=True)["state_dict"]


def test_async_stop_waits_for_the_save_and_resumes_bitwise(tmp_path):
    reference = launch(tmp_path, "sync", *OV, "checkpoint.async=false")
    assert reference.returncode == 0, describe(reference)

    s = Session(tmp_path, "bg", (*OV, "checkpoint.async=true"), nproc=None, resume=False, tag="stopped")
    try:
        s.wait_training(min_step=12)  # past the first background save
        s.proc.send_signal(signal.SIGTERM)
        assert s.wait() == 0, s.describe()
    finally:
        s.kill()
    status = read_json(s.run_dir / "status.json")
    assert status["state"] == "stopped", status
    chosen, _ = select_resume(s.run_dir / "model")
    assert chosen is not None and chosen.name == "last" and chosen.step == status["step"], (chosen, status)
    verify = pimm("checkpoints", "verify", s.run_dir)
    assert verify.returncode == 0, describe(verify)
    log = (s.run_dir / "train.log").read_text()
    assert "written in the background" in log, log[-2000:]  # logged when published, not when started
    assert not list((s.run_dir / "model").glob("*.tmp")), sorted(p.name for p in (s.run_dir / "model").iterdir())

    resumed = subprocess.run([sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(DIGITS),
                              "--run.root", str(tmp_path), "--run.name", "bg", "--run.no-timestamp", "--train.resume",
                              "--", *OV, "checkpoint.async=true"],
                             cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, describe(resumed)
    ref, got = final_weights(tmp_path / "digits" / "sync"), final_weights(s.run_dir)
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref), "async + stop + resume diverged from the sync run"
