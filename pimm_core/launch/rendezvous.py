"""torchrun's ``c10d`` rendezvous, with the node that hosts the store leaving last.

With ``--rdzv-backend c10d`` one node's agent hosts the TCP store that every agent's
rendezvous state lives in. At the end of a run each agent closes the rendezvous
(``DynamicRendezvousHandler.shutdown``: a compare-and-set on that store). torchrun does
not order the agents' exits, so the hosting agent can leave first and take the store with
it; a slower agent's close then fails with a C++ warning and a 60-line stack trace printed
after a clean stop ("recvVector failed ... Did the remote server shutdown or crash?",
pytorch/pytorch#153586 made the message clearer, not the race rarer).

:class:`HostLeavesLast` wraps torch's handler: after its own close each agent adds one to a
counter on the store, and the agent that hosts the store waits (at most
:data:`CLOSE_WAIT_S`) until every node of the rendezvous has counted itself out. A node
killed outright never counts itself out: the host then leaves after the wait.
"""

from __future__ import annotations

import time

CLOSE_WAIT_S = 15.0
BACKEND = "pimm-c10d"  # the name torchrun is given; users and the recorded launch say ``c10d``


def use_ordered_shutdown(args) -> None:
    """Switch parsed torchrun ``args`` from the ``c10d`` backend to :class:`HostLeavesLast`."""
    if args.rdzv_backend != "c10d":
        return  # `static` (torchrun's default) closes nothing at the end
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    registry.register(BACKEND, _create)  # registering the same creator again is a no-op
    args.rdzv_backend = BACKEND


def _create(params):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    backend, store, hosts_store = _c10d_backend(params)
    return HostLeavesLast(create_handler(store, backend, params), store, hosts_store)


def _c10d_backend(params):
    """torch's ``c10d_rendezvous_backend.create_backend``, also saying whether this process
    hosts the store. The same rule as torch's: host it if the endpoint names this machine,
    and fall back to a client when another process on this machine got there first."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

    host, _ = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    tries = [True, False] if _matches_machine_hostname(host) else [False]
    for is_host in tries:
        config = {**params.config, "is_host": is_host}
        explicit = RendezvousParameters(params.backend, params.endpoint, params.run_id, params.min_nodes,
                                        params.max_nodes, params.local_addr, **config)
        try:
            backend, store = create_backend(explicit)
            return backend, store, is_host
        except Exception:
            if not is_host:
                raise
    raise AssertionError("unreachable")


class HostLeavesLast:
    """A rendezvous handler (torch's ``RendezvousHandler`` interface) that delegates to
    torch's ``DynamicRendezvousHandler`` and orders the agents' exits at shutdown."""

    def __init__(self, inner, store, hosts_store: bool, wait_s: float = CLOSE_WAIT_S):
        self._inner, self._store, self._hosts_store, self._wait_s = inner, store, hosts_store, wait_s
        self._nodes = 0

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self):
        info = self._inner.next_rendezvous()
        self._nodes = info.world_size  # agents (nodes) in this round
        return info

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        closed = self._inner.shutdown()
        if self._nodes:
            key = f"pimm/closed/{self.get_run_id()}"
            try:
                left = self._store.add(key, 1)
                deadline = time.monotonic() + self._wait_s
                while self._hosts_store and left < self._nodes and time.monotonic() < deadline:
                    time.sleep(0.05)
                    left = self._store.add(key, 0)
            except Exception:  # the store is gone (its host was killed): nothing left to order
                pass
        return closed
