"""Launch parts without processes: the multi-node launcher's run-lock check and the
recorded launch a resume reuses."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest

from pimm_core.errors import UsageError
from pimm_core.launch.options import LaunchOptions
from pimm_core.process.lock import LOCK, LauncherLock

TWO_NODES = {"launcher": "pimm", "nproc_per_node": 1, "nnodes": "2", "rdzv_endpoint": "node0:29500",
             "rdzv_backend": "c10d"}


def _hold(path, seconds: float | None) -> int:
    """Take ``path``'s flock on a descriptor of its own, as another process's check would;
    released after ``seconds`` (never, for None). Returns the descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if seconds is not None:
        threading.Timer(seconds, os.close, args=(fd,)).start()
    return fd


def test_another_nodes_check_in_progress_does_not_refuse_a_multinode_launch(tmp_path):
    _hold(tmp_path / LOCK, 0.3)  # node 1's launcher checking the run at the same moment
    LauncherLock(tmp_path, single_node=False).acquire()  # waits it out


def test_a_multinode_launch_refuses_a_run_held_for_longer(tmp_path, monkeypatch):
    monkeypatch.setattr(LauncherLock, "CHECK_PATIENCE", 0.3)
    fd = _hold(tmp_path / LOCK, None)  # a live run's rank 0
    try:
        with pytest.raises(UsageError, match="is in use by"):
            LauncherLock(tmp_path, single_node=False).acquire()
    finally:
        os.close(fd)


def test_a_one_node_launch_refuses_a_held_run_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(LauncherLock, "CHECK_PATIENCE", 60.0)  # not used on one node
    fd = _hold(tmp_path / LOCK, None)
    try:
        with pytest.raises(UsageError, match="is in use by"):
            LauncherLock(tmp_path, single_node=True).acquire()
    finally:
        os.close(fd)


def test_a_resume_on_one_node_drops_the_recorded_rendezvous():
    opts = LaunchOptions.recorded(TWO_NODES, LaunchOptions(nproc_per_node=2, nnodes="1"))
    assert opts.record() == {"launcher": "pimm", "nproc_per_node": 2, "nnodes": "1"}
    assert opts.world_size() == 2


def test_a_resume_on_two_nodes_keeps_the_recorded_launch_and_takes_the_flags_given():
    opts = LaunchOptions.recorded(TWO_NODES, LaunchOptions(node_rank=1, rdzv_endpoint="node3:29400"))
    assert (opts.nnodes, opts.nproc_per_node, opts.rdzv_backend, opts.rdzv_endpoint, opts.node_rank) == (
        "2", 1, "c10d", "node3:29400", 1)
    assert LaunchOptions.recorded(TWO_NODES, LaunchOptions()).rdzv_endpoint == "node0:29500"


def test_max_restarts_reaches_torchrun_and_is_recorded():
    from pimm_core.errors import UsageError
    from pimm_core.launch.options import LaunchOptions, strip_launcher_flags

    assert LaunchOptions(nproc_per_node=2).torchrun_args()[2:4] == ["--max-restarts", "0"]
    opts = LaunchOptions(nproc_per_node=2, max_restarts=3)
    assert opts.torchrun_args()[2:4] == ["--max-restarts", "3"] and opts.record()["max_restarts"] == 3
    assert LaunchOptions(max_restarts=1).wants_spawn()  # one rank: torchrun's agent restarts it
    assert strip_launcher_flags(["--max-restarts", "2", "--train.config", "x"]) == ["--train.config", "x"]
    with pytest.raises(UsageError, match="--max-restarts must be 0 or more"):
        LaunchOptions(max_restarts=-1).check()
