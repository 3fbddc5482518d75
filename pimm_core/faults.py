"""Named fail points for crash-consistency testing.

``point("standard.after_weights")`` does nothing unless the environment variable
``PIMM_FAILPOINT`` names that point, optionally with the hit count at which to fire
(``standard.after_weights@2``), and optionally an action after ``=``: ``kill``
(default: SIGKILL this process, like a power cut or the OOM killer), ``enospc``
/ ``eio`` (raise that OSError, like a full disk or a failing device) or ``sigterm`` /
``sigint`` / ``sighup`` (send that signal to this process: a stop asked at exactly that
moment, e.g. during start-up at ``launch.starting``), or ``pause`` (create
``<PIMM_FAILPOINT_DIR>/<point>.reached`` and wait until ``<point>.go`` appears there: another
process, a test, does something at exactly that moment, e.g. rotates ``last`` in the middle of
a reader's read, then lets it go on). A count ending in ``+``
(``status.write@3+=enospc``) fires at that hit and every later one (a disk that stays
full). With
``PIMM_FAILPOINT_RANK=<r>`` it fires only in the process whose ``RANK`` is ``r`` (one
rank's disk or node failing while the others carry on); with ``PIMM_FAILPOINT_RESTART=<k>`` only in the
attempt whose ``TORCHELASTIC_RESTART_COUNT`` is ``k`` (a rank killed once, not again after torchrun
restarted it). Several points are separated by
commas (``checkpoints.verify.located=pause,generation.rotating=pause``). The list of
points a save passes through is :data:`POINTS`; ``benchmarks/crash_points.py`` and the
tests kill a real saving process at each of them.
"""

from __future__ import annotations

import errno
import os
import signal
import time

_SPEC = os.environ.get("PIMM_FAILPOINT", "")
if os.environ.get("PIMM_FAILPOINT_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
    _SPEC = ""  # another rank's fail point
if os.environ.get("PIMM_FAILPOINT_RESTART", "") not in ("", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
    _SPEC = ""  # another attempt's fail point (torchrun's restart runs the ranks again with the same environment)
_hits: dict[str, int] = {}

POINTS: list[str] = []  # every point name, registered at import by the modules that use them


def register(*names: str) -> None:
    POINTS.extend(n for n in names if n not in POINTS)


def point(name: str, path: object = None) -> None:
    """Fire the fail point ``name`` if ``PIMM_FAILPOINT`` selects it (cheap no-op otherwise)."""
    if not _SPEC:
        return
    for spec in _SPEC.split(","):
        target, _, action = spec.partition("=")
        want, _, nth = target.partition("@")
        if want == name:
            _fire(name, nth, action, path)
            return


#: How long (seconds) a ``pause`` waits for its ``.go`` file before going on anyway (a test that died).
PAUSE_LIMIT_S = 120.0


def _fire(name: str, nth: str, action: str, path: object) -> None:
    _hits[name] = _hits.get(name, 0) + 1
    first = int(nth.rstrip("+") or 1)
    if _hits[name] != first and not (nth.endswith("+") and _hits[name] > first):
        return
    if action in ("", "kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    if action.startswith("sig"):
        os.kill(os.getpid(), getattr(signal, action.upper()))
        return
    if action == "pause":
        _pause(name)
        return
    code = {"enospc": errno.ENOSPC, "eio": errno.EIO}[action]
    raise OSError(code, os.strerror(code), str(path) if path is not None else name)


def _pause(name: str) -> None:
    """Say ``<name>.reached`` (hit count appended after the first: ``<name>.reached.2``) in
    ``PIMM_FAILPOINT_DIR`` and wait for the matching ``.go`` file (removed once seen)."""
    folder = os.environ.get("PIMM_FAILPOINT_DIR", ".")
    n = _hits[name]
    suffix = "" if n == 1 else f".{n}"
    go = os.path.join(folder, f"{name}.go{suffix}")
    with open(os.path.join(folder, f"{name}.reached{suffix}"), "w"):
        pass
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.002)
