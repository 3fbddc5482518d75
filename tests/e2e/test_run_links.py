"""Paths and links at the run directory's border: pimm writes nothing through a link out of it, a wrong
kind of entry or a directory it cannot write is one line naming the path, and a manifest names only
files inside its checkpoint (``pimm_core.run.entries``, ``checkpoint.manifest.outside_names``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from _helpers import DIGITS, describe, pimm, pimm_here
from pimm_core.errors import UsageError
from pimm_core.run.entries import RunEntryError, check_run_entries, open_append
from pimm_core.run.log import log_handler
from pimm_core.run.metrics import MetricsWriter
from pimm_core.run.status import write_status

OUTSIDE_TEXT = "the user's own file\n"


def one_error_line(result: subprocess.CompletedProcess, code: int = 2) -> str:
    assert result.returncode == code, describe(result)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), describe(result)
    assert "Traceback" not in result.stdout + result.stderr
    return lines[0]


@pytest.fixture
def layout(tmp_path: Path):
    """``(root, run_dir, outside)``: an existing empty run directory ``root/g/r`` and a file outside it."""
    root = tmp_path / "exp"
    run = root / "g" / "r"
    run.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "file").write_text(OUTSIDE_TEXT)
    return root, run, outside


def launch_into(root: Path):
    return pimm_here("launch", "--train.config", DIGITS, "--run.root", root, "--run.name", "r", "--run.no-timestamp",
                     "--", "run.group=g", "train.epochs=1", "train.max_steps=2")


def _link_out(run: Path, name: str, outside: Path) -> None:
    (run / name).parent.mkdir(parents=True, exist_ok=True)
    (run / name).symlink_to(outside / "file")


def _loop(run: Path, name: str, outside: Path) -> None:
    (run / name).symlink_to(run / f"{name}.other")
    (run / f"{name}.other").symlink_to(run / name)


def _dir(run: Path, name: str, outside: Path) -> None:
    (run / name).mkdir(parents=True)


def _file(run: Path, name: str, outside: Path) -> None:
    (run / name).write_text("not a directory")


def _dir_link(run: Path, name: str, outside: Path) -> None:
    (run / name).symlink_to(outside, target_is_directory=True)


CASES = [
    ("train.log", _link_out), ("metrics.jsonl", _link_out), ("status.json", _link_out),
    ("provenance.json", _link_out), ("config.toml", _link_out), (".lock", _link_out), (".lock", _loop),
    (".lock", _dir), (".ranks.lock", _link_out), ("lock.json", _link_out), ("control", _file),
    ("control", _dir_link), ("control/stop", _dir), ("control/stop", _link_out), ("abandoned", _dir_link),
    ("metrics.jsonl", _dir), ("tensorboard", _dir_link),
]


@pytest.mark.parametrize("name, make", CASES, ids=[f"{n}-{m.__name__[1:]}" for n, m in CASES])
def test_launch_refuses_a_run_file_that_is_a_link_or_the_wrong_kind(layout, name, make):
    root, run, outside = layout
    make(run, name, outside)
    before = sorted(p.name for p in run.rglob("*"))
    line = one_error_line(launch_into(root))
    assert f"{run / name}" in line or f"{run / name.split('/')[0]}" in line, line
    assert (outside / "file").read_text() == OUTSIDE_TEXT and sorted(p.name for p in outside.iterdir()) == ["file"]
    assert sorted(p.name for p in run.rglob("*")) == before  # nothing written in the run either


def test_launch_refusal_is_one_line_from_the_console_script_too(layout):
    root, run, outside = layout
    _link_out(run, "train.log", outside)
    result = pimm("launch", "--train.config", DIGITS, "--run.root", root, "--run.name", "r", "--run.no-timestamp",
                  "--dry-run", "--", "run.group=g", timeout=120)
    assert "symbolic link" in one_error_line(result) and (outside / "file").read_text() == OUTSIDE_TEXT


def test_writers_never_follow_a_link_that_appears_later(tmp_path: Path):
    """The check at start is backed by the openers themselves (``O_NOFOLLOW``)."""
    outside = tmp_path / "outside.txt"
    outside.write_text(OUTSIDE_TEXT)
    for name, opener in (("metrics.jsonl", MetricsWriter), ("train.log", lambda p: log_handler(p.parent)),
                         ("x.log", open_append)):
        link = tmp_path / name
        link.symlink_to(outside)
        with pytest.raises(RunEntryError, match="symbolic link"):
            opener(link)
        link.unlink()
    assert outside.read_text() == OUTSIDE_TEXT
    with open_append(tmp_path / "plain.log") as f:  # a regular file is appended to
        f.write("a line\n")
    assert (tmp_path / "plain.log").read_text() == "a line\n"
    (tmp_path / "d.log").mkdir()
    with pytest.raises(RunEntryError, match="is a directory"):
        open_append(tmp_path / "d.log")


def test_check_run_entries_accepts_a_real_run(tmp_path: Path):
    run = tmp_path / "r"
    (run / "control").mkdir(parents=True)
    for name in ("train.log", "metrics.jsonl", "status.json", ".lock", "control/stop"):
        (run / name).write_text("")
    (run / "model").symlink_to(tmp_path, target_is_directory=True)  # a checkpoint disk elsewhere is allowed
    check_run_entries(run)
    assert issubclass(RunEntryError, UsageError)


# ------------------------------------------------------------------------------- pimm stop
def _live(run: Path) -> None:
    write_status(run, "running", step=3)  # this test process: alive, a fresh heartbeat


@pytest.mark.parametrize("name, make", [("control", _file), ("control", _dir_link), ("control/stop", _dir),
                                        ("control/stop", _link_out)])
def test_pimm_stop_refuses_control_entries(layout, name, make):
    _, run, outside = layout
    _live(run)
    make(run, name, outside)
    line = one_error_line(pimm("stop", run, timeout=60))
    assert str(run / name.split("/")[0]) in line, line
    assert (outside / "file").read_text() == OUTSIDE_TEXT and sorted(p.name for p in outside.iterdir()) == ["file"]


# ------------------------------------------------------------------------- read-only dirs
@contextlib.contextmanager
def read_only(path: Path):
    """``path`` made read-only for pimm: ``chmod`` when not root; as root (who ignores modes) a
    read-only bind mount of it over itself, else the test is skipped."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    ok = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode == 0
    if ok and subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", str(path)], capture_output=True)
        ok = False
    if not ok:
        pytest.skip("cannot make a read-only directory here (root without mount)")
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_read_only_run_directory_is_one_line(layout):
    root, run, _ = layout
    with read_only(run):
        line = one_error_line(launch_into(root))
    assert f"cannot write in {run} " in line, line


