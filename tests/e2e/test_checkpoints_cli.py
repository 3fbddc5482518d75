"""``pimm checkpoints ls|latest|verify`` on a real run: output, exit codes, damage detection, no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _helpers import REPO, clean_env, describe, hang_s, pimm


@pytest.fixture(scope="module")
def run(trained_run):
    assert trained_run.result.returncode == 0, describe(trained_run.result)
    return trained_run.run_dir


@pytest.fixture
def copy(trained_run, tmp_path):
    """A private copy of the trained run that a test may damage."""
    return trained_run.copy_to(tmp_path)


def ls_json(run_dir) -> dict:
    result = pimm("checkpoints", "ls", run_dir, "--json", timeout=60)
    assert result.returncode == 0, describe(result)
    return json.loads(result.stdout)


def test_ls_json_schema(run):
    data = ls_json(run)
    assert data["schema_version"] == 1
    assert data["model_dir"] == str(run / "model")
    assert data["selected"] == "last"
    rows = {c["name"]: c for c in data["candidates"]}
    assert set(rows) == {"last", "model_best.pth", "iter_100.pth", "iter_120.pth"}
    assert [c["name"] for c in data["candidates"] if c["selected"]] == ["last"]
    last = rows["last"]
    assert (last["kind"], last["format"], last["complete"], last["resumable"]) == ("last", "standard", True, True)
    assert (last["step"], last["epoch"], last["iter"]) == (135, 3, 0)
    assert last["reason"] is None and last["size"] > 0 and "val/acc" in last["metrics"]
    assert rows["model_best.pth"]["resumable"] is False
    assert rows["iter_120.pth"]["step"] == 120


def test_ls_accepts_model_dir_and_prints_table(run):
    assert ls_json(run / "model")["selected"] == "last"
    result = pimm("checkpoints", "ls", run, timeout=60)
    assert result.returncode == 0, describe(result)
    assert "resume would select: last" in result.stdout


def test_latest_prints_last(run):
    result = pimm("checkpoints", "latest", run / "model", timeout=60)
    assert result.returncode == 0, describe(result)
    assert result.stdout.strip() == str(run / "model" / "last")
    assert result.stderr == ""


def test_latest_explain(run):
    result = pimm("checkpoints", "latest", run / "model", "--explain", timeout=60)
    assert result.returncode == 0, describe(result)
    assert result.stdout.strip() == str(run / "model" / "last")
    assert "last: selected" in result.stderr
    assert "model_best.pth: rejected: weights only" in result.stderr


def test_latest_without_complete_marker_fails_and_explains(copy):
    (copy / "model" / "last" / ".complete").unlink()
    result = pimm("checkpoints", "latest", copy / "model", "--explain", timeout=60)
    assert result.returncode == 1, describe(result)
    assert result.stdout == ""
    assert "last: rejected: missing .complete" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error:")
    assert "Traceback" not in result.stderr
    data = ls_json(copy)
    assert data["selected"] is None
    last = next(c for c in data["candidates"] if c["name"] == "last")
    assert last["complete"] is False and "missing .complete" in last["reason"]


def test_latest_falls_back_to_last_prev(copy):
    (copy / "model" / "last").rename(copy / "model" / "last.prev")
    result = pimm("checkpoints", "latest", copy / "model", timeout=60)
    assert result.returncode == 0, describe(result)
    assert result.stdout.strip() == str(copy / "model" / "last.prev")


def test_latest_rejects_tmp_leftover(copy):
    (copy / "model" / "last").rename(copy / "model" / "last.tmp")
    result = pimm("checkpoints", "latest", copy / "model", "--explain", timeout=60)
    assert result.returncode == 1, describe(result)
    assert "last.tmp: rejected: temporary leftover" in result.stderr


def test_latest_on_missing_path_is_usage_error(tmp_path):
    result = pimm("checkpoints", "latest", tmp_path / "nope", timeout=60)
    assert result.returncode == 2, describe(result)
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error:")


def test_verify_intact_run(run):
    result = pimm("checkpoints", "verify", run, timeout=60)
    assert result.returncode == 0, describe(result)
    lines = result.stdout.strip().splitlines()
    assert "last: ok" in lines and "model_best.pth: ok" in lines and len(lines) == 4


def test_verify_reports_flipped_byte(copy):
    weights = copy / "model" / "last" / "weights.pth"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    result = pimm("checkpoints", "verify", copy, timeout=60)
    lines = result.stdout.strip().splitlines()
    assert "last: FAILED: weights.pth: sha256 mismatch" in lines, describe(result)
    assert "model_best.pth: ok" in lines
    # one candidate directly
    result = pimm("checkpoints", "verify", copy / "model" / "last", timeout=60)
    assert result.stdout.strip() == "last: FAILED: weights.pth: sha256 mismatch", describe(result)


def test_verify_reports_missing_shard(copy):
    (copy / "model" / "last" / "trainer.dcp" / "__0_0.distcp").unlink()
    result = pimm("checkpoints", "verify", copy, timeout=60)
    assert "last: FAILED: trainer.dcp/__0_0.distcp: missing" in result.stdout.splitlines(), describe(result)


def test_scripting_commands_do_not_import_torch(run):
    code = ("import sys; from pimm_core.cli import main; "
            f"main(['checkpoints', 'ls', {str(run)!r}, '--json']); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                            timeout=hang_s(60))
    assert result.returncode == 0, describe(result)
    assert result.stdout.strip().splitlines()[-1] == "False"
    for command in (["checkpoints", "latest", str(run / "model")], ["checkpoints", "verify", str(run)]):
        code = f"import sys; from pimm_core.cli import main; main({command!r}); print('torch' in sys.modules)"
        result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True,
                                text=True, timeout=hang_s(60))
        assert result.stdout.strip().splitlines()[-1] == "False", (command, describe(result))


def _ls(*args, columns: int):
    env = {**clean_env(), "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-m", "pimm_core.cli", "checkpoints", "ls", *map(str, args)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=hang_s(60))


def test_ls_at_80_columns_shows_whole_names(copy):
    import shutil

    model = copy / "model"
    shutil.copytree(model / "last", model / "last.prev")
    (model / "last.prev" / ".complete").unlink()  # a long status: incomplete: missing .complete
    (model / ".iter_100000.pth.123456.tmp").write_bytes(b"partial")
    result = _ls(copy, columns=80)
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    names = [c["name"] for c in ls_json(copy)["candidates"]]
    assert ".iter_100000.pth.123456.tmp" in names and "last.prev" in names
    for name in names:  # every name whole, as a word of its row
        assert any(name in line.split() for line in lines), (name, result.stdout)
    # the first line is the model directory's path, as long as the user's path is (longer than
    # 80 columns under pytest-xdist's per-worker temporary directories): the rows are what fit
    rows = lines[1:]
    assert "…" not in "\n".join(rows) and all(len(line) <= 80 for line in rows), result.stdout
    assert "incomplete: missing .complete" in result.stdout
    assert "temporary leftover of an interrupted save" in " ".join(" ".join(lines).split())
    assert lines[-1] == "resume would select: last"
    wide = _ls(copy, columns=140)
    assert wide.returncode == 0 and "…" not in wide.stdout
    assert all(any(name in line for line in wide.stdout.splitlines()) for name in names)


@pytest.mark.parametrize("what", ["empty", "not-a-run", "a-file"])
def test_ls_on_something_that_is_not_a_run_is_a_usage_error(tmp_path, what):
    path = tmp_path / "x"
    if what == "a-file":
        path.write_text("hi")
    else:
        path.mkdir()
        if what == "not-a-run":
            (path / "notes.txt").write_text("hi")
            (path / "sub").mkdir()
    result = _ls(path, columns=80)
    assert result.returncode == 2, describe(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and result.stdout == "", describe(result)
