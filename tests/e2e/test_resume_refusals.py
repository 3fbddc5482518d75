"""A refused or failed resume leaves the run directory exactly as it was: every file (config.toml,
provenance.json, status.json, metrics.jsonl, train.log, the checkpoints) byte for byte, nothing
added or removed, so a plain ``pimm resume`` afterwards resumes as before and ``--dry-run`` still
reports the run's own config. One row per way a resume is refused; each resume runs in this
process (``pimm_here``): they are refused before any rank would train."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from _helpers import describe, pimm_here, read_json

# overrides (after --) that make `pimm resume RUN` refuse; the stopped run (conftest) trained
# configs/digits.toml's MLP with AdamW (train.optimizer: one parameter group), stopped at step 50
REFUSALS = {
    "optimizer groups split": (["optimizer.name=AdamW"], 2, "parameter groups (1 -> 2)"),
    "optimizer class": (["train.optimizer=sgd"], 2, "torch.optim.adamw.AdamW -> torch.optim.sgd.SGD"),
    "model shape": (["model.hidden=64"], 1, "does not match the model"),
    "run key": (["run.group=other"], 2, "cannot change on pimm resume"),
    "corrupt checkpoint": ([], 1, "no intact checkpoint"),
    "no checkpoint": ([], 2, "no complete checkpoint"),
    "invalid override": (["data.batch_size=0"], 2, "data.batch_size"),
}


def _tree(run: Path) -> dict[str, str]:
    """Every entry under ``run``: its relative path -> sha256 of a file's bytes, or ``dir``/``link``."""
    out = {}
    for p in sorted(run.rglob("*")):
        rel = p.relative_to(run).as_posix()
        out[rel] = "link" if p.is_symlink() else "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def run(stopped_run, tmp_path) -> Path:
    dest = tmp_path / "digits" / "r"
    shutil.copytree(stopped_run, dest, symlinks=True)
    (dest / ".lock").touch()  # (every run `pimm launch` made has its lock file; the driver's run has none)
    return dest


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refused_resume_leaves_every_file_of_the_run_as_it_was(run, case):
    overrides, code, says = REFUSALS[case]
    if case == "corrupt checkpoint":  # its only checkpoint damaged: nothing intact to resume
        weights = run / "model" / "last" / "weights.pth"
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0xFF
        weights.write_bytes(bytes(data))
    if case == "no checkpoint":  # (model/ emptied: a wiped disk)
        shutil.rmtree(run / "model")
        (run / "model").mkdir()
    before = _tree(run)
    r = pimm_here("resume", str(run), *(["--", *overrides] if overrides else []))
    assert r.returncode == code, describe(r)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], describe(r)
    assert "Traceback" not in r.stdout + r.stderr
    assert _tree(run) == before  # nothing written, renamed, moved aside or removed
    assert read_json(run / "status.json")["state"] == "stopped"
    # the dry run says what the resume does (config.toml is still the run's own: the change is still one)
    dry = pimm_here("resume", str(run), "--dry-run", *(["--", *overrides] if overrides else []))
    assert dry.returncode == code and says in dry.stderr, describe(dry)
    assert _tree(run) == before
