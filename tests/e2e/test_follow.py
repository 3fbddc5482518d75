"""FollowingHasher: the manifest's sha256 computed while the checkpoint files are written."""

from __future__ import annotations

import hashlib
import os
import threading
import time

from _helpers import hang_s
from pimm_core.checkpoint.publish.follow import FollowingHasher
from pimm_core.checkpoint.records.manifest import describe_files, sha256_file


def _append_slowly(path, chunks, pause=0.002):
    with open(path, "wb") as f:
        for c in chunks:
            f.write(c)
            f.flush()
            time.sleep(pause)


def test_hashes_files_while_they_are_written_and_recognizes_them_after_a_rename(tmp_path):
    chunks = [os.urandom(3 << 20) for _ in range(5)] + [os.urandom(12345)]
    hasher = FollowingHasher(tmp_path, lambda rel: rel.endswith(".tmp")).start()
    writer = threading.Thread(target=_append_slowly, args=(tmp_path / ".weights.pth.1.tmp", chunks))
    writer.start()
    writer.join()
    os.replace(tmp_path / ".weights.pth.1.tmp", tmp_path / "weights.pth")
    (tmp_path / "small.json").write_bytes(b"{}")  # not followed: hashed when described
    known = hasher.finish()

    data = b"".join(chunks)
    assert [v["sha256"] for v in known.values()] == [hashlib.sha256(data).hexdigest()]
    files = describe_files(tmp_path, known=known)
    assert files == {"small.json": {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()},
                     "weights.pth": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}


def test_a_file_truncated_while_followed_is_left_to_the_ordinary_hash(tmp_path):
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(os.urandom(1 << 20))
    hasher = FollowingHasher(tmp_path, lambda rel: rel.endswith(".distcp")).start()
    deadline = time.monotonic() + hang_s(10)
    while not hasher._files or hasher._files["__0_0.distcp"].pos < (1 << 20):  # the first version is hashed
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with open(path, "r+b") as f:  # rewritten in place, shorter: what was hashed is not the file
        f.truncate(0)
        f.write(b"new")
    known = hasher.finish()
    assert known == {}
    assert describe_files(tmp_path, known=known) == {
        "__0_0.distcp": {"size": 3, "sha256": sha256_file(path)}}


def test_close_without_finish_stops_the_thread_and_closes_the_files(tmp_path):
    (tmp_path / "a.distcp").write_bytes(b"x" * 100)
    hasher = FollowingHasher(tmp_path, lambda rel: True).start()
    time.sleep(0.05)
    hasher.close()
    assert not hasher._thread.is_alive()
    assert hasher._files == {}


def test_reports_the_bytes_written_so_far_as_the_files_grow(tmp_path):
    chunks = [os.urandom(1 << 20) for _ in range(6)]
    seen: list[int] = []
    first = threading.Event()

    def on_written(n):
        seen.append(n)
        first.set()

    hasher = FollowingHasher(tmp_path, lambda rel: rel.endswith(".distcp"), on_written=on_written).start()
    assert first.wait(hang_s(10))  # the thread has looked once, before anything is written
    _append_slowly(tmp_path / "__0_0.distcp", chunks[:3])
    _append_slowly(tmp_path / "__1_0.distcp", chunks[3:])
    hasher.finish()
    assert seen[0] == 0 and seen[-1] == 6 << 20  # from nothing to every byte of both files
    assert seen == sorted(seen)  # never backwards


