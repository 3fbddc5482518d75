"""The memory tier's index files (``memory/<rank>.json``): written atomically, read without raising,
joined into the newest step every rank can reach (its own copy or the one its buddy holds)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from pimm_core.run.memory_index import MemoryCopy, RankMemory, read_memory_tier, write_rank_index
from pimm_core.run.status import read_run_status, write_status


def _own(rank, step, t=1.0):
    return MemoryCopy(rank=rank, step=step, time=t, bytes=10, sha256="ab", epoch=0)


def test_newest_common_step_counts_a_buddy_copy(tmp_path):
    host = socket.gethostname()
    # rank 0 holds steps 8 (own) and 8 of rank 1; rank 1 only reached 4 itself (killed while copying 8)
    write_rank_index(tmp_path, RankMemory(0, host, os.getpid(), "/dev/shm/x/0", _own(0, 8, 5.0),
                                          MemoryCopy(rank=1, step=8, time=6.0, bytes=10, sha256="cd")))
    write_rank_index(tmp_path, {"rank": 1, "host": host, "pid": 2**22 + 12345, "shm": "/dev/shm/x/1",
                                "own": {"step": 4, "epoch": 0, "time": 2.0, "bytes": 10, "sha256": "ef"},
                                "buddy": None})
    tier = read_memory_tier(tmp_path)
    assert tier.step == 8 and tier.time == 6.0 and tier.live
    assert tier.ranks[1].own.step == 4 and tier.ranks[0].buddy.rank == 1
    assert tier.ranks[0].to_json()["buddy"] == {"rank": 1, "step": 8, "time": 6.0, "bytes": 10, "sha256": "cd"}
    # a third rank with nothing: no step every rank reaches
    assert read_memory_tier(tmp_path, world_size=3).step is None


def test_dead_owners_torn_files_and_no_files(tmp_path):
    assert read_memory_tier(tmp_path).step is None and not read_memory_tier(tmp_path).live
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_rank_index(tmp_path, RankMemory(0, socket.gethostname(), dead.pid, None, _own(0, 3), None))
    (tmp_path / "memory" / "1.json").write_text('{"rank": 1, "own": {"st')  # torn
    tier = read_memory_tier(tmp_path)
    assert not tier.live and set(tier.ranks) == {0} and tier.step == 3


def test_status_memory_fields_written_only_when_set(tmp_path):
    write_status(tmp_path, "running", step=3)
    text = (tmp_path / "status.json").read_text()
    assert "memory_step" not in text and "recovery" not in text
    write_status(tmp_path, "running", step=9, memory_step=8, recovery={"tier": "memory", "step": 8, "restart": 1})
    s = read_run_status(tmp_path)
    assert s.memory_step == 8 and s.recovery == {"tier": "memory", "step": 8, "restart": 1} and not s.extra
