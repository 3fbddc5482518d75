"""pimm's owned temporary directories (:mod:`pimm_core.checkpoint.records.scratch`): held with filelock,
the run lock's mechanism; one whose owner process was killed is removed by the next clean-up, one
in use never."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from filelock import FileLock, Timeout

from pimm_core.checkpoint.records.scratch import OWNER_SUFFIX, make_owned_dir, release, remove_stale

_HOLD = """
import sys, tempfile
tempfile.tempdir = sys.argv[1]
from pimm_core.checkpoint.records.scratch import make_owned_dir
directory, lock = make_owned_dir("pimm-remote-")
(directory / "part").write_bytes(b"x" * 10)
print(directory, flush=True)
sys.stdin.read()  # until killed
"""


def test_owned_dirs_are_held_with_filelock_and_a_killed_owners_dir_is_removed(tmp_path: Path, monkeypatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        dead = Path(child.stdout.readline().strip())
        live, lock = make_owned_dir("pimm-export-")
        try:
            assert isinstance(lock, FileLock) and lock.is_locked
            other = FileLock(f"{live}{OWNER_SUFFIX}", thread_local=False)
            try:
                other.acquire(blocking=False)
                raise AssertionError("an owner file in use could be locked by another holder")
            except Timeout:
                pass
            assert remove_stale(tmp_path) == [] and dead.is_dir()  # both owners alive
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            assert remove_stale(tmp_path) == [dead.name]
            assert not dead.exists() and not Path(f"{dead}{OWNER_SUFFIX}").exists()
            assert live.is_dir()  # in use: untouched
        finally:
            release(live, lock)
        assert sorted(os.listdir(tmp_path)) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
