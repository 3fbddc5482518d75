"""The memory tier across a world-size change, in this process: which step a restart can recover and
who reads which copy (:func:`plan_recovery`, the plan every rank computes from the same all-gather),
the copies of every rank directory on a node (a restart may number the ranks of a node anew), and the
directories of a larger world removed once the smaller world's first round replaced them. The real
restart (a node lost for good, two torchrun agents) is tests/e2e/test_memory_elastic.py."""

from __future__ import annotations

import os
import socket

import pytest

from pimm_core.checkpoint.memory.store import RankStore
from pimm_core.run.memory_index import MemoryCopy, RankMemory, read_memory_tier, write_rank_index
from pimm_core.train.memory_recovery import NoCommonStep, Source, describe_reads, newest_tier, plan_recovery
from pimm_core.watch.tiers import recovery_text


def _copies(world: int, step: int, *pairs: tuple[int, int]) -> list[tuple[int, int, int, str, int]]:
    """``(owner, kept_by)`` pairs as a node lists them: ``(saved_world, owner, step, sha256, kept_by)``."""
    return [(world, owner, step, f"sha-{world}-{owner}-{step}", kept_by) for owner, kept_by in pairs]


def test_a_restart_takes_the_tier_with_the_newest_step_and_memory_on_a_tie():
    # (memory's newest step every rank can reach, the disk last's step) -> the tier recovered from
    assert newest_tier(6, 7) == "disk"  # a disk save after the newest memory snapshot keeps its step
    assert newest_tier(6, 6) == "memory"  # a tie: memory, it is faster
    assert newest_tier(6, 4) == "memory"
    assert newest_tier(6, None) == "memory"  # nothing on disk
    assert newest_tier(None, 4) == "disk"  # no step in memory
    assert newest_tier(None, None) is None


def test_the_log_names_the_copy_each_rank_read_on_its_own_node():
    # 3 nodes of 2 ranks, node C (old ranks 4, 5) lost; the restart numbers node B first: new ranks 0, 1
    # there hold old rank 0's copy as its buddy (rank 2's directory), new ranks 2, 3 on node A its own
    node_a = _copies(6, 6, (0, 0), (1, 1), (4, 0), (5, 1))
    node_b = _copies(6, 6, (2, 2), (3, 3), (0, 2), (1, 3))
    plan = plan_recovery([node_b, node_b, node_a, node_a], world=4)
    assert plan.needs == {r: 0 for r in range(4)} and plan.sources[0].kept_by == 2  # (the plan's lowest holder)
    from_buddy, how = describe_reads(plan, {0: 2, 1: 2, 2: 0, 3: 0}, world=4)
    assert from_buddy == {0: 2}
    assert how == ("world size 6 -> 4: every rank from rank 0's copy "
                   "(its own; new rank 0, 1 read the one held by its buddy rank 2)")
    assert describe_reads(plan, dict.fromkeys(range(4), 0), world=4) == \
        ({}, "world size 6 -> 4: every rank from rank 0's copy (its own)")
    same = plan_recovery([node_a + node_b] * 6, world=6)
    assert describe_reads(same, {0: 0, 1: 1, 2: 2, 3: 3, 4: 0, 5: 1}, world=6) == \
        ({4: 0, 5: 1}, "rank 4 from its buddy rank 0; rank 5 from its buddy rank 1")


def test_the_same_world_size_loads_each_ranks_own_state():
    # one node, 2 ranks: rank 1's own copy of step 6 lost, the one rank 0 kept for it is on the node
    node = _copies(2, 6, (0, 0), (1, 0)) + _copies(2, 3, (0, 0), (1, 1), (0, 1), (1, 0))
    plan = plan_recovery([node, node], world=2)
    assert (plan.step, plan.saved_world, plan.needs) == (6, 2, {0: 0, 1: 1})
    assert plan.sources[1] == Source(holder=1, kept_by=0, sha256="sha-2-1-6")  # read on its node, no transfer


def test_a_node_lost_for_good_leaves_every_rank_of_the_old_world_on_the_survivor():
    # 2 nodes of 1 rank: node B (rank 0) lost; node A (old rank 1) kept rank 0's copy as its buddy
    survivor = _copies(2, 6, (1, 1), (0, 1)) + _copies(2, 3, (1, 1))
    plan = plan_recovery([survivor], world=1)
    assert (plan.step, plan.saved_world, plan.needs) == (6, 2, {0: 0})  # every new rank: old rank 0's copy
    assert plan.sources == {0: Source(holder=0, kept_by=1, sha256="sha-2-0-6")}


def test_a_new_rank_without_the_copy_on_its_node_gets_it_from_the_lowest_holder():
    # 3 nodes of 2 ranks (buddy of r: r + 2) -> 2 nodes: node X (old ranks 0-1) lost. Node Y (old ranks 2-3,
    # now 0-1) kept the copies of 0-1; node Z (old 4-5, now 2-3) holds its own and those of 2-3
    y = _copies(6, 9, (2, 2), (3, 3), (0, 2), (1, 3))
    z = _copies(6, 9, (4, 4), (5, 5), (2, 4), (3, 5))
    plan = plan_recovery([y, y, z, z], world=4)
    assert plan.needs == {0: 0, 1: 0, 2: 0, 3: 0} and plan.local[0] == {0, 1}
    assert plan.sources[0] == Source(holder=0, kept_by=2, sha256="sha-6-0-9")  # ranks 2, 3 receive it from rank 0
    # rank 5's own copy damaged too (its buddy's was on node X): no step every old rank reaches
    with pytest.raises(NoCommonStep, match=r"\(rank 5 has no copy of step 9 at the previous world size 6\)"):
        plan_recovery([y, y, z[:1] + z[2:], z[:1] + z[2:]], world=4)


