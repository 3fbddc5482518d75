"""At a hang every rank's stack is written to ``ranks/<rank>.stack`` and the error line names the frame
each waits in; a straggler (steps 1.5x the median rank's) is found from the heartbeat files and logged
once. In-process, with real heartbeat files written by :class:`~pimm_core.run.heartbeat.Heartbeat`."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from pimm_core.process.dist import DistInfo
from pimm_core.run import stacks
from pimm_core.run.heartbeat import Heartbeat
from pimm_core.run.ranks import RankBeat, rank_file, read_rank_beats, stragglers
from pimm_core.train.hang import name_the_hang


def _stalled_collective() -> None:
    raise RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms for recv operation")


def test_a_collective_timeout_writes_every_ranks_stack_and_names_their_frames(tmp_path: Path) -> None:
    # rank 1's heartbeat thread, in this process, answers the request with this process's main thread
    hb = Heartbeat(tmp_path, 1, 2, every_s=0.05, refresh_s=60.0).start()
    hb.arm()
    try:
        now = time.time()
        for r, phase in ((0, "collective"), (1, "callback")):
            rank_file(tmp_path, r).write_text(json.dumps(RankBeat(rank=r, phase=phase, step=7, progress=now - 90,
                                                                   updated=now).to_json()))
        try:
            _stalled_collective()
        except RuntimeError as e:
            err = name_the_hang(e, tmp_path, DistInfo(0, 2, 0), 1.0, 7)
    finally:
        hb.close()
    text = str(err)
    here = f"{__file__}:"
    # rank 0: where its collective raised; rank 1: its main thread, here waiting in wait_for_stacks
    assert f"rank 0 waited for it in {here}" in text and "in _stalled_collective past dist.timeout" in text, text
    assert f"rank 1 made no progress for 90 s (phase callback, step 7), waiting in {stacks.__file__}:" in text, text
    assert "in wait_for_stacks;" in text and f"every rank's stack: {tmp_path}/ranks/<rank>.stack" in text, text
    for r in (0, 1):
        body = (tmp_path / "ranks" / f"{r}.stack").read_text()
        assert body.startswith(f"# rank {r} pid ") and "(most recent call last):" in body, body
    assert "_stalled_collective" in (tmp_path / "ranks" / "0.stack").read_text()
    assert stacks.read_stack_frame(tmp_path, 1).endswith("in wait_for_stacks")


class _Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _steps(hb: Heartbeat, clock: _Clock, n: int, work_s: float, start: int = 0) -> None:
    """``n`` optimizer steps of one micro-batch each: ``work_s`` of batch wait and forward, then 0.1 s of
    backward and the stop agreement (where the ranks wait for each other)."""
    for step in range(start + 1, start + n + 1):
        hb.enter("data")
        clock.t += work_s / 2
        hb.enter("forward/backward")
        clock.t += work_s / 2
        hb.forward_done()
        clock.t += 0.1
        hb.enter("collective", "stop agreement")
        hb.at_step(step)


def test_a_straggler_is_found_from_the_heartbeat_files_and_logged_once(tmp_path: Path, caplog) -> None:
    clock = _Clock()
    beats = [Heartbeat(tmp_path, r, 3, refresh_s=0.0) for r in range(3)]
    for hb in beats:
        hb.clock = clock
        hb.arm()
    for hb, work in zip(beats, (0.040, 0.044, 0.050)):  # 1.25x the median: not a straggler
        _steps(hb, clock, 20, work)
        hb._write()
    assert [b.work_s for b in read_rank_beats(tmp_path)] == [b.work_s for b in beats]
    assert beats[0].work_s is not None and abs(beats[0].work_s - 0.040) < 1e-9
    assert stragglers(read_rank_beats(tmp_path)) == []

    _steps(beats[2], clock, 20, 0.070, start=20)  # its last 20 steps: 1.59x rank 1's (the median)
    beats[2]._write()
    found = stragglers(read_rank_beats(tmp_path))
    assert [(b.rank, round(median, 3)) for b, median in found] == [(2, 0.044)]
    with caplog.at_level(logging.WARNING, logger="pimm"):
        beats[0]._log_stragglers()
        beats[0]._log_stragglers()  # still slow: not logged again
    lines = [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()]
    assert lines == ["warning: rank 2 is a straggler: its steps take 1.6x the median rank's (batches and forward: "
                     "0.070 s vs 0.044 s per step over its last 20 steps)"], lines


def test_too_few_steps_or_an_ended_rank_is_no_straggler(tmp_path: Path) -> None:
    clock = _Clock()
    beats = [Heartbeat(tmp_path, r, 2) for r in range(2)]
    for hb, work in zip(beats, (0.01, 0.5)):
        hb.clock = clock
        hb.arm()
        _steps(hb, clock, 19, work)  # one step short of the window
        hb._write()
    assert all(b.work_s is None for b in read_rank_beats(tmp_path))
    assert stragglers(read_rank_beats(tmp_path)) == []
    for hb in beats:
        _steps(hb, clock, 1, 0.5 if hb.rank else 0.01, start=19)
        hb._write()
    assert [b.rank for b, _ in stragglers(read_rank_beats(tmp_path))] == [1]
    beats[1].close()  # phase end
    assert stragglers(read_rank_beats(tmp_path)) == []


def _no_batch() -> None:
    from pimm_core.data.loaders import DataTimeoutError

    raise DataTimeoutError("rank 0: no batch from its 2 DataLoader workers in 5 s (data.timeout); ...")


def test_a_data_timeout_writes_the_ranks_stack_and_names_its_frame(tmp_path: Path) -> None:
    try:
        _no_batch()
    except Exception as e:
        err = name_the_hang(e, tmp_path, DistInfo(0, 1, 0), 1.0, 3)
    text = str(err)
    assert text.startswith("rank 0: no batch from its 2 DataLoader workers in 5 s (data.timeout)"), text
    assert f"; rank 0 waits in {__file__}:" in text and "in _no_batch;" in text, text
    assert stacks.read_stack_frame(tmp_path, 0).endswith("in _no_batch")
