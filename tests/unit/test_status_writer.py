"""``status.json`` at a logged step is written by a writer thread, state changes at once and last.

A logged step only hands its ``running`` record over (the training thread does no file write for
it); a state change (``stopping``, ``finished``...) is written on the calling thread after any
write in progress, and a ``running`` handed over before or after it never replaces it. The writes
are held with the ``status.write`` fail point (``pause``), the way the crash tests hold a save.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from pimm_core import faults
from pimm_core.process.dist import DistInfo
from pimm_core.run import read_json
from pimm_core.train.recorder import Recorder
from pimm_core.train.state import TrainState


def _recorder(run_dir: Path, state: TrainState) -> Recorder:
    rec = Recorder(run_dir, DistInfo(), state, epochs=3, steps_per_epoch=50, log_every_steps=2)
    rec.total = 150
    return rec


@pytest.fixture
def held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The first ``status.json`` write stops at its ``status.write`` fail point until ``<dir>/status.write.go``."""
    gates = tmp_path / "gates"
    gates.mkdir()
    monkeypatch.setenv("PIMM_FAILPOINT_DIR", str(gates))
    monkeypatch.setattr(faults, "_SPEC", "status.write=pause")
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.setattr(faults, "PAUSE_LIMIT_S", 20.0)  # (a broken test ends instead of hanging)
    return gates


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.005)


def test_a_logged_step_hands_status_json_over_and_an_end_state_is_written_last(tmp_path: Path, held: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    s = TrainState(global_step=2, epoch=0, iter=2)
    rec = _recorder(run, s)
    with rec.training():
        rec.on_step(0, torch.tensor(0.5), 1e-3, 32)  # step 2: logged; its status write is held
        _wait_for(held / "status.write.reached")  # (the writer thread is inside the write)
        # the training thread went on past the step while its status.json is not written yet
        assert not (run / "status.json").exists()
        s.global_step = s.iter = 4
        rec.on_step(0, torch.tensor(0.4), 1e-3, 32)  # step 4: handed over while step 2's write is held
        s.stop_reason = "budget"
        ended = threading.Thread(target=rec.status, args=("stopped",))
        ended.start()  # (waits for the write in progress, or writes at once after it)
        (held / "status.write.go").touch()
        ended.join(30)
        assert not ended.is_alive()
        rec.heartbeat()  # a running after the end state: ignored
    rec.close()
    status = read_json(run / "status.json")
    assert (status["state"], status["step"], status["stop_reason"]) == ("stopped", 4, "budget")


def test_the_newest_heartbeat_is_written_by_close(tmp_path: Path) -> None:
    s = TrainState(global_step=2, epoch=0, iter=2)
    rec = _recorder(tmp_path, s)
    rec.status("running")
    with rec.training():
        for step in (4, 6, 8):
            s.global_step = s.iter = step
            rec.on_step(0, torch.tensor(0.5), 1e-3, 32)
    rec.close()
    status = read_json(tmp_path / "status.json")
    assert (status["state"], status["step"]) == ("running", 8)


def test_a_record_the_writer_thread_cannot_encode_fails_the_next_logged_step(tmp_path: Path) -> None:
    # (a bug: before the writer thread, the step's own write raised it; it must not vanish in a thread)
    s = TrainState(global_step=2, epoch=0, iter=2)
    rec = _recorder(tmp_path, s)
    rec.status("running")
    rec.status_extra = {"note": object()}
    rec.heartbeat()
    rec.close()  # (the thread has written, or failed to, once this returns)
    with pytest.raises(TypeError, match="not JSON serializable"):
        rec.heartbeat()


def test_logged_steps_are_written_at_most_once_an_interval_the_newest_at_close(tmp_path: Path) -> None:
    # (a small model logs every few ms: each record handed over is not a file replacement; the
    # newest is, min_interval_s after the previous write, and close() writes the one waiting at once)
    from pimm_core.run import StatusWriter

    written: list[int] = []
    first, second = threading.Event(), threading.Event()

    def report(error) -> None:
        written.append(read_json(tmp_path / "status.json")["step"])
        (second if first.is_set() else first).set()

    writer = StatusWriter(tmp_path, report, min_interval_s=3600.0)
    writer.post({"step": 1})
    assert first.wait(30), "the first record was never written"  # (the first one at once)
    for step in range(2, 50):
        writer.post({"step": step})
    # (the next write waits an hour: no second write comes; without the interval it came at once)
    assert not second.wait(1.0) and read_json(tmp_path / "status.json")["step"] == 1
    closing = threading.Thread(target=writer.close)
    closing.start()
    closing.join(60)  # (a timeout that only catches close() waiting the hour out)
    assert not closing.is_alive(), "close() waited for the interval instead of writing the newest record"
    assert written == [1, 49]  # the newest, once; none of those it replaced
    writer.write("stopped", {"step": 50})  # a state change: at once
    assert read_json(tmp_path / "status.json")["state"] == "stopped" and written[-1] == 50


def test_a_heartbeat_does_not_replace_what_the_launcher_wrote_meanwhile(tmp_path: Path) -> None:
    # (torchrun's agent reports a failed rank, the launcher marks the run restarting, and only then are
    # the other ranks stopped: rank 0's heartbeat still waiting must not turn it back into running)
    from pimm_core.run import StatusWriter, read_run_status
    from pimm_core.run.status import mark_restarting

    writer = StatusWriter(tmp_path, lambda e: None, min_interval_s=0.0)
    writer.write("running", {"step": 1})
    mark_restarting(tmp_path, 4321, "rank 1 was killed by SIGKILL")
    writer.post({"step": 2})
    writer.close()
    status = read_run_status(tmp_path)
    assert (status.state, status.step) == ("restarting", 1), status
