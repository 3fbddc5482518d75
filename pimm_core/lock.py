"""One writer per run directory.

``pimm launch`` (rank 0) holds an exclusive ``filelock`` on ``<run>/.lock`` for the
whole run. The lock is an OS-level ``flock``: when the holder dies, even by
``kill -9``, the kernel releases it, so a stale lock never blocks a resume. Who holds
it (host, pid, start time) is written to ``<run>/lock.json`` for the refusal message.
Torch-free.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from filelock import FileLock, Timeout

from .checkpoint.atomic import atomic_write_bytes
from .errors import UsageError
from .run import now_iso, read_json

LOCK = ".lock"
HOLDER = "lock.json"


class RunLock:
    """Exclusive, non-blocking lock of a run directory.

    Raises (from :meth:`acquire`):
        UsageError: another live process holds it; the message names host and pid.
    """

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._lock = FileLock(str(self.run_dir / LOCK))

    def acquire(self) -> "RunLock":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            holder = read_json(self.run_dir / HOLDER) or {}
            who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {holder.get('since', '?')})"
            raise UsageError(f"{self.run_dir} is in use by {who}; stop that run first "
                             f"(pimm stop {self.run_dir}) or choose another --run.name") from None
        atomic_write_bytes(self.run_dir / HOLDER, json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(), "since": now_iso()}).encode(), durable=False)
        return self

    def release(self) -> None:
        if self._lock.is_locked:
            (self.run_dir / HOLDER).unlink(missing_ok=True)
            self._lock.release()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
