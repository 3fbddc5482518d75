"""``checkpoint.async = true``: background saves that change nothing a user relies on.

A real launch with async saves every 10 steps is stopped with SIGTERM while training (a
save is then usually in flight): it exits 0 once the in-flight save is published and
``last`` is saved, and ``last`` is complete and verifies. It is resumed, SIGKILLed once
a background save is published, and resumed again from that background-written
checkpoint to the end: the final weights must equal an uninterrupted synchronous run bit
for bit, so the background copies and writes neither perturbed training nor captured a
half-updated state. Kills in the middle of a background write are in ``test_crash.py``.

The stopped and the killed sessions are real processes; the last resume and the reference run
in this process (``pimm_here``): what they check does not depend on a fresh process.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from _helpers import DIGITS, describe, hang_s, launch, pimm_here, read_json
from pimm_core.checkpoint.select.selection import select_resume
from test_stop_runs import Session

OV = ("train.epochs=2", "checkpoint.every_steps=10", "data.num_workers=0", "train.log_every_steps=1")


def final_weights(run_dir):
    return torch.load(run_dir / "model" / "last" / "weights.pth", weights_only=True)["state_dict"]


def test_async_stop_and_kill_resume_bitwise(tmp_path):
    _stop_kill_resume(tmp_path)
    reference = launch(tmp_path, "sync", *OV, "checkpoint.async=false", here=True)
    assert reference.returncode == 0, describe(reference)
    ref, got = final_weights(tmp_path / "digits" / "sync"), final_weights(tmp_path / "digits" / "bg")
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref), "async save + kill + resume diverged from the sync run"


def _stop_kill_resume(tmp_path) -> None:
    """SIGTERM an async run, resume it, SIGKILL it after a background save, resume it to the end."""
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
    verify = pimm_here("checkpoints", "verify", str(s.run_dir))
    assert verify.returncode == 0, describe(verify)
    log = (s.run_dir / "train.log").read_text()
    assert "written in the background" in log, log[-2000:]  # logged when published, not when started
    assert not list((s.run_dir / "model").glob("*.tmp")), sorted(p.name for p in (s.run_dir / "model").iterdir())

    # Resume with async saves, and SIGKILL the run once a background save newer than the
    # stop is published: the next resume then loads a checkpoint the background thread wrote.
    s2 = Session(tmp_path, "bg", (*OV, "checkpoint.async=true"), nproc=None, resume=True, tag="killed")
    try:
        step = background_save_after(s2, status["step"])
        os.killpg(s2.proc.pid, signal.SIGKILL)
        s2.wait()
    finally:
        s2.kill()
    resumed = pimm_here("launch", "--train.config", str(DIGITS), "--run.root", str(tmp_path), "--run.name", "bg",
                        "--run.no-timestamp", "--train.resume", "--", *OV, "checkpoint.async=true")
    assert resumed.returncode == 0, describe(resumed)
    start = read_json(s.run_dir / "provenance.json")["starts"][-1]
    assert start["kind"] == "resume" and start["checkpoint_step"] >= step, (start, step)


def background_save_after(s: Session, step: int) -> int:
    """Wait for train.log to report a background save published after ``step``; returns its step."""
    pattern = re.compile(r"saved \S+ \(step (\d+), .*written in the background\)")
    deadline = time.monotonic() + hang_s(180)
    while time.monotonic() < deadline:
        if s.proc.poll() is not None:
            pytest.fail(f"the run ended before a background save after step {step}:\n{s.describe()}")
        log = (s.run_dir / "train.log").read_text(errors="replace")
        steps = [int(m.group(1)) for m in pattern.finditer(log)]
        if steps and steps[-1] > step:
            return steps[-1]
        time.sleep(0.02)
    pytest.fail(f"no background save after step {step} within 180 s:\n{s.describe()}")


def test_an_async_save_that_fails_to_start_stops_its_hashing_thread(tmp_path, monkeypatch):
    """Nothing of a save that never started is left running (a thread tailing last.tmp, open files)."""
    import threading

    from pimm_core.checkpoint.formats import async_save
    from pimm_core.checkpoint.formats.protocol import SaveItem
    from pimm_core.checkpoint.formats.standard import StandardFormat
    from pimm_core.process.dist import DistInfo

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    saver = async_save.AsyncStandardFormat(StandardFormat(DistInfo()))

    def item(step: int) -> SaveItem:
        return SaveItem(model=model, optimizer=opt, meta={}, rank_state={}, manifest={"kind": "last", "step": step},
                        step=step)

    def no_memory(*_a, **_k):
        raise MemoryError("staging")

    monkeypatch.setattr(async_save, "weights_payload", no_memory)
    with pytest.raises(MemoryError):
        saver.save(tmp_path, item(1), background=True)
    saver.wait_staged()
    assert [t.name for t in threading.enumerate() if t.name == "pimm-sha256"] == []
    monkeypatch.undo()
    saver.save(tmp_path, item(2), background=True)
    saver.wait()  # and the next save works
    assert read_json(tmp_path / "last" / "manifest.json")["step"] == 2
