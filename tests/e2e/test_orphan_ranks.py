"""Ranks never outlive their launcher, and the run lock covers them.

``pimm launch --nproc-per-node 2`` runs torchrun in-process; each rank asks the kernel for
SIGKILL when that launcher dies, and each DataLoader worker when its rank dies
(``pimm_core.process.lock.die_with_parent``). The launcher holds ``<run>/.lock``; every rank, and
through it every DataLoader worker it forks, holds ``<run>/.ranks.lock`` shared; a new
launch is refused while anyone holds either.

- SIGKILL of the launcher of a training run: both ranks and all their DataLoader workers are
  gone within seconds, the run's checkpoints are exactly as they were at the kill (rank 0,
  which publishes every save, is frozen with SIGSTOP just before it, so "as they were" is
  exact: a SIGKILL from the kernel ends a stopped process too), and the run is free again.
- A process that still holds ``.ranks.lock`` (what a rank of an earlier launch that has not
  died yet holds): ``pimm launch`` and ``--train.resume`` are refused with the one
  "is in use by" line; once it is gone a resume is accepted and trains.
- Without ``$PIMM_LAUNCHER_PID`` (an external torchrun/srun, one process) nothing dies with
  its parent; a rank or worker whose parent died before it got to ask the kernel dies at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import DIGITS, REPO, clean_env, describe, hang_s, launch, pimm_here, read_json
from pimm_core.checkpoint.select.selection import select_resume
from pimm_core.errors import UsageError
from pimm_core.process.lock import LAUNCHER_ENV, LAUNCHER_HOLDS_ENV, LOCK, RANKS, RunLock

# runs for minutes unless killed; a save at every epoch end (23 steps); two workers per rank
LONG = ("train.epochs=200", "checkpoint.every_epochs=1", "data.num_workers=2", "train.log_every_steps=1")
DEADLINE = 30.0  # seconds for processes to be gone after the kill (they go in well under one)


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # state ppid pgrp session ...
    except OSError:
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _session_members(sids: set[int]) -> set[int]:
    """Live processes in these sessions: torchrun starts each rank in its own, and its workers inherit it."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and fields[0] != "Z" and int(fields[3]) in sids:
                out.add(int(entry))
    return out


def _flock_holders(path: Path) -> set[tuple[str, int]]:
    """``{(READ|WRITE, pid)}`` of the flocks on ``path`` (from /proc/locks; a forked worker shares its rank's)."""
    ino = path.stat().st_ino
    out = set()
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        if "->" in parts:
            continue  # a waiter
        if len(parts) >= 6 and parts[1] == "FLOCK" and int(parts[5].rsplit(":", 1)[1]) == ino:
            out.add((parts[3], int(parts[4])))
    return out


