"""The rank's DataLoader fork server (and so every worker it forks) has the stop signals blocked:
torchrun, a scheduler or a terminal sends SIGTERM/SIGINT to a rank's whole process group at a
stop, and a server killed by it takes the workers with it, so a stopping rank that still needs a
batch failed (``DataLoader worker ... exited unexpectedly``). multiprocessing's resource tracker,
started by the fork server's start, used to unblock SIGINT and SIGTERM inside pimm's block."""

from __future__ import annotations

import signal
import subprocess
import sys

_CODE = """
import multiprocessing.forkserver as fs
from pimm_core.data.workers import worker_context
worker_context("forkserver")  # (pimm_core.process.forkserver.start, as the ranks' fork server is started)
print(fs._forkserver._forkserver_pid)
"""


def _blocked(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    raise AssertionError("no SigBlk line")


def test_the_fork_server_has_the_stop_signals_blocked() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _CODE + "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        server = int(proc.stdout.readline())
        mask = _blocked(server)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
            assert mask & (1 << (sig - 1)), f"{sig.name} is not blocked in the fork server (SigBlk {mask:#x})"
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
