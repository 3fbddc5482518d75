"""The intra-op thread choice (:mod:`pimm_core.process.threads`) from real inputs: the affinity mask set with
``os.sched_setaffinity`` in a child process, cgroup v1/v2 files in a directory of the test's own, the
environment a launcher gives. ``pimm launch``'s use of it: tests/e2e/test_threads_startup.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pimm_core.process.threads import SMALL_MODEL, USER_OMP_ENV, cgroup_quota, choose_threads, local_ranks

BIG = SMALL_MODEL * 4  # parameters of a model the automatic rule gives the usable CPUs


def _cgroup(tmp_path: Path, files: dict[str, str], own: str = "0::/") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    root.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(own + "\n")
    return root, proc


def test_cgroup_v2_quota_is_read_and_the_tightest_ancestor_wins(tmp_path):
    assert cgroup_quota(*_cgroup(tmp_path / "a", {"cpu.max": "150000 100000"})) == 1.5
    assert cgroup_quota(*_cgroup(tmp_path / "b", {"cpu.max": "max 100000"})) is None
    assert cgroup_quota(*_cgroup(tmp_path / "c", {})) is None  # no controller files: no quota
    nested = _cgroup(tmp_path / "d", {"cpu.max": "400000 100000", "job/step/cpu.max": "50000 100000"}, "0::/job/step")
    assert cgroup_quota(*nested) == 0.5


def test_cgroup_v1_quota_is_read(tmp_path):
    v1 = {"cpu/cpu.cfs_quota_us": "250000", "cpu/cpu.cfs_period_us": "100000"}
    assert cgroup_quota(*_cgroup(tmp_path / "a", v1, "4:cpu,cpuacct:/")) == 2.5
    unlimited = {"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"}
    assert cgroup_quota(*_cgroup(tmp_path / "b", unlimited, "4:cpu,cpuacct:/")) is None


def test_explicit_settings_win_in_order(tmp_path):
    root, proc = _cgroup(tmp_path, {})
    kw = dict(affinity=8, cgroup_root=root, proc_cgroup=proc)
    assert choose_threads(3, BIG, env={"OMP_NUM_THREADS": "5"}, **kw).source == "train.threads"
    assert choose_threads(3, BIG, env={"OMP_NUM_THREADS": "5"}, **kw).threads == 3
    user = choose_threads(None, 10, env={"OMP_NUM_THREADS": "5", USER_OMP_ENV: "1"}, **kw)
    assert (user.threads, user.source) == (5, "OMP_NUM_THREADS")
    # pimm launch set OMP_NUM_THREADS=1 for torchrun, not the user: the rank chooses
    mine = choose_threads(None, BIG, env={"OMP_NUM_THREADS": "1", USER_OMP_ENV: "0", "LOCAL_WORLD_SIZE": "2"}, **kw)
    assert (mine.threads, mine.source) == (4, "auto")


def test_automatic_choice_divides_the_usable_cpus_among_local_ranks_and_gives_small_models_one(tmp_path):
    root, proc = _cgroup(tmp_path, {"cpu.max": "300000 100000"})  # a quota of 3 CPUs
    kw = dict(cgroup_root=root, proc_cgroup=proc)
    assert choose_threads(None, BIG, env={}, affinity=8, **kw).threads == 3  # the quota caps the affinity
    assert choose_threads(None, BIG, env={"LOCAL_WORLD_SIZE": "2"}, affinity=8, **kw).threads == 1  # 3 // 2
    assert choose_threads(None, BIG, env={"LOCAL_WORLD_SIZE": "4"}, affinity=8, **kw).threads == 1  # never 0
    assert choose_threads(None, BIG, env={"LOCAL_WORLD_SIZE": "2"}, affinity=2, **kw).threads == 1
    small = choose_threads(None, SMALL_MODEL - 1, env={}, affinity=8, **kw)
    assert small.threads == 1 and small.small_model
    text = choose_threads(None, BIG, env={"LOCAL_WORLD_SIZE": "2"}, affinity=2, **kw).describe()
    assert text == "threads: 1 per rank (2 CPUs usable: affinity 2, cgroup quota 3 CPUs; 2 local ranks)"


def test_slurm_tasks_on_this_node_are_the_local_ranks():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}
    assert local_ranks({**env, "SLURM_NODEID": "1"}) == 2
    assert local_ranks({**env, "SLURM_NODEID": "3"}) == 1
    assert local_ranks({"LOCAL_WORLD_SIZE": "4", **env}) == 4  # torchrun's own count first
    assert local_ranks({}) == 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity masks on this OS")
def test_the_affinity_mask_of_the_process_is_what_is_divided(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    root, proc = _cgroup(tmp_path, {})
    child = f"""
import json, os, sys
from pathlib import Path
from pimm_core.process.threads import choose_threads
out = {{}}
for n in sorted({{1, {len(cpus)}}}):
    os.sched_setaffinity(0, {cpus}[:n])
    c = choose_threads(None, {BIG}, env={{}}, cgroup_root=Path({str(root)!r}), proc_cgroup=Path({str(proc)!r}))
    out[n] = [c.affinity, c.threads]
print(json.dumps(out))
"""
    got = json.loads(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout)
    assert got["1"] == [1, 1]
    assert got[str(len(cpus))] == [len(cpus), len(cpus)]
