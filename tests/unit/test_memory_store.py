"""The memory tier's shared-memory store: a copy counts only once complete (its sidecar written after
its bytes), a damaged copy fails its sha256 check, a newer complete round drops the older steps, and
the tiers of dead runs are removed by the next run on the node while live ones are kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pimm_core.checkpoint.memory.exchange import buddy_of, held_by_me
from pimm_core.checkpoint.memory.store import RankStore, remove_stale, run_root


@pytest.fixture
def shm(tmp_path, monkeypatch):
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setenv("PIMM_SHM_ROOT", str(root))
    return root


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_complete_copies_checksums_and_rounds(shm, tmp_path):
    store = RankStore(tmp_path / "run", 1)
    store.open(agent_pid=_dead_pid())
    store.write(1, 3, b"own state", epoch=0)
    store.write(0, 3, b"buddy state")
    (store.dir / "step_6").mkdir()
    (store.dir / "step_6" / ".rank_1.pt.tmp").write_bytes(b"half")  # killed while writing step 6
    held = {(h.copy.rank, h.copy.step): h for h in store.held()}
    assert set(held) == {(1, 3), (0, 3)} and store.read(held[(1, 3)]) == b"own state"
    held[(0, 3)].path.write_bytes(b"buddy stat3")  # same size, other bytes
    with pytest.raises(ValueError, match="sha256"):
        store.read(held[(0, 3)])
    store.write(1, 6, b"newer")
    store.keep_only(6)
    assert [(h.copy.rank, h.copy.step) for h in store.held()] == [(1, 6)]
    store.close(remove=True)
    assert not run_root(tmp_path / "run").exists()


def test_stale_tiers_of_dead_runs_are_removed_live_ones_kept(shm, tmp_path):
    dead = RankStore(tmp_path / "dead", 0)
    dead.open(agent_pid=_dead_pid())
    dead.write(0, 3, b"x")
    dead.close(remove=False)  # (as a killed rank leaves it: lock free, agent gone)
    held = RankStore(tmp_path / "held", 0)
    held.open(agent_pid=_dead_pid())  # its rank is alive (this process holds the lock)
    agent = RankStore(tmp_path / "agent", 0)
    agent.open(agent_pid=_dead_pid())
    agent.close(remove=False)
    owner = json.loads((agent.root / "owner.json").read_text())
    owner["agent_pid"] = os.getpid()  # its launcher lives: between a failure and the restart
    (agent.root / "owner.json").write_text(json.dumps(owner))
    (shm / "pimm-not-ours").mkdir()  # no owner file, no lock: not recognisably pimm's
    assert remove_stale() == [dead.root]
    assert held.root.exists() and agent.root.exists() and (shm / "pimm-not-ours").exists()
    held.close(remove=True)


def test_buddies_are_on_the_next_node_or_the_next_local_rank():
    assert [buddy_of(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]  # two nodes of two
    assert [buddy_of(r, 3, 3) for r in range(3)] == [1, 2, 0]  # one node
    assert buddy_of(0, 1, 1) is None
    assert all(held_by_me(buddy_of(r, 8, 4), 8, 4) == r for r in range(8))


def test_sharded_state_is_accepted(tmp_path):
    """FSDP and tensor parallel keep each rank's own shards in the memory tier (tests/e2e/test_memory_sharded.py)."""
    from pimm_core.config import load_config

    from pathlib import Path

    digits = Path(__file__).resolve().parents[2] / "configs" / "digits.toml"
    for change in ("train.strategy=fsdp", "parallel.tp=2"):
        assert load_config(digits, [change, "checkpoint.memory_every_steps=3"]).checkpoint.memory_every_steps == 3