def _wait_until(cond, what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + hang_s(timeout)
    while not cond():
        assert time.monotonic() < deadline, f"not within {hang_s(timeout):.0f} s: {what}"
        time.sleep(0.05)


def _lock_free(run: Path) -> bool:
    try:
        RunLock(run).acquire().release()
    except UsageError:
        return False
    return True


def _files(model: Path) -> dict[str, int]:
    return {p.relative_to(model).as_posix(): p.stat().st_mtime_ns for p in sorted(model.rglob("*")) if p.is_file()}


def _launch_args(root: Path, *extra: str, overrides: tuple[str, ...] = LONG) -> list[str]:
    return ["launch", "--train.config", str(DIGITS), "--run.root", str(root), "--run.name", "orphans",
            "--run.no-timestamp", *extra, "--", *overrides]


def _launch_argv(root: Path, *extra: str, overrides: tuple[str, ...] = LONG) -> list[str]:
    return [sys.executable, "-m", "pimm_core.cli", *_launch_args(root, *extra, overrides=overrides)]


def test_killed_launcher_takes_its_ranks_and_their_workers(tmp_path):
    run = tmp_path / "digits" / "orphans"
    out = open(tmp_path / "launch.out", "w")
    launcher = subprocess.Popen(_launch_argv(tmp_path, "--nproc-per-node", "2"), cwd=REPO, env=clean_env(),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + hang_s(180)
        while not ranks:  # training, with a complete save behind it
            assert launcher.poll() is None, f"the run ended early:\n{(tmp_path / 'launch.out').read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no save within 180 s:\n{(tmp_path / 'launch.out').read_text()[-3000:]}"
            try:
                status = json.loads((run / "status.json").read_text())
            except (OSError, ValueError):
                status = {}
            if (status.get("state") == "running" and len(status.get("pids") or []) == 2
                    and (run / "model" / "last" / ".complete").exists()):
                ranks = list(status["pids"])
            time.sleep(0.05)

        # the launcher holds the run lock; both ranks hold the ranks' lock
        assert _flock_holders(run / LOCK) == {("WRITE", launcher.pid)}
        assert _flock_holders(run / RANKS) == {("READ", ranks[0]), ("READ", ranks[1])}
        assert read_json(run / "lock.json")["pid"] == launcher.pid

        # Freeze rank 0, which publishes every save: what is on disk now is what the run has at
        # the kill, exactly. Rank 1 keeps running (into its next collective with rank 0).
        os.kill(ranks[0], signal.SIGSTOP)
        model = run / "model"
        before, chosen = _files(model), select_resume(model)[0]
        members = _session_members(set(ranks))  # the ranks and the DataLoader workers they have now

        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=hang_s(30))

        _wait_until(lambda: not any(_alive(p) for p in ranks), "both ranks gone")
        _wait_until(lambda: not _session_members(set(ranks)) and not any(_alive(p) for p in members),
                    "every DataLoader worker gone")
        after = _files(model)
        assert after == before, f"checkpoint files changed after the kill: {sorted(set(after.items()) ^ set(before.items()))}"
        assert select_resume(model)[0].step == chosen.step
        # nothing holds the run any more, once the kernel has closed the dead processes' files
        _wait_until(lambda: _lock_free(run), "the run lock free (ranks and workers are gone)", timeout=15)
    finally:
        for pid in _session_members(set(ranks) | {launcher.pid}) | {p for p in ranks if _alive(p)}:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
        out.close()


# A stand-in rank: follows its launcher if it has one, takes what a rank holds, then waits.
_RANK = ("import sys, time\n"
         "from pimm_core.process.lock import follow_launcher, hold_run\n"
         "follow_launcher()\n"
         "held = hold_run(sys.argv[1], False)\n"
         "print('ready', flush=True)\n"
         "time.sleep(120)\n")


def test_launch_refused_while_a_rank_of_an_earlier_launch_lives(tmp_path):
    """A rank of an earlier launch that has not died yet (stand-in: a process holding
    ``.ranks.lock``, as a rank does) keeps the run: refused until it is gone."""
    first = launch(tmp_path, "orphans", "train.epochs=1", here=True)
    assert first.returncode == 0, describe(first)
    run = tmp_path / "digits" / "orphans"
    step = select_resume(run / "model")[0].step

    rank = subprocess.Popen([sys.executable, "-c", _RANK, str(run)], cwd=REPO,
                            env={**clean_env(), LAUNCHER_HOLDS_ENV: "1"}, stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "ready"
        # the 2-rank launcher in a real process; the single-process launch in this one (same check)
        for extra in (("--nproc-per-node", "2", "--train.resume"), ("--train.resume",)):
            if "--nproc-per-node" in extra:
                refused = subprocess.run(_launch_argv(tmp_path, *extra, overrides=("train.epochs=2",)), cwd=REPO,
                                         env=clean_env(), capture_output=True, text=True, timeout=hang_s(120))
            else:
                refused = pimm_here(*_launch_args(tmp_path, *extra, overrides=("train.epochs=2",)))
            assert refused.returncode == 2, describe(refused)
            lines = refused.stderr.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in refused.stderr, describe(refused)
            assert lines[0].startswith(f"error: {run} is in use by processes of an earlier launch that are still "
                                       "running"), lines[0]
    finally:
        rank.kill()
        rank.wait()
    assert select_resume(run / "model")[0].step == step  # nothing was written

    # accepted and trains (one step of the second epoch is enough; in this process: no torch import)
    resumed = pimm_here(*_launch_args(tmp_path, "--train.resume", overrides=("train.epochs=2", "train.max_steps=46")))
    assert resumed.returncode == 0, describe(resumed)
    assert read_json(run / "provenance.json")["starts"][-1]["checkpoint_step"] == step
    assert read_json(run / "status.json")["state"] == "finished"


# ----------------------------------------------------------- without training
# A stand-in launcher: starts a stand-in rank (with what LauncherLock sets, if asked), prints its pid, waits.
_LAUNCHER = ("import os, subprocess, sys, time\n"
             "env = dict(os.environ)\n"
             "if sys.argv[3] == 'pimm':\n"
             f"    env.update({{{LAUNCHER_ENV!r}: str(os.getpid()), {LAUNCHER_HOLDS_ENV!r}: '1'}})\n"
             "rank = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], env=env, stdout=subprocess.PIPE,"
             " text=True)\n"
             "assert rank.stdout.readline().strip() == 'ready'\n"
             "print(rank.pid, flush=True)\n"
             "time.sleep(120)\n")


@pytest.mark.parametrize("launcher", ["pimm", "external"])
def test_rank_dies_with_its_launcher_only_under_pimm_launch(tmp_path, launcher):
    parent = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _RANK, str(tmp_path), launcher], cwd=REPO,
                              env=clean_env(), stdout=subprocess.PIPE, text=True, start_new_session=True)
    rank = None
    try:
        line = parent.stdout.readline().strip()
        assert line.isdigit(), f"stand-in launcher failed: {line!r}"
        rank = int(line)
        if launcher == "pimm":
            with pytest.raises(UsageError, match="is in use by processes of an earlier launch"):
                RunLock(tmp_path).acquire()  # the rank holds .ranks.lock
        parent.kill()
        parent.wait()
        if launcher == "pimm":
            _wait_until(lambda: not _alive(rank), "the rank gone with its launcher")
            RunLock(tmp_path).acquire().release()  # and its hold on the run with it
        else:
            time.sleep(2)  # a rank of an external torchrun/srun: nothing ties it to its parent here
            assert _alive(rank)
    finally:
        if rank is not None and _alive(rank):
            os.kill(rank, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
        parent.wait()


@pytest.mark.parametrize("who", ["rank", "worker"])
def test_parent_already_gone_dies_at_once(tmp_path, who):
    """The window before a rank (or DataLoader worker) asks the kernel: it checks its parent right after."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is no longer anyone's
    if who == "rank":
        argv, env = [sys.executable, "-c", _RANK, str(tmp_path)], {**clean_env(), LAUNCHER_ENV: str(gone.pid)}
    else:
        code = f"from pimm_core.data import init_worker; init_worker({gone.pid}, 0); print('ready', flush=True)"
        argv, env = [sys.executable, "-c", code], clean_env()
    child = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=hang_s(60))
    assert child.returncode == -signal.SIGKILL, describe(child)
    assert "ready" not in child.stdout
