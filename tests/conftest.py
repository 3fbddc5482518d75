"""The order in which ``-n 3 --dist loadfile`` (pyproject's addopts) hands test files to the workers.

xdist gives each worker a whole file at a time, in order of the files' number of tests (most first).
That puts heavy e2e files with few tests (one long scenario: test_hangs, test_examples_hf) last: a
worker starting one of them when the rest of the suite is nearly done leaves the other worker idle
meanwhile (issue #25). Handing out the heaviest files first, then the other e2e files, then the fast
unit files, lets the short files at the end fill in. Modelled on the 15.2 min baseline run's
durations: the last 18-48 s with one worker idle in xdist's order, about 1 s in this one.
"""

from __future__ import annotations

import pytest

# The heaviest files, heaviest first, with the wall seconds each took in a `-n 2` run of the suite on
# the 2-core VM (the sum of its tests' `--durations`, 15.2 min run; in brackets for the files changed
# for issue #25 since, then scaled by their CPU time after/before). Keep it to files of about a minute;
# re-measure when a file's tests change much. Files not named here keep xdist's order after them, e2e
# before unit.
HEAVY_FIRST = (
    "tests/e2e/test_fsdp.py",  # 95
    "tests/e2e/test_examples_hf.py",  # 93
    "tests/e2e/test_stop_runs.py",  # 87 (90)
    "tests/e2e/test_elastic.py",  # 75
    "tests/e2e/test_multinode.py",  # 72
    "tests/e2e/test_resume_world.py",  # 71 (128)
    "tests/e2e/test_user_code.py",  # 64 (95)
    "tests/e2e/test_hangs.py",  # 64
    "tests/e2e/test_crash.py",  # 60
    "tests/e2e/test_remote_checkpoints.py",  # 53
    "tests/e2e/test_scheduler_stop.py",  # 52
)


def _rank(scope: str) -> tuple[int, int]:
    heavy = HEAVY_FIRST.index(scope) if scope in HEAVY_FIRST else len(HEAVY_FIRST)
    return heavy, 0 if scope.startswith("tests/e2e/") else 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadFileScheduling

    class HeavyFirst(LoadFileScheduling):
        """LoadFileScheduling with its queue of files sorted by :func:`_rank` (stable: ties keep xdist's order)
        before the first file is handed out."""

        _sorted = False

        def _assign_work_unit(self, node) -> None:
            if not self._sorted:
                self._sorted = True
                self.workqueue = OrderedDict(sorted(self.workqueue.items(), key=lambda item: _rank(item[0])))
            super()._assign_work_unit(node)

    return HeavyFirst(config, log)
