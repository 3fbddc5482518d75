"""Atomic publishing: atomic_write_bytes and the directory rotation used for model/last."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pimm_core import fsio as atomic
from pimm_core.fsio import atomic_write_bytes
from pimm_core.checkpoint.select.selection import list_candidates, select_resume
from pimm_core.checkpoint.publish.rotation import rotate_into_place, wait_for_purges

from _helpers import release, undeletable


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# ------------------------------------------------------------------ atomic_write_bytes
@pytest.mark.parametrize("durable", [True, False])
def test_write_creates_and_replaces_without_temporaries(tmp_path, durable):
    target = tmp_path / "status.json"
    atomic_write_bytes(target, b"one", durable=durable)
    assert target.read_bytes() == b"one"
    atomic_write_bytes(target, b"two", durable=durable)
    assert target.read_bytes() == b"two"
    assert names(tmp_path) == ["status.json"]


def test_failed_rename_onto_nonempty_directory_leaves_it_and_no_temporary(tmp_path):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep").write_bytes(b"keep")
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"new")
    assert names(tmp_path) == ["taken"]
    assert (target / "keep").read_bytes() == b"keep"


def test_failed_replace_keeps_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "config.toml"
    target.write_bytes(b"old")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "replace", refuse)
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert names(tmp_path) == ["config.toml"]


def test_failed_write_keeps_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "manifest.json"
    target.write_bytes(b"old")
    with pytest.raises(TypeError):
        atomic_write_bytes(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old"
    assert names(tmp_path) == ["manifest.json"]


def test_interrupt_during_write_cleans_up(tmp_path, monkeypatch):
    target = tmp_path / "f"
    target.write_bytes(b"old")

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(target, b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert names(tmp_path) == ["f"]


# ------------------------------------------------------------------- rotate_into_place
def make_ckpt(path: Path, tag: str) -> Path:
    path.mkdir()
    (path / "weights.pth").write_text(tag)
    (path / "trainer.dcp").mkdir()
    (path / "trainer.dcp" / "__0_0.distcp").write_text(tag)
    return path


def tag_of(path: Path) -> str:
    return (path / "weights.pth").read_text()


def test_rotation_into_empty_dir(tmp_path):
    rotate_into_place(make_ckpt(tmp_path / "last.tmp", "new"), tmp_path / "last")
    wait_for_purges()  # last.prev is removed in the background
    assert names(tmp_path) == ["last"]
    assert tag_of(tmp_path / "last") == "new"


def test_rotation_replaces_last_and_removes_prev(tmp_path):
    make_ckpt(tmp_path / "last", "old")
    rotate_into_place(make_ckpt(tmp_path / "last.tmp", "new"), tmp_path / "last")
    wait_for_purges()  # last.prev is removed in the background
    assert names(tmp_path) == ["last"]
    assert tag_of(tmp_path / "last") == "new"
    assert (tmp_path / "last" / "trainer.dcp" / "__0_0.distcp").read_text() == "new"


def test_rotation_with_stale_prev_and_last(tmp_path):
    make_ckpt(tmp_path / "last", "old")
    make_ckpt(tmp_path / "last.prev", "older")
    rotate_into_place(make_ckpt(tmp_path / "last.tmp", "new"), tmp_path / "last")
    wait_for_purges()  # last.prev is removed in the background
    assert names(tmp_path) == ["last"]
    assert tag_of(tmp_path / "last") == "new"


def test_rotation_after_interrupted_rotation(tmp_path):
    # a crash between the two renames leaves only last.prev: it must survive until the new last is in
    make_ckpt(tmp_path / "last.prev", "old")
    rotate_into_place(make_ckpt(tmp_path / "last.tmp", "new"), tmp_path / "last")
    wait_for_purges()  # last.prev is removed in the background
    assert names(tmp_path) == ["last"]
    assert tag_of(tmp_path / "last") == "new"


def test_crash_between_renames_leaves_previous_checkpoint(tmp_path, monkeypatch):
    make_ckpt(tmp_path / "last", "old")
    tmp = make_ckpt(tmp_path / "last.tmp", "new")
    real_rename = os.rename
    calls = []

    def crash_on_second(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:
            raise OSError(5, "simulated crash")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_second)
    with pytest.raises(OSError):
        rotate_into_place(tmp, tmp_path / "last")
    monkeypatch.undo()
    assert calls == [("last", "last.prev"), ("last.tmp", "last")]
    assert names(tmp_path) == ["last.prev", "last.tmp"]
    assert tag_of(tmp_path / "last.prev") == "old"
    # the next save publishes normally and drops the old copy
    rotate_into_place(tmp, tmp_path / "last")
    wait_for_purges()
    assert names(tmp_path) == ["last"] and tag_of(tmp_path / "last") == "new"


def test_a_superseded_checkpoint_that_cannot_be_removed_never_blocks_a_save(tmp_path, caplog):
    """Seen: the background removal of an undeletable last.prev failed, and then every later save failed
    ("checkpoint save failed: weights.pth: Operation not permitted"), naming the new checkpoint's file."""
    make_ckpt(tmp_path / "last", "old")
    try:
        with undeletable(tmp_path / "last") as stuck:
            rel = stuck.relative_to(tmp_path / "last")
            rotate_into_place(make_ckpt(tmp_path / "last.tmp", "new"), tmp_path / "last")
            assert wait_for_purges() == [tmp_path / "last.stale-1"]
            # one warning, naming the path that could not be removed (as it was then) and where it went
            warned = [r.getMessage() for r in caplog.records if "could not remove" in r.getMessage()]
            assert len(warned) == 1 and str(tmp_path / "last.prev" / rel) in warned[0], warned
            assert str(tmp_path / "last.stale-1") in warned[0]
            # the saves go on, under names that do not collide; the stale tree is retried quietly
            rotate_into_place(make_ckpt(tmp_path / "last.tmp", "newer"), tmp_path / "last")
            assert wait_for_purges() == [tmp_path / "last.stale-1"]
            assert names(tmp_path) == ["last", "last.stale-1"] and tag_of(tmp_path / "last") == "newer"
            assert tag_of(tmp_path / "last.stale-1") == "old"
            assert len([r for r in caplog.records if "could not remove" in r.getMessage()]) == 1
            assert [c.name for c in list_candidates(tmp_path)] == ["last"]  # never a resume candidate
    finally:
        release(tmp_path / "last.stale-1")
    # once it can be removed, the next save's retry removes it
    rotate_into_place(make_ckpt(tmp_path / "last.tmp", "newest"), tmp_path / "last")
    assert wait_for_purges() == []
    assert names(tmp_path) == ["last"] and tag_of(tmp_path / "last") == "newest"


