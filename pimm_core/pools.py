"""Thread pools started on first use, shared by a module's calls, and started afresh in a forked child.

A ``ThreadPoolExecutor``'s threads do not survive ``fork``: a child (the launcher's fork server
and the ranks forked from it, a DataLoader worker) that submits work to a pool its parent
started queues it for threads it does not have, and waits forever. A :class:`SharedPool`
forgets its executor in a forked child (``os.register_at_fork``), so the child's first use
starts threads of its own; ``after_fork`` callbacks forget other per-process state the same
way (work still pending in the parent's threads, which the child must not wait for).
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class SharedPool:
    """``workers`` threads named ``pimm-<name>``, started at the first :meth:`submit`.

    Args:
        after_fork: called in a forked child after the pool is forgotten (e.g. to drop the
            parent's pending futures).
    """

    def __init__(self, workers: int, name: str, after_fork: Callable[[], None] | None = None) -> None:
        self.workers, self.name, self.after_fork = workers, name, after_fork
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        _pools.add(self)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix=f"pimm-{self.name}")
            return self._executor.submit(fn, *args)

    def _forget(self) -> None:
        self._executor, self._lock = None, threading.Lock()  # (the lock may have been held by a thread that is gone)
        if self.after_fork is not None:
            self.after_fork()


_pools: weakref.WeakSet[SharedPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for pool in list(_pools):
        pool._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
