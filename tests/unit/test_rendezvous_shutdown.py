"""The c10d rendezvous wrapper (pimm_core/launch/rendezvous.py): the agent that hosts the
store leaves only after every node has closed the rendezvous, so no agent's close finds
the store gone (the stack trace a multi-node run used to print after a clean stop)."""

import threading
from datetime import timedelta
from types import SimpleNamespace

from torch.distributed import TCPStore

from pimm_core.launch.rendezvous import BACKEND, HostLeavesLast, use_ordered_shutdown


class _Handler:
    """torch's DynamicRendezvousHandler as the wrapper sees it: two nodes, one close each."""

    def __init__(self):
        self.closed = threading.Event()

    def next_rendezvous(self):
        return SimpleNamespace(world_size=2)

    def get_run_id(self):
        return "job"

    def shutdown(self):
        self.closed.set()
        return True


def _stores():
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=10))
    return host, client


def test_store_host_waits_for_the_other_node_to_close():
    host_store, client_store = _stores()
    # limits far above the waits below: a node that waited for its limit fails them
    host = HostLeavesLast(_Handler(), host_store, hosts_store=True, wait_s=600)
    other = HostLeavesLast(_Handler(), client_store, hosts_store=False, wait_s=600)
    for h in (host, other):
        h.next_rendezvous()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (host.shutdown(), done.set()))
    thread.start()
    assert not done.wait(1.0), "the host left before the other node closed the rendezvous"
    assert other.shutdown() is True  # the other node closes and counts itself out, then leaves
    assert done.wait(60), "the host kept waiting after every node had closed"
    thread.join()


def test_other_nodes_do_not_wait_and_a_missing_node_only_delays_the_host():
    host_store, client_store = _stores()
    other = HostLeavesLast(_Handler(), client_store, hosts_store=False, wait_s=600)
    other.next_rendezvous()
    finished = threading.Event()
    threading.Thread(target=lambda: (other.shutdown(), finished.set()), daemon=True).start()
    assert finished.wait(60), "a node that does not host the store waited at shutdown"
    host = HostLeavesLast(_Handler(), host_store, hosts_store=True, wait_s=0.5)
    # the host is the second of two: both counted, it returns at once; a third never comes
    host._nodes = 3
    returned = threading.Event()
    threading.Thread(target=lambda: (host.shutdown(), returned.set()), daemon=True).start()
    assert returned.wait(60), "a node that never closed kept the host waiting past its limit"


def test_only_the_c10d_backend_is_switched():
    args = SimpleNamespace(rdzv_backend="static")
    use_ordered_shutdown(args)
    assert args.rdzv_backend == "static"
    args = SimpleNamespace(rdzv_backend="c10d")
    use_ordered_shutdown(args)
    assert args.rdzv_backend == BACKEND
    use_ordered_shutdown(SimpleNamespace(rdzv_backend="c10d"))  # registering twice is fine
