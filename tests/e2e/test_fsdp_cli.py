"""The sharded-training CLI as a user drives it: what ``pimm launch``/``pimm resume``
(and their ``--dry-run``) say about ``train.blocks`` and FSDP options, one plain line and
the right exit code for every refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from _helpers import DIGITS, REPO, describe, pimm_here

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
