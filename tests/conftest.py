"""The order in which ``-n 3 --dist loadfile`` (pyproject's addopts) hands test files to the workers.

xdist gives each worker a whole file at a time, in order of the files' number of tests (most first).
That puts heavy e2e files with few tests (one long scenario: test_hangs, test_examples_hf) last: a
worker starting one of them when the rest of the suite is nearly done leaves the other worker idle
meanwhile (issue #25). Handing out the heaviest files first, then the other e2e files, then the fast
unit files, lets the short files at the end fill in. Modelled on the 15.2 min baseline run's
durations: the last 18-48 s with one worker idle in xdist's order, about 1 s in this one.
"""

from __future__ import annotations

import json
import os
import resource
import time

import pytest

# The heaviest files, heaviest first, with the wall seconds each took in a `-n 2` run of the suite on
# the 2-core VM (the sum of its tests' `--durations`, 15.2 min run; in brackets for the files changed
# for issue #25 since, then scaled by their CPU time after/before). Keep it to files of about a minute;
# re-measure when a file's tests change much. Files not named here keep xdist's order after them, e2e
# before unit.
HEAVY_FIRST = (
    # added since: test_slurm's wall is mostly Slurm's own time limit (--time=3, the first start's steps slowed
    # until SIGUSR1 comes ~2 min in; 280 s at load ~20, little CPU), so it starts first and overlaps the rest;
    # test_tensor_parallel: 106 CPU-s, 300-470 s wall at load ~20 (4- and 2-rank launches)
    "tests/e2e/test_slurm.py",
    "tests/e2e/test_tensor_parallel.py",
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


# ---- PIMM_TEST_CPU_REPORT=1: where the suite's CPU goes, per test file -------------------------------
# The CPU seconds of each file's tests: this worker's own (in-process runs) and its reaped children's
# (`pimm` subprocesses, torchrun and its ranks once torchrun has waited for them), from getrusage
# before and after each test (module fixtures' set-up and teardown count for the test that ran them).
# The terminal summary lists the files by CPU; PIMM_TEST_CPU_REPORT=<path.json> also writes them there.
# CPU, not wall: the suite's floor on N cores is its CPU time / N, whatever the load beside it.
_CPU_REPORT = os.environ.get("PIMM_TEST_CPU_REPORT", "")


def pytest_sessionstart(session) -> None:
    """Compile pimm's own modules (and the tests' helpers) to ``__pycache__`` once, before any test.

    The suite starts hundreds of Python processes (launches, ranks, CLI calls). With
    ``PYTHONDONTWRITEBYTECODE`` set, as on this project's machines, none of them writes the bytecode
    it compiles, so each one compiles pimm's ~150 modules again (~0.17 CPU-s a process, measured by
    benchmarks/startup.py). Reading ``__pycache__`` is still allowed then, so compiling once here
    removes that cost; ``uv sync --compile-bytecode`` compiles site-packages, not this editable checkout.
    """
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller did it
        return
    import compileall
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for d in ("pimm_core", "pimm_tui", "pimm", "tests", "benchmarks", "examples"):
        if (root / d).is_dir():
            compileall.compile_dir(root / d, quiet=1, workers=1)


def _cpu() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


if _CPU_REPORT:

    def pytest_configure(config) -> None:
        config._pimm_cpu = {}  # file -> [own s, children s, wall s, tests]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        own0, kids0, wall0 = *_cpu(), time.monotonic()
        yield
        own1, kids1 = _cpu()
        row = item.config._pimm_cpu.setdefault(item.nodeid.split("::")[0], [0.0, 0.0, 0.0, 0])
        row[0] += own1 - own0
        row[1] += kids1 - kids0
        row[2] += time.monotonic() - wall0
        row[3] += 1
        if hasattr(item.config, "workeroutput"):  # an xdist worker: the controller sums the workers' rows
            item.config.workeroutput["pimm_cpu"] = json.dumps(item.config._pimm_cpu)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(node, error) -> None:
        rows = json.loads(getattr(node, "workeroutput", {}).get("pimm_cpu", "{}"))
        for file, row in rows.items():
            mine = node.config._pimm_cpu.setdefault(file, [0.0, 0.0, 0.0, 0])
            for i, v in enumerate(row):
                mine[i] += v

    def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
        rows = sorted(config._pimm_cpu.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
        if not rows:
            return
        tr = terminalreporter
        tr.section("CPU seconds per test file (PIMM_TEST_CPU_REPORT)")
        tr.write_line(f"{'cpu s':>8} {'own s':>8} {'child s':>8} {'wall s':>8} {'tests':>5}  file")
        for file, (own, kids, wall, n) in rows:
            tr.write_line(f"{own + kids:8.1f} {own:8.1f} {kids:8.1f} {wall:8.1f} {n:5d}  {file}")
        own, kids = sum(r[0] for _, r in rows), sum(r[1] for _, r in rows)
        tr.write_line(f"{own + kids:8.1f} {own:8.1f} {kids:8.1f} {'':>8} {sum(r[3] for _, r in rows):5d}  total")
        if _CPU_REPORT != "1":
            with open(_CPU_REPORT, "w") as f:
                json.dump({file: dict(zip(("own_s", "children_s", "wall_s", "tests"), row)) for file, row in rows},
                          f, indent=1)
