"""The sharded-training CLI as a user drives it: what ``pimm launch``/``pimm resume``
(and their ``--dry-run``) say about ``train.blocks`` and FSDP options, one plain line and
the right exit code for every refusal; and checkpoints of the other formats resumed
under FSDP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _helpers import DIGITS, REPO, describe, launch, pimm_here, read_json
from _resume_driver import run_job

CHARLM = REPO / "configs" / "charlm.toml"


@pytest.mark.parametrize("config,blocks,message", [
    (None, '["Nope"]', "'Nope' matches no submodule of the model"),
    # charlm ties its embedding to its head: a Linear unit would split the tie
    (CHARLM, '["Linear"]', "parameter 'tok.weight' is tied to 'head.weight'"),
])
def test_dry_run_refuses_the_blocks_the_launch_refuses(tmp_path: Path, config, blocks, message):
    """``--dry-run`` builds the model and picks ``train.blocks`` as the launch does, so a
    block the launch would refuse is refused here too (it used to say the run was fine)."""
    overrides = ["train.strategy=fsdp", f"train.blocks={blocks}", "train.max_steps=2"]
    r = pimm_here("launch", "--train.config", str(config or DIGITS), "--run.root", str(tmp_path),
                  "--run.name", "d", "--run.no-timestamp", "--dry-run", "--", *overrides)
    assert r.returncode == 2, describe(r)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: train.blocks: ") and message in lines[0], describe(r)
    assert "dry run: nothing was trained" not in r.stdout
    assert not any(tmp_path.iterdir())


def _same(a, b, at: str = "") -> list[str]:
    """Names of the tensors (nested dicts/lists) that are not bitwise equal or missing."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if ok else [at]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{at}: keys {sorted(map(str, a.keys() ^ b.keys()))[:4]}"]
        return [d for k in a for d in _same(a[k], b[k], f"{at}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{at}[{i}]")]
    return [] if a == b else [f"{at}: {a!r} != {b!r}"]


@pytest.mark.parametrize("fmt,stop", [("single", 10), ("legacy", 45)])  # legacy: at an epoch end (45 steps),
def test_a_file_format_checkpoint_resumes_under_fsdp_exactly(tmp_path: Path, fmt, stop):  # nothing replays
    """A DDP run that wrote ``checkpoint_format = "single"``/``"legacy"`` files, resumed with
    ``train.strategy = "fsdp"`` (and ``checkpoint_format = "standard"``): the full optimizer
    state in the file is split into the new shards, as the dry run promises ("resharded"),
    instead of plain tensors that crashed the first optimizer step."""
    from pimm_core.process import dist

    run = tmp_path / "run"
    common = ["ema.enabled=true", "train.epochs=2"]
    try:
        run_job(run, [*common, f"checkpoint_format={fmt}"], stop_at=stop, full_dump=tmp_path / "saved")
        last = run / "model" / ("model_last.pth" if fmt == "legacy" else "last")
        run_job(run, [*common, "train.strategy=fsdp", 'train.blocks=["Linear"]'], resume_from=last,
                max_steps=1, checkpoint=False, full_dump=tmp_path / "loaded")
        run_job(run, [*common, "train.strategy=fsdp", f"train.max_steps={stop + 2}"], resume_from=last)  # trains on
    finally:
        dist.shutdown()
    saved, loaded = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("saved", "loaded"))
    for part in ("model", "optim", "ema"):
        assert _same(saved[part], loaded[part], part) == []
    assert loaded["state"]["global_step"] == stop
    assert read_json(run / "model" / "last" / "manifest.json")["step"] == stop + 2


def test_units_kept_gathered_after_forward_save_after_an_evaluation(tmp_path: Path):
    """``fsdp.reshard_after_forward = false`` at 2 ranks: the evaluation's forward left the
    gathered parameters registered, and the save after it died in every rank
    (get_optimizer_state_dict: KeyError); the evaluation now reshards."""
    r = launch(tmp_path, "kept", "train.strategy=fsdp", "fsdp.reshard_after_forward=false", "ema.enabled=true",
               'eval.weights="ema"', "train.epochs=1", nproc=2)
    assert r.returncode == 0, describe(r)
    assert read_json(tmp_path / "digits" / "kept" / "model" / "last" / "manifest.json")["step"] == 23
