"""Standard checkpoints of sharded (FSDP2) models, with real ranks (torchrun, gloo, CPU).

``_sharded_worker.py`` saves and loads through pimm's checkpoint layer; every load compares
the restored model, optimizer (FQN-keyed, gathered) and EMA state with what the saver had,
bitwise. Three sessions, in order (later ones read the earlier ones' checkpoints; a launch costs
mostly its start, so there are two, and the one-rank session runs in the test's own process):

- 2 ranks: ``s2`` (sharded), ``g2`` (sharded, ``gather_weights=False``: no weights.pth),
  ``a2`` (sharded, written in the background); loads 2 -> 2, sharded -> plain (DDP-like:
  every rank a full model), warm start from ``g2`` into a sharded model;
- 1 rank (FSDP over a process group of size 1, as the trainer makes it, and a plain model):
  ``s1`` (sharded), ``p1`` (plain: the files a DDP or single-process run writes); loads
  2 -> 1, sharded -> plain single process, and ``g2``'s weights read without weights.pth:
  ``read_checkpoint_weights``, ``pimm export``'s function, a plain warm start; a model of
  another shape refused before anything loads;
- 3 ranks: 2 -> 3 and 1 -> 3 (uneven shards: 10 and 5 rows), from ``s2``, ``g2`` and ``s1``,
  and plain -> sharded from ``p1``.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
from pathlib import Path

import pytest
import torch

import _sharded_worker
from _helpers import REPO, TORCHRUN, clean_env, hang_s, pimm_here
from pimm_core.checkpoint.records.manifest import read_manifest
from pimm_core.checkpoint.tensors.safe_read import read_dcp_metadata
from pimm_core.checkpoint.select.selection import select_resume
from pimm_core.checkpoint.weights.sources import resolve_weight_source
from pimm_core.checkpoint.weights.read import read_weight_sets

WORKER = Path(__file__).with_name("_sharded_worker.py")
LAUNCHES = (
    (2, "save:s2:fsdp,load:s2:fsdp,save:g2:fsdp:nogather,save:a2:fsdp:async,load:a2:fsdp,load:s2:plain,warm:g2"),
    (None, "save:s1:fsdp,save:p1:plain,load:s2:fsdp,load:s2:plain,load:g2:fsdp,read:g2,bad:g2"),
    (3, "load:s2:fsdp,load:g2:fsdp,load:s1:fsdp,load:p1:fsdp"),
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The checkpoints root and every ``ok ...`` line the launches printed."""
    root = tmp_path_factory.mktemp("sharded")
    passed: list[str] = []
    for nproc, mode in LAUNCHES:
        if nproc is None:  # one rank: in this process (a process group of one, destroyed after), no start of its own
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                _sharded_worker.run(mode, root)
            stdout = out.getvalue()
        else:
            r = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node",
                                str(nproc), str(WORKER), mode, str(root)], cwd=REPO, env=clean_env(),
                               capture_output=True, text=True, timeout=hang_s(300))
            assert r.returncode == 0, f"{nproc} ranks, {mode}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
            stdout = r.stdout
        passed += [line[3:] for line in stdout.splitlines() if line.startswith("ok ")]
    return root, passed


def test_sharded_save_loads_exactly_at_the_same_world_size(runs) -> None:
    _, passed = runs
    assert "load s2 into sharded x2" in passed
    assert "load a2 into sharded x2" in passed  # background save: what was staged, not the step after


def test_sharded_state_reshards_across_world_sizes(runs) -> None:
    _, passed = runs
    for check in ("load s2 into sharded x1", "load g2 into sharded x1", "load s2 into sharded x3",
                  "load g2 into sharded x3", "load s1 into sharded x3"):
        assert check in passed


def test_plain_and_sharded_checkpoints_load_into_each_other(runs) -> None:
    root, passed = runs
    for check in ("load p1 into sharded x3", "load s2 into plain x2", "load s2 into plain x1"):
        assert check in passed
    # the weights.pth of a sharded save is the full state dict, ties kept, like a plain one's:
    # gathered (s2), or read back from the shards by the background thread (a2)
    for name in ("s2", "a2"):
        ref = torch.load(root / f"{name}.ref.pt", weights_only=True)
        sets = read_weight_sets(root / name / "last" / "weights.pth")
        assert sets["raw"].keys() == ref["model"].keys(), name
        assert all(torch.equal(sets["raw"][k], v) and sets["raw"][k].dtype == v.dtype
                   for k, v in ref["model"].items()), name
        assert sets["raw"]["proj2.weight"] is sets["raw"]["proj1.weight"], name
        assert all(torch.equal(sets["ema"][k], v) for k, v in ref["ema"].items()), name


def test_unsharded_save_writes_what_it_always_did(runs) -> None:
    root, _ = runs
    plain, sharded = root / "p1" / "last", root / "s1" / "last"
    assert sorted(p.name for p in plain.iterdir()) == [".complete", "manifest.json", "trainer.dcp", "weights.pth"]
    assert "weights" not in read_manifest(plain / "manifest.json")
    saved = read_dcp_metadata(plain / "trainer.dcp" / ".metadata").state_dict_metadata
    assert not [k for k in saved if k.startswith(("model/", "ema/"))]
    assert set(read_weight_sets(plain / "weights.pth")) == {"raw", "ema"}
    keys = read_dcp_metadata(sharded / "trainer.dcp" / ".metadata").state_dict_metadata
    assert "model/inp.weight" in keys and "ema/inp.weight" in keys and "model/proj2.weight" not in keys  # tied: once


def test_weights_kept_sharded_are_read_without_weights_pth(runs) -> None:
    root, passed = runs
    ckpt = root / "g2" / "last"
    assert not (ckpt / "weights.pth").exists()
    assert read_manifest(ckpt / "manifest.json")["weights"] == "trainer.dcp"
    chosen, _ = select_resume(root / "g2")
    assert chosen is not None and Path(chosen.path) == ckpt  # complete, and its files verify
    assert resolve_weight_source(ckpt) == ckpt / "trainer.dcp"
    r = pimm_here("checkpoints", "latest", str(root / "g2"))
    assert r.returncode == 0 and r.stdout.strip() == str(ckpt)
    # read_checkpoint_weights, export and a plain warm start (rank 0, no process group), a sharded
    # warm start; a resume into a model of other shapes is refused naming them
    assert {"read g2", "warm g2 into sharded x2", "refused g2"} <= set(passed)
