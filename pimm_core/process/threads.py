"""Intra-op threads per rank: from the CPUs this process may really use, shared among the node's ranks.

PyTorch's default (one intra-op thread per core the process sees, ``OMP_NUM_THREADS``
aside) ignores a container's CPU quota and the other ranks of the node, and its OpenMP
threads spin while they wait for work: on a busy machine, or beside the node's other
ranks, a small model's step then costs several times its arithmetic. pimm chooses instead,
once per process, before the first training op (:func:`choose_threads`, applied by
:func:`apply_threads`):

1. ``train.threads`` when set;
2. else ``OMP_NUM_THREADS`` when the user set it (``pimm launch --nproc-per-node`` records
   in :data:`USER_OMP_ENV` whether the user's environment had it; under a plain torchrun,
   which sets it to 1 itself for several ranks, a set value counts as the user's);
3. else the usable CPUs divided among the node's ranks, at least 1: usable CPUs are the
   affinity mask (``os.sched_getaffinity``) capped by the cgroup CPU quota (v2
   ``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``), rounded down; the node's
   ranks are torchrun's ``LOCAL_WORLD_SIZE`` (Slurm's tasks on this node under srun);
   and a model with fewer than :data:`SMALL_MODEL` parameters gets 1 thread: its
   operations are too small to split, and measured on 2 cores a second thread made the
   quickstart's step slower, alone and on a busy machine (``benchmarks/threads.py``,
   docs/performance.md).

The choice is said once in ``train.log`` (:meth:`ThreadChoice.describe`). Never more
threads than the usable CPUs per rank, except when asked for by ``train.threads`` or
``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Set by ``pimm launch --nproc-per-node`` for its ranks: "1" when the user's environment had
#: ``OMP_NUM_THREADS``, "0" when the launcher set it (to keep torchrun from setting it with a warning).
USER_OMP_ENV = "PIMM_USER_OMP_NUM_THREADS"

#: Parameters below which the automatic choice is one thread (see the module docstring).
SMALL_MODEL = 1_000_000

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op threads of this rank and what they were chosen from.

    Attributes:
        threads: intra-op threads (``torch.set_num_threads``).
        source: ``"train.threads"``, ``"OMP_NUM_THREADS"``, or ``"auto"``.
        affinity: CPUs in this process's affinity mask.
        quota: CPUs allowed by the cgroup quota (fractional), None when unlimited.
        local_ranks: ranks of this run on this node.
        small_model: the automatic choice was 1 thread for a model under :data:`SMALL_MODEL` parameters.
    """

    threads: int
    source: str
    affinity: int
    quota: float | None
    local_ranks: int
    small_model: bool = False

    @property
    def usable(self) -> int:
        """CPUs usable by the node's ranks together: the affinity capped by the quota (at least 1)."""
        return usable_cpus(self.affinity, self.quota)

    def describe(self) -> str:
        """One line for ``train.log``, e.g. ``threads: 1 per rank (2 CPUs usable: affinity 2,
        cgroup quota none; 2 local ranks)``."""
        quota = "none" if self.quota is None else f"{self.quota:g} CPUs"
        why = {"train.threads": "set by train.threads", "OMP_NUM_THREADS": "set by OMP_NUM_THREADS"}.get(self.source)
        if why is None and self.small_model:
            why = f"a model under {SMALL_MODEL:,} parameters: 1 thread"
        ranks = f"{self.local_ranks} local rank{'s' if self.local_ranks != 1 else ''}"
        head = f"threads: {self.threads} per rank ({self.usable} CPU{'s' if self.usable != 1 else ''} usable: " \
               f"affinity {self.affinity}, cgroup quota {quota}; {ranks}"
        return head + (f"; {why})" if why else ")")