def test_selection_prefers_last_prev_when_last_is_missing(tmp_path, trained_run):
    # a real checkpoint whose rotation stopped after last -> last.prev
    model = trained_run.copy_to(tmp_path) / "model"
    os.rename(model / "last", model / "last.prev")
    chosen, _ = select_resume(model)
    assert chosen is not None and chosen.name == "last.prev" and chosen.complete



def _resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache: mincore(2) over an untouched private mapping."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        first = ctypes.c_char.from_buffer(m)
        rc = libc.mincore(ctypes.addressof(first), size, vec)
        del first
    finally:
        m.close()
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux/Unix only")
def test_release_cached_pages_drops_the_cache_and_keeps_the_bytes(tmp_path):
    tree = tmp_path / "last"
    (tree / "trainer.dcp").mkdir(parents=True)
    files = {tree / "weights.pth": os.urandom(4 << 20), tree / "trainer.dcp" / "__0_0.distcp": os.urandom(2 << 20)}
    for path, data in files.items():
        path.write_bytes(data)
        atomic.fsync_file(path)
        assert path.read_bytes() == data  # read back: cached
        assert _resident_pages(path) > 0
    atomic.release_cached_pages(tree)
    for path, data in files.items():
        assert _resident_pages(path) == 0
        assert path.read_bytes() == data
    atomic.release_cached_pages(tmp_path / "missing")  # nothing to release: no error


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux/Unix only")
def test_page_release_follows_the_writer_a_fixed_distance_ahead(tmp_path):
    import mmap

    MiB, page = 1 << 20, mmap.PAGESIZE
    tree = tmp_path / "last"
    (tree / "trainer.dcp").mkdir(parents=True)
    shard, weights = tree / "trainer.dcp" / "__0_0.distcp", tree / "weights.pth"
    files = {shard: os.urandom(8 * MiB), weights: os.urandom(4 * MiB)}  # released in path order: the shard first
    for path, data in files.items():
        path.write_bytes(data)
        atomic.fsync_file(path)
        assert _resident_pages(path) == len(data) // page
    release = atomic.PageRelease(tree, ahead=2 * MiB)

    release.advance(0)  # before anything is written: the first `ahead` bytes only
    assert (_resident_pages(shard), _resident_pages(weights)) == (6 * MiB // page, 4 * MiB // page)
    release.advance(7 * MiB)  # 9 MiB: the shard, and not yet a whole 2 MiB (a folio) of the next
    assert (_resident_pages(shard), _resident_pages(weights)) == (0, 4 * MiB // page)
    release.advance(8 * MiB)
    assert _resident_pages(weights) == 2 * MiB // page
    release.finish()
    assert _resident_pages(weights) == 0
    assert all(path.read_bytes() == data for path, data in files.items())  # advice only: the bytes stay
    atomic.PageRelease(tmp_path / "missing").finish()  # nothing to release: no error
