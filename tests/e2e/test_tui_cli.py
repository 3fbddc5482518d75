"""Import rules of the console and its CLI entry points (`pimm tui`, `pimm checkpoints diff`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import REPO, clean_env, describe, hang_s, pimm
from tui_support import copy_run, tui_run


#: Every module of the watch layer (the console's and `checkpoints diff`'s readers).
WATCH = ", ".join(f"pimm_core.watch.{m}" for m in ("status", "metrics", "series", "snapshot", "candidates",
                                                   "resume_diff", "fmt", "runs", "runs_poll", "compare"))


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=hang_s(120))


def test_pimm_core_never_imports_textual() -> None:
    r = _python(f"import sys, pimm_core, pimm_core.cli, pimm_core.trainer, {WATCH}\n"
                "bad = sorted(m for m in sys.modules if m == 'textual' or m.startswith(('textual.', 'textual_plot')))\n"
                "assert not bad, bad\nassert 'torch' in sys.modules")
    assert r.returncode == 0, describe(r)


def test_cli_and_watch_import_neither_torch_nor_textual() -> None:
    r = _python(f"import sys, pimm_core.cli, {WATCH}\n"
                "bad = sorted(m for m in ('torch', 'textual', 'textual_plot') if m in sys.modules)\n"
                "assert not bad, bad")
    assert r.returncode == 0, describe(r)


def test_console_imports_without_torch() -> None:
    r = _python("import sys, pimm_tui\nassert 'textual' in sys.modules\nassert 'torch' not in sys.modules")
    assert r.returncode == 0, describe(r)


@pytest.mark.parametrize("what", ["missing", "file", "not-a-run"])
def test_tui_refuses_a_path_that_is_not_a_run(what: str, tmp_path: Path) -> None:
    path = tmp_path / "x"
    if what == "file":
        path.write_text("hi")
    elif what == "not-a-run":
        path.mkdir()
        (path / "notes.txt").write_text("hi")
    r = pimm("tui", path)
    assert r.returncode == 2, describe(r)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "run directory" in lines[0] and r.stdout == ""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tui_run(tmp_path_factory)


def test_checkpoints_diff(run: Path) -> None:
    r = pimm("checkpoints", "diff", run)
    assert r.returncode == 0, describe(r)
    assert "resume would pick this" in r.stdout
    assert "policy: same world size, strategy, per-rank micro-batch, accumulation window and per-rank workers" in r.stdout
    assert "replay boundary: none" in r.stdout
    fingerprint = next(line for line in r.stdout.splitlines() if line.startswith("data fingerprint"))
    assert fingerprint.endswith("(computed at launch)"), fingerprint
    assert "the planned data length and fingerprint are computed when the launch loads the data" in r.stdout
    samples = next(line for line in r.stdout.splitlines() if line.startswith("train samples"))
    assert samples.split()[2] == "1438" and samples.endswith("(computed at launch)"), samples
    assert "the training data changed (its length or fingerprint): discard loader cursor" in r.stdout

    r = pimm("checkpoints", "diff", run, "--nproc-per-node", "2", "--json", "--", "data.num_workers=2")
    assert r.returncode == 0, describe(r)
    d = json.loads(r.stdout)
    assert d["candidate"]["name"] == "last" and d["selected_by"] == "resume"
    assert d["recorded"]["world_size"] == 1 and d["planned"]["world_size"] == 2
    assert d["recorded"]["workers_per_rank"] == 0 and d["planned"]["workers_per_rank"] == 2
    assert d["plan"]["row"] == "world_size"
    assert "data.num_workers: 0 -> 2" in d["config_diff"]
    assert d["recorded"]["data_fingerprint"]
    # Same environment as the trainer's: the installed torch version, read without importing torch.
    assert d["planned"]["torch_version"] == d["recorded"]["torch_version"]

    r = pimm("checkpoints", "diff", run, "--checkpoint", "iter_40.pth")
    assert r.returncode == 0, describe(r)
    assert "weights only" in r.stdout


def test_checkpoints_diff_strategy_change(run: Path, tmp_path: Path) -> None:
    """Saved vs planned strategy: a row of the table, the policy row, a warning; an older manifest is ddp."""
    r = pimm("checkpoints", "diff", run, "--", "train.strategy=fsdp")
    assert r.returncode == 0, describe(r)
    lines = r.stdout.splitlines()
    row = next(line for line in lines if line.startswith("strategy "))
    assert row.split() == ["strategy", "ddp", "fsdp", "<-", "changed"], row
    assert "policy: strategy changes at the same world size (ddp <-> fsdp)" in r.stdout
    assert "discard: nothing" in lines
    assert any(line.startswith("warning: strategy changed ddp -> fsdp") for line in lines), lines
    assert "train.strategy: 'ddp' -> 'fsdp'" in r.stdout

    old = copy_run(run, tmp_path)  # a checkpoint written before manifests recorded the strategy
    path = old / "model" / "last" / "manifest.json"
    m = json.loads(path.read_text())
    del m["strategy"]
    path.write_text(json.dumps(m))
    r = pimm("checkpoints", "diff", old, "--json", "--", "train.strategy=fsdp")
    assert r.returncode == 0, describe(r)
    d = json.loads(r.stdout)
    assert (d["recorded"]["strategy"], d["planned"]["strategy"]) == ("ddp", "fsdp")
    assert d["plan"]["row"] == "strategy" and d["plan"]["restore_cursor"] == (d["candidate"]["iter"] > 0)
    assert (d["plan"]["topology"]["saved_strategy"], d["plan"]["topology"]["strategy"]) == ("ddp", "fsdp")
    assert any("taken as ddp" in n for n in d["notes"]), d["notes"]


def test_checkpoints_diff_errors(run: Path, tmp_path: Path) -> None:
    r = pimm("checkpoints", "diff", run, "--", "data.nope=1")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "data.nope" in r.stderr, describe(r)
    r = pimm("checkpoints", "diff", run, "--checkpoint", "iter_5.pth")
    assert r.returncode == 2 and "iter_5.pth" in r.stderr, describe(r)
    bare = copy_run(run, tmp_path)
    import shutil

    shutil.rmtree(bare / "model")
    r = pimm("checkpoints", "diff", bare)
    assert r.returncode == 1 and "no complete checkpoint" in r.stderr, describe(r)
    assert len(r.stderr.strip().splitlines()) == 1
