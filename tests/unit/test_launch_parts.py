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


RDZV = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"


def test_rdzv_conf_reaches_torch_s_rendezvous_and_is_recorded():
    """``--rdzv-conf`` as torchrun takes it: parsed by torchrun's own parser and read by torch's c10d
    rendezvous handler (the one a one-node launch's ``--standalone`` creates), recorded with the launch and
    reused by a resume unless given again."""
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
    from torch.distributed.run import get_args_parser

    from pimm_core.launch.options import strip_launcher_flags

    opts = LaunchOptions(nproc_per_node=2, max_restarts=1, rdzv_conf=RDZV)
    opts.check()
    args = get_args_parser().parse_args([*opts.torchrun_args(), "--module", "x"])
    assert args.standalone and args.rdzv_conf == RDZV
    # what torchrun's run() does for --standalone, then its config_from_args and launch_agent
    handler = rendezvous_handler_registry.create_handler(RendezvousParameters(
        backend="c10d", endpoint="localhost:0", run_id="t", min_nodes=1, max_nodes=1,
        **_parse_rendezvous_config(args.rdzv_conf)))
    try:
        settings = handler.settings
        assert settings.timeout.last_call == timedelta(seconds=5)
        assert settings.keep_alive_interval == timedelta(seconds=1) and settings.keep_alive_max_attempt == 3
    finally:
        handler.shutdown()
    assert opts.record()["rdzv_conf"] == RDZV
    assert LaunchOptions.recorded(opts.record(), LaunchOptions()).rdzv_conf == RDZV
    assert LaunchOptions.recorded(opts.record(), LaunchOptions(rdzv_conf="join_timeout=60")).rdzv_conf == \
        "join_timeout=60"
    assert "--rdzv-conf" not in LaunchOptions(nproc_per_node=2).torchrun_args()  # torch's defaults then
    assert strip_launcher_flags(["--rdzv-conf", RDZV, "--rdzv-conf=x=1", "--", "a=1"]) == ["--", "a=1"]


@pytest.mark.parametrize("conf, message", [
    ("last_call_timeout", "--rdzv-conf must be KEY=VALUE,... (got 'last_call_timeout': The rendezvous "
                          "configuration option 'last_call_timeout' must have a value specified.)"),
    ("=5", "--rdzv-conf must be KEY=VALUE"),
    ("last_call_timout=5", "--rdzv-conf: 'last_call_timout' is not a key torch's rendezvous reads (it would be "
                           "ignored); use join_timeout, last_call_timeout,"),
    ("keep_alive_interval=0", "--rdzv-conf: keep_alive_interval must be a whole number of seconds >= 1 (got '0')"),
    ("last_call_timeout=2.5", "--rdzv-conf: last_call_timeout must be a whole number of seconds >= 1 (got '2.5')"),
    ("keep_alive_max_attempt=-1", "--rdzv-conf: keep_alive_max_attempt must be a whole number >= 1 (got '-1')"),
    ("cas_backoff_max_seconds=inf", "--rdzv-conf: cas_backoff_max_seconds must be a number of seconds >= 0"),
    ("is_host=maybe", "--rdzv-conf: is_host must be true or false (got 'maybe')"),
    ("store_type=redis", "--rdzv-conf: store_type must be tcp|file (got 'redis')"),
])
def test_a_malformed_rdzv_conf_is_refused(conf, message):
    with pytest.raises(UsageError) as e:
        LaunchOptions(nproc_per_node=2, rdzv_conf=conf).check()
    assert str(e.value).startswith(message), str(e.value)


def test_rdzv_conf_of_another_backend_is_checked_for_its_syntax_only():
    LaunchOptions(rdzv_backend="etcd-v2", rdzv_endpoint="h:2379", rdzv_conf="protocol=https").check()
    with pytest.raises(UsageError, match="must be KEY=VALUE"):
        LaunchOptions(rdzv_backend="etcd-v2", rdzv_endpoint="h:2379", rdzv_conf="protocol").check()
    LaunchOptions(nproc_per_node=1, rdzv_conf="is_host=Yes,store_type=File,cas_backoff_max_seconds=0.5").check()