def usable_cpus(affinity: int, quota: float | None) -> int:
    """``affinity`` capped by the cgroup ``quota`` (CPUs, rounded down), at least 1."""
    return max(1, min(affinity, math.floor(quota)) if quota is not None else affinity)


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs allowed by this process's cgroup CPU quota (e.g. 1.5), None when there is none.

    cgroup v2: ``cpu.max`` (``"$MAX $PERIOD"`` or ``"max $PERIOD"``) of this process's cgroup and
    of each cgroup above it, the tightest; cgroup v1: ``cpu/cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us`` (-1: none). ``root`` is where the hierarchy is mounted (a test
    passes a directory of its own); unreadable files count as no quota.
    """
    found: list[float] = []
    own = _own_cgroup(proc_cgroup)
    for directory in _ancestors(root, own.get("")):
        text = _read(directory / "cpu.max")
        if text:
            parts = text.split()
            if len(parts) == 2 and parts[0] != "max" and _positive(parts[0]) and _positive(parts[1]):
                found.append(int(parts[0]) / int(parts[1]))
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for directory in _ancestors(root / name, own.get("cpu")):
            quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
            if quota and period and _positive(quota) and _positive(period):
                found.append(int(quota) / int(period))
    return min(found) if found else None


def local_ranks(env: dict[str, str] | None = None) -> int:
    """Ranks of this run on this node: torchrun's ``LOCAL_WORLD_SIZE``; under srun with several
    tasks, this node's entry of ``SLURM_STEP_TASKS_PER_NODE`` (``"2(x3),1"``); else 1."""
    env = os.environ if env is None else env
    if env.get("LOCAL_WORLD_SIZE", "").isdigit():
        return max(1, int(env["LOCAL_WORLD_SIZE"]))
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if tasks and "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        per_node: list[int] = []
        for part in tasks.split(","):
            m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
            if m:
                per_node += [int(m.group(1))] * int(m.group(2) or 1)
        node = int(env.get("SLURM_NODEID", "0") or 0)
        if node < len(per_node):
            return max(1, per_node[node])
    return 1


def choose_threads(configured: int | None, parameters: int, *, env: dict[str, str] | None = None,
                   affinity: int | None = None, cgroup_root: Path = CGROUP_ROOT,
                   proc_cgroup: Path = Path("/proc/self/cgroup")) -> ThreadChoice:
    """The intra-op threads of this rank (the rules: module docstring).

    Args:
        configured: ``train.threads`` (None: not set).
        parameters: the model's parameter count (the small-model rule).
        env: the environment (default ``os.environ``).
        affinity: CPUs in the affinity mask (default: this process's).
        cgroup_root, proc_cgroup: where the cgroup hierarchy and this process's cgroup are read.
    """
    env = os.environ if env is None else env
    aff = affinity_cpus() if affinity is None else affinity
    quota = cgroup_quota(cgroup_root, proc_cgroup)
    ranks = local_ranks(env)
    base = dict(affinity=aff, quota=quota, local_ranks=ranks)
    if configured is not None:
        return ThreadChoice(configured, "train.threads", **base)
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1 and env.get(USER_OMP_ENV) != "0":
        return ThreadChoice(int(omp), "OMP_NUM_THREADS", **base)
    if parameters < SMALL_MODEL:
        return ThreadChoice(1, "auto", small_model=True, **base)
    return ThreadChoice(max(1, usable_cpus(aff, quota) // ranks), "auto", **base)


def apply_threads(choice: ThreadChoice) -> None:
    """``torch.set_num_threads(choice.threads)`` (the intra-op pool; inter-op threads, used only
    by TorchScript's ``fork``, are left as they are)."""
    import torch

    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)


def set_threads(configured: int | None, model: Any, *, auto: bool) -> ThreadChoice | None:
    """Choose (:func:`choose_threads`, for ``model``'s parameter count) and apply this process's
    intra-op threads; returns the choice, or None when ``configured`` is None and not ``auto``
    (the Python API: the program's own ``torch.set_num_threads`` is kept)."""
    if configured is None and not auto:
        return None
    choice = choose_threads(configured, sum(p.numel() for p in model.parameters()))
    apply_threads(choice)
    return choice


def _own_cgroup(proc_cgroup: Path) -> dict[str, str]:
    """This process's cgroup path per controller from ``/proc/self/cgroup`` ("" for v2's unified one)."""
    out: dict[str, str] = {}
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                out.setdefault(controller, parts[2])
    return out


def _ancestors(root: Path, own: str | None) -> list[Path]:
    """``root`` and, when this process's cgroup path ``own`` exists under it, each directory down to it."""
    dirs = [root]
    if own and own != "/":
        here = root
        for part in own.strip("/").split("/"):
            here = here / part
            if not here.is_dir():
                break  # a namespaced mount: root already is this process's cgroup
            dirs.append(here)
    return dirs


def _positive(text: str) -> bool:
    return text.isdigit() and int(text) > 0


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
