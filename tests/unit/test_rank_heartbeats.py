"""Each rank's heartbeat file (pimm_core/run/heartbeat.py, run/ranks.py): what it records, how
seldom it writes, and the rule that names the rank the others wait for (console and dist.timeout)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from pimm_core.process.dist import DistInfo
from pimm_core.run import heartbeat as hb_mod
from pimm_core.run import stacks
from pimm_core.run.heartbeat import Heartbeat, beat, beat_step, heartbeat
from pimm_core.run.ranks import RankBeat, lagging_ranks, rank_file, ranks_alive, read_rank_beats
from pimm_core.train.hang import CollectiveTimeoutError, name_the_hang


def _wait_file(path: Path, cond, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            data = json.loads(path.read_text())
            if cond(data):
                return data
        except (OSError, ValueError):
            data = None
        assert time.monotonic() < deadline, f"{path}: {data}"
        time.sleep(0.02)


def test_the_file_follows_the_rank_and_ends_with_it(tmp_path: Path):
    with heartbeat(tmp_path, 1, 2) as hb:
        path = rank_file(tmp_path, 1)
        beat("data")
        assert not path.parent.exists()  # nothing before the run starts (a refused resume changes nothing)
        hb.arm()
        first = json.loads(path.read_text())  # written at once
        assert first["phase"] == "data"
        assert first["rank"] == 1 and first["world_size"] == 2
        beat_step(7)
        beat("callback", "on_step_end of Slow")
        # the training thread is now "stuck": the writer thread still records where it is
        data = _wait_file(path, lambda d: d["phase"] == "callback")
        assert data["step"] == 7 and data["detail"] == "on_step_end of Slow" and data["progress"] >= first["progress"]
        assert hb._thread is not None and hb._thread.is_alive()
    assert json.loads(path.read_text())["phase"] == "end"
    assert not any(t.name.startswith("pimm-heartbeat") for t in threading.enumerate())  # joined, nothing left
    beat("data")  # outside: nothing happens, nothing raises
    assert json.loads(path.read_text())["phase"] == "end"


def test_writes_are_throttled_not_one_per_micro_step(tmp_path: Path, monkeypatch):
    writes = []
    real = hb_mod.write_json
    monkeypatch.setattr(hb_mod, "write_json", lambda *a, **k: (writes.append(1), real(*a, **k)))
    hb = Heartbeat(tmp_path, 0, 1, every_s=1.0).start()
    hb.arm()
    start = time.monotonic()
    for step in range(20000):
        hb.enter("data")
        hb.enter("forward/backward")
        hb.enter("collective")  # each micro-step changes phase three times
        hb.at_step(step)
    elapsed = time.monotonic() - start
    hb.close()
    # the first write, at most one a second (plus one prompt write), the last
    assert len(writes) <= 2 * (elapsed / 1.0 + 1) + 2, (len(writes), elapsed)


def test_ranks_left_from_a_larger_session_are_removed_and_ignored(tmp_path: Path):
    for r in range(4):
        rank_file(tmp_path, r).parent.mkdir(exist_ok=True)
        rank_file(tmp_path, r).write_text(json.dumps({"rank": r, "phase": "end"}))
    (tmp_path / "ranks" / "x.json").write_text("{}")
    (tmp_path / "ranks" / "5.json").write_text("{torn")
    assert [b.rank for b in read_rank_beats(tmp_path, 2)] == [0, 1]
    with heartbeat(tmp_path, 0, 2) as hb:
        assert len(list((tmp_path / "ranks").iterdir())) == 6  # untouched before the run starts
        hb.arm()
    # rank 0 of the new 2-rank session removes the files of ranks 2 and up; a foreign name stays
    assert sorted(p.name for p in (tmp_path / "ranks").iterdir()) == ["0.json", "1.json", "x.json"]


def _b(rank: int, phase: str, idle: float, now: float = 1000.0, **kw) -> RankBeat:
    return RankBeat(rank=rank, phase=phase, progress=now - idle, updated=now, step=3, **kw)


@pytest.mark.parametrize("beats,expected", [
    # rank 1 in a callback, the others wait for it in a collective
    ([_b(0, "collective", 40), _b(1, "callback", 41), _b(2, "collective", 39)], [1]),
    # everyone moves
    ([_b(0, "collective", 0.5), _b(1, "data", 0.2)], []),
    # DDP/FSDP: rank 0 waits in the step's own collective (forward/backward) for rank 1, stuck fetching data
    ([_b(0, "forward/backward", 40), _b(1, "data", 40.5)], [1]),
    # the same with a third rank at the stop agreement: still only the one in another phase
    ([_b(0, "forward/backward", 40), _b(1, "callback", 41), _b(2, "collective", 39)], [1]),
    # a rank stuck in its forward (model code) while another waits at the stop agreement
    ([_b(0, "collective", 40), _b(1, "forward/backward", 41)], [1]),
    # a long step on every rank, nobody waits: not a hang
    ([_b(0, "forward/backward", 60), _b(1, "forward/backward", 61)], []),
    # one rank fetching data for a minute while the other has just moved on
    ([_b(0, "forward/backward", 1), _b(1, "data", 60)], [1]),
    # stalled under the threshold: not yet
    ([_b(0, "collective", 5), _b(1, "callback", 6)], []),
    # ended ranks are never waited for
    ([_b(0, "collective", 40), _b(1, "end", 41)], []),
])
def test_the_rank_the_others_wait_for(beats, expected):
    assert [b.rank for b in lagging_ranks(beats, 1000.0)] == expected


def test_alive_means_a_recent_write_by_a_rank_that_has_not_ended():
    assert ranks_alive([_b(0, "collective", 100)], 1000.0)
    assert not ranks_alive([RankBeat(rank=0, phase="collective", progress=0.0, updated=900.0)], 1000.0)
    assert not ranks_alive([_b(0, "end", 0)], 1000.0)


def test_a_collective_timeout_names_the_stuck_rank_and_its_phase(tmp_path: Path, monkeypatch):
    now = time.time()
    for r, phase, detail in ((0, "collective", "stop agreement"), (1, "save", "last")):
        rank_file(tmp_path, r).parent.mkdir(exist_ok=True)
        rank_file(tmp_path, r).write_text(json.dumps(RankBeat(rank=r, phase=phase, detail=detail, step=12,
                                                              progress=now - 90, updated=now).to_json()))
    monkeypatch.setattr(stacks, "WAIT_S", 0.5)  # rank 1 is not there to answer
    gloo = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms for recv operation")
    err = name_the_hang(gloo, tmp_path, DistInfo(0, 2, 0), 1.0, 12)
    assert isinstance(err, CollectiveTimeoutError) and err.exit_code == 1
    text = str(err)
    assert text.startswith("rank 1 made no progress for 90 s (phase save (last), step 12), no stack from it in 0.5 s"
                           ), text
    assert "rank 0 waited for it past dist.timeout (1 min) at step 12" in text, text
    assert "pimm resume" in text and "\n" not in text
    other = ValueError("not a timeout")
    assert name_the_hang(other, tmp_path, DistInfo(0, 2, 0), 1.0, 12) is other


def test_the_launcher_names_the_stuck_rank_when_the_ranks_were_aborted(tmp_path: Path):
    """NCCL's watchdog aborts the waiting ranks itself (SIGABRT): no rank writes the error line, so the
    launcher's report adds what the heartbeats say."""
    import signal
    from types import SimpleNamespace

    from pimm_core.launch.torchrun import _failure_report

    now = time.time()
    for r, phase in ((0, "collective"), (1, "data")):
        rank_file(tmp_path, r).parent.mkdir(exist_ok=True)
        rank_file(tmp_path, r).write_text(json.dumps(RankBeat(rank=r, phase=phase, step=9, progress=now - 600,
                                                              updated=now - 1).to_json()))
    failures = {0: SimpleNamespace(exitcode=-signal.SIGABRT), 1: SimpleNamespace(exitcode=-signal.SIGTERM)}
    _, code, line = _failure_report(failures, {}, tmp_path)
    assert code == 1 and line.startswith("error: rank 0 was killed by SIGABRT; rank 1 made no progress for 600 s "
                                         "(phase data, step 9); the run stopped"), line


def test_rank_0_checks_control_stop_every_tenth_of_a_second_as_documented(tmp_path: Path):
    """`pimm stop` used to let ~30 more steps run: rank 0 looked at control/stop once a second. The bound
    docs/stop-resume.md gives (0.1 s) is the poll interval the trainer uses."""
    import torch

    from pimm_core.process.stop import StopRequest, write_stop_file
    from pimm_core.train.stop_agreement import StopAgreement

    agreement = StopAgreement(StopRequest(), DistInfo(0, 1, 0), tmp_path, torch.device("cpu"))
    assert agreement.poll_every_s == 0.1
    doc = (Path(__file__).resolve().parents[2] / "docs" / "stop-resume.md").read_text()
    assert "rank 0 checks it every 0.1 s" in doc
    assert agreement.agree() is None  # polled: nothing asked
    write_stop_file(tmp_path, "operator")
    agreement._last_poll -= agreement.poll_every_s  # the interval has passed
    assert agreement.agree() == "operator"