def test_pimm_stop_on_a_read_only_run_is_one_line(layout):
    _, run, _ = layout
    _live(run)
    with read_only(run):
        line = one_error_line(pimm("stop", run, timeout=60))
    assert f"cannot write in {run} " in line, line


def test_read_only_group_directory_is_one_line(tmp_path: Path):
    group = tmp_path / "exp" / "g"
    group.mkdir(parents=True)
    with read_only(group):
        line = one_error_line(launch_into(tmp_path / "exp"))
    assert f"cannot write in {group} " in line, line
    assert list(group.iterdir()) == []


def test_export_to_a_read_only_destination_is_one_line(trained_run, tmp_path: Path):
    dest = tmp_path / "ex"
    dest.mkdir()
    with read_only(dest):
        result = pimm("export", "last", dest / "out", "--run-dir", trained_run.run_dir, timeout=180)
        line = one_error_line(result)
    assert f"cannot write in {dest} " in line, line


# ------------------------------------------------------------------------------ manifests
def _add_outside_file(run: Path, rel: str, target: Path) -> None:
    manifest = run / "model" / "last" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"][rel] = {"size": target.stat().st_size, "sha256": hashlib.sha256(target.read_bytes()).hexdigest()}
    manifest.write_text(json.dumps(data))


@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_manifest_naming_a_file_outside_its_checkpoint_is_invalid(trained_run, tmp_path: Path, kind: str):
    """The outside file matches the size and sha256 recorded for it, so a verifier that read it
    would call ``last`` intact; it is invalid whatever the outside file holds."""
    run = trained_run.copy_to(tmp_path)
    outside = tmp_path / "hostname"
    outside.write_text("a file of the user's\n")
    rel = os.path.relpath(outside, run / "model" / "last") if kind == "relative" else str(outside)
    assert (rel.startswith("../") if kind == "relative" else rel.startswith("/"))
    _add_outside_file(run, rel, outside)

    result = pimm("checkpoints", "verify", run / "model" / "last", timeout=60)
    assert result.returncode == 1, describe(result)
    assert f"manifest names {rel!r}, a file outside its checkpoint" in result.stdout, describe(result)

    latest = pimm("checkpoints", "latest", run, "--explain", timeout=60)
    assert latest.returncode == 1 and latest.stdout == "", describe(latest)  # last was the only resumable one
    assert "last: rejected: failed verification (manifest names" in latest.stderr, describe(latest)
    outside.unlink()  # the outside file's state decides nothing
    again = pimm("checkpoints", "verify", run / "model" / "last", timeout=60)
    assert again.stdout == result.stdout


def test_resume_skips_a_manifest_naming_outside_files(trained_run, tmp_path: Path):
    run = trained_run.copy_to(tmp_path)
    _add_outside_file(run, "../../../../../etc/hostname" if Path("/etc/hostname").is_file() else "/etc/passwd",
                      Path("/etc/hostname") if Path("/etc/hostname").is_file() else Path("/etc/passwd"))
    result = pimm_here("resume", run, "--dry-run")
    line = one_error_line(result, code=1)
    assert "no intact checkpoint" in line and "outside its checkpoint" in line, line


def test_relative_symlink_out_of_the_checkpoint_is_outside(tmp_path: Path):
    from pimm_core.checkpoint.records.manifest import outside_names

    ck = tmp_path / "last"
    ck.mkdir()
    (tmp_path / "secret").write_text("x")
    (ck / "weights.pth").symlink_to("../secret")
    (ck / "ok.pth").write_text("y")
    problems = outside_names(ck, {"weights.pth": {}, "ok.pth": {}, "sub/../../secret": {}, "": {}})
    assert [p.split("'")[1] for p in problems] == ["weights.pth", "sub/../../secret", ""]


def test_python_api_trainer_refuses_a_linked_control_dir(tmp_path: Path):
    """A Trainer started from Python (no ``pimm launch``, no run lock) checks the same entries before it
    writes or removes anything: a ``control`` link out of the run would have its ``stop`` deleted."""
    from pimm_core import Trainer
    from pimm_core.config import load_config

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "stop").write_text(OUTSIDE_TEXT)
    cfg = load_config(DIGITS, ["train.epochs=1", "train.max_steps=1"],
                      {"run.root": str(tmp_path / "exp"), "run.name": "r", "run.no_timestamp": True})
    run = tmp_path / "exp" / cfg.run.group / "r"
    run.mkdir(parents=True)
    (run / "control").symlink_to(outside, target_is_directory=True)
    with pytest.raises(RunEntryError, match="control is a symbolic link"):
        Trainer(cfg, run_dir=run).train()
    assert (outside / "stop").read_text() == OUTSIDE_TEXT
