"""Named fail points for crash-consistency testing.

``point("standard.after_weights")`` does nothing unless the environment variable
``PIMM_FAILPOINT`` names that point, optionally with the hit count at which to fire
(``standard.after_weights@2``), and optionally an action after ``=``: ``kill``
(default: SIGKILL this process, like a power cut or the OOM killer), ``enospc``
/ ``eio`` (raise that OSError, like a full disk or a failing device) or ``sigterm`` /
``sigint`` / ``sighup`` (send that signal to this process: a stop asked at exactly that
moment, e.g. during start-up at ``launch.starting``). A count ending in ``+``
(``status.write@3+=enospc``) fires at that hit and every later one (a disk that stays
full). With
``PIMM_FAILPOINT_RANK=<r>`` it fires only in the process whose ``RANK`` is ``r`` (one
rank's disk or node failing while the others carry on). The list of
points a save passes through is :data:`POINTS`; ``benchmarks/crash_points.py`` and the
tests kill a real saving process at each of them.
"""

from __future__ import annotations

import errno
import os
import signal

_SPEC = os.environ.get("PIMM_FAILPOINT", "")
if os.environ.get("PIMM_FAILPOINT_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
    _SPEC = ""  # another rank's fail point
_hits: dict[str, int] = {}

POINTS: list[str] = []  # every point name, registered at import by the modules that use them


def register(*names: str) -> None:
    POINTS.extend(n for n in names if n not in POINTS)


def point(name: str, path: object = None) -> None:
    """Fire the fail point ``name`` if ``PIMM_FAILPOINT`` selects it (cheap no-op otherwise)."""
    if not _SPEC:
        return
    target, _, action = _SPEC.partition("=")
    want, _, nth = target.partition("@")
    if want != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    first = int(nth.rstrip("+") or 1)
    if _hits[name] != first and not (nth.endswith("+") and _hits[name] > first):
        return
    if action in ("", "kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    if action.startswith("sig"):
        os.kill(os.getpid(), getattr(signal, action.upper()))
        return
    code = {"enospc": errno.ENOSPC, "eio": errno.EIO}[action]
    raise OSError(code, os.strerror(code), str(path) if path is not None else name)