def test_files_written_through_writing_are_hashed_by_their_writer_without_a_thread(tmp_path):
    """One local rank (match None): torch.save of the weights and a file written in parts are
    hashed on the way to disk and recognized after a rename; a file seeked in, or whose write
    failed, is left to the ordinary hash; the bytes written drive on_written."""
    import pytest
    import torch

    seen: list[int] = []
    hasher = FollowingHasher(tmp_path, None, on_written=seen.append).start()
    assert not hasher._thread.is_alive()  # nothing to follow: no thread polls the directory
    obj = {"state_dict": {"w": torch.randn(600, 600), "b": torch.zeros(3)}}  # (w: hashed beside its write)
    with hasher.writing(open(tmp_path / ".weights.pth.1.tmp", "wb")) as f:
        torch.save(obj, f)
    os.replace(tmp_path / ".weights.pth.1.tmp", tmp_path / "weights.pth")
    parts = [os.urandom(1 << 20), os.urandom(777)]
    f = hasher.writing(open(tmp_path / "__0_0.distcp", "wb"))
    for p in parts:
        f.write(memoryview(p))
    f.close()
    with hasher.writing(open(tmp_path / "seeked.bin", "wb")) as f:
        f.write(b"x" * 10)
        f.seek(0)
        f.write(b"y")  # rewritten in place: what was hashed is not the file
    with pytest.raises(ValueError), hasher.writing(open(tmp_path / "failed.bin", "wb")) as f:
        f.write(b"partial")
        raise ValueError("the writer failed")
    (tmp_path / "refused.bin").write_bytes(b"")
    with pytest.raises(OSError), hasher.writing(open(tmp_path / "refused.bin", "rb")) as f:
        f.write(os.urandom(2 << 20))  # a large write that fails while its bytes are being hashed
    known = hasher.finish()

    files = describe_files(tmp_path, known=known)
    for name in ("weights.pth", "__0_0.distcp", "seeked.bin", "failed.bin", "refused.bin"):
        assert files[name]["sha256"] == sha256_file(tmp_path / name), name
    hashed_here = {v["sha256"] for v in known.values()}
    assert hashed_here == {sha256_file(tmp_path / "weights.pth"), sha256_file(tmp_path / "__0_0.distcp")}
    assert torch.equal(torch.load(tmp_path / "weights.pth")["state_dict"]["w"], obj["state_dict"]["w"])
    total = sum((tmp_path / n).stat().st_size for n in ("weights.pth", "__0_0.distcp", "seeked.bin", "failed.bin"))
    assert seen == sorted(seen) and seen[-1] == total + 1  # every byte written through it, in order (+ the rewrite)


def _block_hashing_threads():
    """Occupy both hashing threads until the returned event is set."""
    from pimm_core.checkpoint.publish.follow import _hash_pool

    release, started = threading.Event(), [threading.Event(), threading.Event()]

    def hold(i):
        started[i].set()
        release.wait(hang_s(30))

    for i in range(2):
        _hash_pool.submit(hold, i)
    assert all(e.wait(hang_s(10)) for e in started)
    return release


def test_the_writer_goes_on_while_the_hash_trails_and_its_buffers_are_not_kept(tmp_path):
    """With both hashing threads busy, 6 MiB (under LAG_MAX) are written and the file closed:
    the writer does not wait for its hash. The buffer written is changed after each write
    returns: the hash is of the file's bytes, computed once the threads are free."""
    release = _block_hashing_threads()
    hasher = FollowingHasher(tmp_path, None).start()
    buf = bytearray(os.urandom(2 << 20))
    done = threading.Event()

    def write():
        with hasher.writing(open(tmp_path / "__0_0.distcp", "wb")) as f:
            for i in range(3):
                f.write(buf)
                buf[:8] = b"changed%d" % i  # the caller reuses its buffer once write() returns
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert done.wait(hang_s(30)), "the writer waited for the hash"
    finally:
        release.set()
    writer.join()
    known = hasher.finish()
    assert [v["sha256"] for v in known.values()] == [sha256_file(tmp_path / "__0_0.distcp")]
    assert [v["size"] for v in known.values()] == [6 << 20]


