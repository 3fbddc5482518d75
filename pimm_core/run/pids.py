"""Whether a process of this host is alive: the one check behind the run lock's holder, the memory
tier's owners and the console's "rank 0 exists" (torch-free)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """``pid`` exists on this host and, where ``/proc`` tells, is not a zombie (dead, not yet reaped).
    A process of another user counts as alive."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return not os.path.isdir("/proc/self") and _signalable(pid)
    except (OSError, IndexError):
        return _signalable(pid)


def _signalable(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        pass
    return True