def test_the_newest_reachable_step_wins_and_the_current_world_at_a_tie():
    # world 2 reached step 9 except rank 1's copy; step 6 complete. Then a step taken again at world 1.
    node = _copies(2, 9, (0, 0)) + _copies(2, 6, (0, 0), (1, 0))
    assert plan_recovery([node], world=1).step == 6
    tie = node + _copies(1, 6, (0, 0))
    plan = plan_recovery([tie], world=1)
    assert (plan.step, plan.saved_world, plan.sources[0].sha256) == (6, 1, "sha-1-0-6")
    with pytest.raises(NoCommonStep, match=r"no step every rank can reach in memory \(no copy on any node\)"):
        plan_recovery([[]], world=1)


def test_a_grown_world_gives_the_new_ranks_rank_0s_copy():
    plan = plan_recovery([_copies(1, 3, (0, 0)), []], world=2)
    assert plan.needs == {0: 0, 1: 0} and plan.sources[0].holder == 0 and plan.local[0] == {0}


def test_a_node_lists_every_rank_directory_and_a_smaller_world_removes_the_larger_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("PIMM_SHM_ROOT", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    run = tmp_path / "run"
    old = [RankStore(run, r) for r in range(4)]
    for r, store in enumerate(old):
        store.open(agent_pid=os.getpid())
        store.write(r, 6, b"state %d" % r, epoch=0, world=4)
    for r in (1, 2):
        old[r].close(remove=False)  # killed: their locks free (rank 3's still held: a live process)
    new = RankStore(run, 1)  # after the restart at 2 ranks: rank 1 is another process on this node
    new.open(agent_pid=os.getpid())
    listed = {kept_by: [(h.copy.rank, h.copy.step, h.copy.world) for h in held]
              for kept_by, held in old[0].held_on_node().items()}
    assert listed == {r: [(r, 6, 4)] for r in range(4)}
    old[0].write(0, 9, b"the smaller world's", world=2)
    old[0].keep_only(9, world=2)  # its first complete round at 2 ranks: rank 2's directory goes, held 3 stays
    names = sorted(p.name for p in old[0].root.iterdir() if p.name != "owner.json")
    assert names == ["0", "0.lock", "1", "1.lock", "3", "3.lock"]
    assert [(h.copy.step, h.copy.world) for h in old[0].held()] == [(9, 2)]
    for store in (new, old[3], old[0]):
        store.close(remove=True)
    assert not old[0].root.exists()


def test_the_copies_record_their_world_size_and_readers_use_it(tmp_path):
    host = socket.gethostname()
    copy = MemoryCopy(rank=0, step=6, time=1.0, bytes=3, sha256="ab", epoch=0, world=2)
    assert MemoryCopy.from_json(copy.to_json(own=True), 0) == copy
    # rank 1's index file is gone (its node lost): the copies still say there were 2 ranks
    write_rank_index(tmp_path, RankMemory(0, host, os.getpid(), None, copy, None))
    assert read_memory_tier(tmp_path).step is None
    write_rank_index(tmp_path, RankMemory(0, host, os.getpid(), None, copy,
                                          MemoryCopy(rank=1, step=6, time=2.0, bytes=3, sha256="cd", world=2)))
    assert read_memory_tier(tmp_path).step == 6


def test_the_console_says_the_world_size_changed():
    recovery = {"tier": "memory", "step": 6, "restart": 1, "saved_world_size": 2, "world_size": 1}
    assert recovery_text(recovery) == "recovered from memory at step 6 (restart 1; world size 2 -> 1)"
    assert recovery_text({**recovery, "world_size": 2}) == "recovered from memory at step 6 (restart 1)"


def test_a_reshard_that_the_nodes_free_memory_cannot_hold_goes_to_disk_and_says_why():
    """Sharded state at another world size: each rank reads every old rank's copy. Where that (twice the
    whole state: the bytes, then their tensors) is more than a rank's share of its node's free memory, the
    ranks take the disk ``last`` (the reason in one line) instead of running the node out of memory."""
    from pimm_core.train.memory_reshard import available_bytes, too_big

    free = available_bytes()
    assert free is not None and free > 0  # (this machine's /proc/meminfo)
    gib = 2**30
    assert too_big(3 * gib, [8 * gib, 7 * gib]) is None  # 6 GiB needed: both ranks' shares hold it
    why = too_big(3 * gib, [8 * gib, 5 * gib])
    assert why is not None and "rank 1" in why and "6.00 GiB" in why and "5.00 GiB" in why, why
    assert too_big(3 * gib, [None, None]) is None  # not known: not refused