def test_the_hash_trails_the_writer_by_at_most_lag_max(tmp_path, monkeypatch):
    from pimm_core.checkpoint.publish import follow

    monkeypatch.setattr(follow, "LAG_MAX", 2 << 20)
    lags: list[int] = []
    hasher = FollowingHasher(tmp_path, None).start()
    data = os.urandom(9 << 20)
    with hasher.writing(open(tmp_path / "weights.pth", "wb")) as f:
        for i in range(0, len(data), 1 << 20):
            f.write(data[i:i + (1 << 20)])
            lags.append(f._trail.mark - f._trail.hashed)
    assert max(lags) <= 2 << 20
    assert [v["sha256"] for v in hasher.finish().values()] == [hashlib.sha256(data).hexdigest()]


def test_close_without_finish_stops_the_trails_and_closes_their_files(tmp_path):
    def open_fds():
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    release = _block_hashing_threads()  # the hash of what is written is still pending at close()
    hasher = FollowingHasher(tmp_path, None).start()
    try:
        with hasher.writing(open(tmp_path / "__0_0.distcp", "wb")) as f:
            f.write(os.urandom(3 << 20))
    finally:
        release.set()
    hasher.close()
    assert open_fds() == before
    assert hasher.finish() == {}


def test_a_file_that_cannot_be_opened_again_by_its_name_is_left_to_the_ordinary_hash(tmp_path):
    hasher = FollowingHasher(tmp_path, None).start()
    fd = os.open(tmp_path / "weights.pth", os.O_WRONLY | os.O_CREAT)
    with hasher.writing(open(fd, "wb")) as f:  # (its name is the descriptor's number)
        f.write(os.urandom(2 << 20))
    known = hasher.finish()
    assert known == {}
    assert describe_files(tmp_path, known=known)["weights.pth"]["sha256"] == sha256_file(tmp_path / "weights.pth")


def test_at_interpreter_exit_the_file_is_left_to_the_ordinary_hash(tmp_path, monkeypatch):
    """A save while the interpreter exits (its thread pools take no new work: RuntimeError, as
    ThreadPoolExecutor.submit raises then) still completes: the file's hash is computed after."""
    from pimm_core.checkpoint.publish import follow

    def refuse(*_args):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(follow._hash_pool, "submit", refuse)
    hasher = FollowingHasher(tmp_path, None).start()
    with hasher.writing(open(tmp_path / "weights.pth", "wb")) as f:
        f.write(os.urandom(3 << 20))
    known = hasher.finish()
    assert known == {}
    assert describe_files(tmp_path, known=known)["weights.pth"]["sha256"] == sha256_file(tmp_path / "weights.pth")


_FULL_DISK = r"""
import os, resource, signal, sys, torch
from pathlib import Path
from pimm_core.checkpoint.publish.rotation import follow_hashes, save_torch_file
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as a full disk's with ENOSPC
d = Path(sys.argv[1])
hasher = follow_hashes(d)
resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, resource.RLIM_INFINITY))
try:
    save_torch_file(d / "weights.pth", {f"w{i}": torch.randn(1000) for i in range(2000)}, hasher)  # 8 MB
except OSError as e:
    print("save failed:", e.strerror)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
hasher.close()
print("left:", sorted(os.listdir(d)))
for fd in os.listdir("/proc/self/fd"):
    try:
        print("open:", os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        pass
"""


def test_a_save_that_fails_at_its_last_flush_keeps_no_descriptor_of_its_removed_file(tmp_path):
    """The write fails when the file outgrows the limit (the kernel's EFBIG, a full disk's ENOSPC alike),
    the last flush at close() fails again: the temporary file is removed, and no descriptor of it (the
    hash's own) stays open to keep its blocks allocated."""
    import subprocess
    import sys

    from _helpers import REPO, clean_env

    out = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], cwd=REPO, env=clean_env(),
                         capture_output=True, text=True, timeout=hang_s(120))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "save failed: File too large" in out.stdout, out.stdout
    assert "left: []" in out.stdout, out.stdout
    assert not [line for line in out.stdout.splitlines() if line.startswith("open:") and str(tmp_path) in line], out.stdout
