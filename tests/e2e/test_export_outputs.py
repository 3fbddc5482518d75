"""Outputs never destroy what pimm did not write: an export's temporary names, what ``--force`` may
replace, and weights files written into a run's checkpoints.

A real run (conftest's ``trained_run``, copied) is the source; each refusal is one ``error:``
line with exit 2 and leaves every file of the run (and the user's files) as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _helpers import clean_env, pimm, pimm_here, snapshot
from pimm_core.checkpoint.export.model_dir import export, export_weights
from pimm_core.checkpoint.select.selection import select_resume
from pimm_core.errors import UsageError


def _user_dir(path: Path, text: str) -> Path:
    path.mkdir(parents=True)
    (path / "notes.txt").write_text(text)
    (path / "sub").mkdir()
    (path / "sub" / "data.bin").write_bytes(b"\x00\x01" * 100)
    return path


def test_export_leaves_siblings_named_like_its_temporaries(trained_run, tmp_path: Path) -> None:
    run = trained_run.copy_to(tmp_path)
    ex = tmp_path / "ex"
    for name in ("out.tmp", "out.old", ".out.tmp", "out.prev"):
        _user_dir(ex / name, f"user's {name}")
    before = snapshot(ex)
    r = pimm_here("export", "--run-dir", run, "last", ex / "out")
    assert r.returncode == 0, r.stderr
    r = pimm_here("export", "--run-dir", run, "best", ex / "out", "--force")  # replacing its own export
    assert r.returncode == 0, r.stderr
    after = snapshot(ex)
    assert {k: v for k, v in after.items() if not k.startswith("out/")} == before
    assert sorted(p.name for p in (ex / "out").iterdir()) == ["config.json", "export.json", "model.safetensors"]
    assert sorted(p.name for p in ex.iterdir()) == [".out.tmp", "out", "out.old", "out.prev", "out.tmp"]


def test_an_export_directory_has_the_permissions_of_any_directory_the_user_makes(trained_run, tmp_path: Path) -> None:
    """The export is built in a private temporary directory and renamed into place: the output
    must not stay owner-only (0700) but get what the umask gives a new directory (0755 at 022)."""
    run = trained_run.copy_to(tmp_path)
    old = os.umask(0o022)
    try:
        r = pimm_here("export", "--run-dir", run, "last", tmp_path / "out")
        (tmp_path / "mine").mkdir()
    finally:
        os.umask(old)
    assert r.returncode == 0, r.stderr
    assert oct((tmp_path / "out").stat().st_mode & 0o777) == oct((tmp_path / "mine").stat().st_mode & 0o777) == "0o755"


def test_force_never_replaces_a_run_a_checkpoint_or_what_holds_one(trained_run, tmp_path: Path) -> None:
    run = trained_run.copy_to(tmp_path / "runs")
    chosen, _ = select_resume(run / "model")
    assert chosen is not None and chosen.name == "last"
    before = snapshot(tmp_path)
    for out, why in ((run / "model" / "last", "where a run keeps its checkpoints"),  # its own source
                     (run / "model" / "last" / "trainer.dcp", "inside the checkpoint"),
                     (run / "model", "it holds checkpoints"),
                     (run, "it is a run directory"),
                     (tmp_path / "runs", "it holds run directories")):
        r = pimm_here("export", "--run-dir", run, "last", out, "--force", cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (out, r.stderr)
        assert why in lines[0], (out, lines[0])
    assert snapshot(tmp_path) == before
    again, _ = select_resume(run / "model")
    assert again is not None and (again.name, again.step, again.generation) == (chosen.name, chosen.step,
                                                                                 chosen.generation)


def test_force_into_the_current_directory_is_one_line(trained_run, tmp_path: Path) -> None:
    run = trained_run.copy_to(tmp_path / "runs")
    here = _user_dir(tmp_path / "work", "mine")
    before = snapshot(tmp_path)
    # a real process: `.` is resolved against its own working directory
    r = pimm("export", "--run-dir", run, "last", ".", "--force", cwd=here)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr
    # an empty working directory, or one holding a previous export, is not replaced either (the shell is in it)
    prev = export(run / "model" / "last", tmp_path / "prev")
    r = pimm_here("export", "--run-dir", run, "last", ".", "--force", cwd=prev)
    assert r.returncode == 2 and "current directory" in r.stderr, r.stderr
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("prev/")} == before


def test_exported_weights_files_never_overwrite_a_checkpoint(trained_run, tmp_path: Path) -> None:
    run = trained_run.copy_to(tmp_path)
    model = run / "model"
    before = snapshot(run)
    for target in (model / "last" / "weights.pth", model / "model_best.pth", model / "iter_new.safetensors",
                   model / "last" / "extra.bin"):
        with pytest.raises(UsageError) as e:
            export_weights(model / "last", target)
        assert e.value.exit_code == 2 and "checkpoint" in str(e.value)
    with pytest.raises(UsageError, match="inside the checkpoint"):
        export(model / "last", model / "last" / "exported")
    assert snapshot(run) == before
    export_weights(model / "last", tmp_path / "w.safetensors")  # anywhere else is fine
    assert os.path.getsize(tmp_path / "w.safetensors") > 0


def _hidden(ex: Path) -> list[str]:
    return sorted(p.name for p in ex.iterdir() if p.name.startswith("."))


def test_a_killed_exports_hidden_temporaries_are_cleaned_by_the_next_export(trained_run, tmp_path: Path) -> None:
    """``kill -9`` while an export is written leaves ``.OUT.pimm-export-*.tmp`` (and its owner file);
    killed in a ``--force`` replacement after the previous export was set aside, ``OUT`` is missing.
    The next export to ``OUT`` cleans the first and puts the previous export back (so it still needs
    ``--force`` to be replaced); a user's own hidden directory there is left alone."""
    run = trained_run.copy_to(tmp_path)
    ex = tmp_path / "ex"
    _user_dir(ex / ".out.pimm-export-mine.tmp", "user's look-alike without an owner file")
    killed = pimm("export", "--run-dir", run, "last", ex / "out", env={**clean_env(), "PIMM_FAILPOINT": "export.written"})
    assert killed.returncode == -9, killed.stderr
    left = [n for n in _hidden(ex) if n != ".out.pimm-export-mine.tmp"]
    assert len(left) == 2 and left[1] == f"{left[0]}.lock", left  # the export's directory and owner file
    r = pimm_here("export", "--run-dir", run, "last", ex / "out")
    assert r.returncode == 0, r.stderr
    assert _hidden(ex) == [".out.pimm-export-mine.tmp"]
    first = snapshot(ex / "out")

    killed = pimm("export", "--run-dir", run, "best", ex / "out", "--force",
                  env={**clean_env(), "PIMM_FAILPOINT": "export.set_aside"})
    assert killed.returncode == -9, killed.stderr
    assert not (ex / "out").exists()
    r = pimm_here("export", "--run-dir", run, "best", ex / "out")  # no --force: the previous export is back
    assert r.returncode == 2 and "--force" in r.stderr, r.stderr
    assert snapshot(ex / "out") == first
    assert _hidden(ex) == [".out.pimm-export-mine.tmp"]
    r = pimm_here("export", "--run-dir", run, "best", ex / "out", "--force")
    assert r.returncode == 0, r.stderr
    assert _hidden(ex) == [".out.pimm-export-mine.tmp"] and snapshot(ex / "out") != first
