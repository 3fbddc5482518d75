"""Tensor parallel (``parallel.tp``) and FSDP x TP on real torchrun/gloo runs of the char LM.

Two launches (one at 4 ranks, one at 2, which also runs the Hugging Face plans' check) and a few
one-rank jobs in this process:

- A TP 2 run trains to the loss curve and weights of its one-rank DDP twin (the same
  batches: one data-parallel rank each), and writes plain full tensors to ``weights.pth``.
- A TP 2 run stopped at step 3 and resumed at the same layout ends bitwise equal to the
  uninterrupted one (policy ``same``, exact).
- Layout changes, each restoring model, optimizer and EMA exactly as saved (resharded by DCP):
  TP 2 -> one rank, one rank -> TP 2, FSDP 2 x TP 2 -> FSDP 2 (the ``layout`` row: the
  data-parallel ranks are the same, so each continues from the saved iteration), and that FSDP
  2 run's own checkpoint -> DDP 1 (one data-parallel rank fewer: the world-size row, the saved
  epoch restarts and the LR follows the new horizon).
- Export from the FSDP x TP run, whose weights stay sharded in ``trainer.dcp/``
  (``checkpoint.gather_weights = false``): plain full tensors; ``load_weights`` reads them.
- Bad layouts are one ``error:`` line before training (the 2-rank one under torchrun).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from _helpers import REPO, TORCHRUN, clean_env, describe, hang_s, pimm, pimm_here, read_json, read_jsonl
from _resume_driver import run_job

DRIVER = Path(__file__).with_name("_resume_driver.py")
CHARLM = REPO / "configs" / "charlm.toml"
# A tiny char LM (2 blocks, 2 heads), 6 steps of 2 micro-batches of 8 windows; EMA on (charlm.toml)
TINY = ["model.args.d_model=32", "model.args.n_layers=2", "model.args.n_heads=2", "model.args.dropout=0.0",
        "model.args.block_size=16", "data.args.block_size=16", "data.batch_size=8", "train.log_every_steps=1",
        "train.warmup_steps=2", "train.max_steps=6", "checkpoint.keep_full=2", "eval.batch_size=512"]
TP2 = [*TINY, "parallel.tp=2"]
FSDP = [*TINY, "train.strategy=fsdp"]
STOP = 3


def _job(run_dir: Path, overrides: list[str], **kw) -> dict:
    return {"run_dir": str(run_dir), "overrides": overrides, "config": str(CHARLM), **kw}


def _torchrun(jobs: list[dict], jobs_file: Path, nproc: int) -> subprocess.Popen:
    jobs_file.write_text(json.dumps(jobs))
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc),
           str(DRIVER), str(jobs_file)]
    return subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(proc: subprocess.Popen, timeout: float = 400) -> None:
    try:
        out, err = proc.communicate(timeout=hang_s(timeout))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-5000:]}"


def _here(run_dir: Path, overrides: list[str], **kw) -> None:
    """A one-rank job in this process (no process group is left behind)."""
    from pimm_core.process import dist

    try:
        run_job(run_dir, overrides, config=CHARLM, **kw)
    finally:
        dist.shutdown()


def _alongside(proc: subprocess.Popen, *jobs: tuple) -> None:
    """Run one-rank ``jobs`` here while ``proc`` (a torchrun launch) runs, then wait for it."""
    try:
        for run_dir, overrides, kw in jobs:
            _here(run_dir, overrides, **kw)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    _wait(proc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tp")
    only_load = {"stop_first": True, "checkpoint": False}
    # FSDP 2 x TP 2 on 4 ranks, stopped at step 3 (its weights only in trainer.dcp/)
    first = _torchrun([_job(root / "fxt", [*FSDP, "parallel.tp=2", "checkpoint.gather_weights=false"], stop_at=STOP,
                            full_dump=str(root / "dump-fxt"))], root / "first.json", nproc=4)
    _alongside(first, (root / "one", TINY, {"stop_at": STOP, "full_dump": root / "dump-one"}),
               (root / "ddp1", TINY, {"full_dump": root / "dump-ddp1"}))
    for src, dst in (("fxt", "to-fsdp2"), ("fxt", "fsdp2"), ("one", "one-to-tp2")):
        shutil.copytree(root / src, root / dst)
    second = _torchrun([
        _job(root / "tp2", TP2, full_dump=str(root / "dump-tp2")),
        _job(root / "cut", TP2, stop_at=STOP, full_dump=str(root / "dump-cut")),
        _job(root / "cut", TP2, resume_from=str(root / "cut" / "model" / "last"), full_dump=str(root / "dump-cut-end")),
        _job(root / "to-fsdp2", FSDP, resume_from=str(root / "to-fsdp2" / "model" / "last"),
             full_dump=str(root / "dump-to-fsdp2"), **only_load),
        _job(root / "fsdp2", FSDP, resume_from=str(root / "fsdp2" / "model" / "last"), max_steps=4,
             full_dump=str(root / "dump-fsdp2")),
        _job(root / "one-to-tp2", TP2, resume_from=str(root / "one-to-tp2" / "model" / "last"),
             full_dump=str(root / "dump-one-to-tp2"), **only_load),
        # the Hugging Face plans on the same two ranks (test_hugging_face_plans_...)
        {"script": str(Path(__file__).with_name("_tp_hf_worker.py")), "args": [str(root / "hf.json")]},
    ], root / "second.json", nproc=2)
    _wait(second)
    for src, dst in (("cut", "tp2-to1"), ("fsdp2", "fsdp2-to1")):
        shutil.copytree(root / src, root / dst)
    _here(root / "tp2-to1", TINY, resume_from=root / "tp2-to1" / "model" / f"full_{STOP}",
          full_dump=root / "dump-tp2-to1", **only_load)
    _here(root / "fsdp2-to1", TINY, resume_from=root / "fsdp2-to1" / "model" / "last",
          full_dump=root / "dump-fsdp2-to1", **only_load)
    return root


def _dump(root: Path, name: str) -> dict:
    return torch.load(root / f"dump-{name}.pt", map_location="cpu", weights_only=True)


def _differ(a, b, prefix: str = "") -> list[str]:
    """Names of the tensors (nested dicts/lists) that are not bitwise equal, or missing on one side."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = type(a) is type(b) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b)
        return [] if ok else [prefix or "<root>"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{prefix}: keys {sorted(map(str, a.keys() ^ b.keys()))[:4]}"]
        return [d for k in a for d in _differ(a[k], b[k], f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{prefix}: lengths {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differ(x, y, f"{prefix}[{i}]")]
    return [] if a == b else [f"{prefix}: {a!r} != {b!r}"]


def _trace(run: Path) -> dict[int, tuple[float, float]]:
    out: dict[int, tuple[float, float]] = {}
    for r in read_jsonl(run / "metrics.jsonl"):
        if r["split"] == "train":
            out.setdefault(r["step"], (r["loss"], r["lr"]))
    return out


def _start(run: Path) -> dict:
    """The last resume recorded in ``run``'s provenance."""
    starts = read_json(run / "provenance.json")["starts"]
    return next((s for s in reversed(starts) if s.get("kind") == "resume"), {"starts": starts})


def test_tp_trains_like_its_ddp_twin_and_saves_full_tensors(runs):
    tp, ddp = _trace(runs / "tp2"), _trace(runs / "ddp1")
    assert sorted(tp) == sorted(ddp) == list(range(1, 7))
    for step in tp:
        assert tp[step][1] == ddp[step][1]  # the same LR schedule
        assert tp[step][0] == pytest.approx(ddp[step][0], rel=1e-5, abs=1e-6), step
    got, want = _dump(runs, "tp2"), _dump(runs, "ddp1")
    for part in ("model", "ema"):
        assert got[part].keys() == want[part].keys()
        for k in got[part]:
            torch.testing.assert_close(got[part][k], want[part][k], rtol=1e-4, atol=1e-5, msg=f"{part} {k}")
    weights = torch.load(runs / "tp2" / "model" / "last" / "weights.pth", map_location="cpu", weights_only=True)
    for name in ("state_dict", "ema_state_dict"):  # plain tensors of the full shapes, the tied head still tied
        sd = weights[name]
        assert all(type(v) is torch.Tensor for v in sd.values())
        assert {k: v.shape for k, v in sd.items()} == {k: v.shape for k, v in want["model"].items()}
    assert weights["state_dict"]["head.weight"].data_ptr() == weights["state_dict"]["tok.weight"].data_ptr()
    assert _differ(weights["state_dict"], got["model"]) == []
    manifest = read_json(runs / "tp2" / "model" / "last" / "manifest.json")
    assert (manifest["tp"], manifest["world_size"]) == (2, 2)


def test_same_layout_resumes_bitwise(runs):
    assert _differ(_dump(runs, "cut-end"), _dump(runs, "tp2")) == []
    assert _trace(runs / "cut") == _trace(runs / "tp2")
    start = _start(runs / "cut")
    assert (start["kind"], start["step"], start["policy"], start["exact"]) == ("resume", STOP, "same", True)


@pytest.mark.parametrize("loaded,saved,row", [
    ("tp2-to1", "cut", "layout"),          # TP 2 (2 ranks) -> 1 rank
    ("one-to-tp2", "one", "layout"),       # 1 rank -> TP 2 (2 ranks)
    ("to-fsdp2", "fxt", "layout"),         # FSDP 2 x TP 2 (4 ranks) -> FSDP 2
    ("fsdp2-to1", "fsdp2", "world_size"),  # FSDP 2 -> DDP 1: one data-parallel rank fewer
])
def test_layout_changes_restore_the_saved_state_exactly(runs, loaded, saved, row):
    got, want = _dump(runs, loaded), _dump(runs, saved)
    if row == "world_size":  # fewer data-parallel ranks: more steps per epoch, the LR follows the new horizon
        for group in (*got["optim"]["param_groups"], *want["optim"]["param_groups"]):
            group.pop("lr")
    for part in ("model", "optim", "ema"):
        assert _differ(got[part], want[part]) == [], part
    start = _start(runs / loaded)
    assert (start["kind"], start["policy"], start["exact"]) == ("resume", row, False)
    if row == "layout":  # the same data-parallel ranks: it continues from the saved iteration
        assert (got["state"]["global_step"], got["state"]["iter"]) == (want["state"]["global_step"],
                                                                      want["state"]["iter"])
        assert any("parallel layout changed" in w for w in start["warnings"])
    else:  # the world-size rule: the saved epoch restarts from its first step
        assert got["state"]["epoch"] == want["state"]["epoch"] and got["state"]["iter"] == 0


def test_fsdp2_continues_from_the_fsdp_tp_checkpoint(runs):
    """The FSDP 2 leg resumed from FSDP 2 x TP 2's step 3 and trained on to step 4."""
    start = _start(runs / "fsdp2")
    assert (start["step"], start["policy"]) == (STOP, "layout")
    assert sorted(_trace(runs / "fsdp2"))[-1] == 4 and _dump(runs, "fsdp2")["state"]["global_step"] == 4


def test_export_and_load_weights_from_sharded_fsdp_tp_weights(runs, tmp_path):
    from safetensors.torch import load_file

    from examples.charlm.model import CharTransformer
    from pimm_core import load_weights

    fxt = runs / "fxt"
    assert not (fxt / "model" / "last" / "weights.pth").exists()
    done = pimm_here("export", "last", str(tmp_path / "out"), "--run-dir", str(fxt))
    assert done.returncode == 0, describe(done)
    exported = load_file(tmp_path / "out" / "model.safetensors")
    want = _dump(runs, "fxt")["model"]
    assert _differ({k: v for k, v in exported.items()}, {k: want[k] for k in exported}) == []
    model = CharTransformer(block_size=16, d_model=32, n_layers=2, n_heads=2)
    load_weights(model, fxt / "model" / "last")
    assert _differ(model.state_dict(), want) == []


def test_bad_layouts_are_one_line(tmp_path):
    """tp not dividing the world size (in this process), and tp not dividing the heads under torchrun."""
    done = pimm_here("launch", "--train.config", str(CHARLM), "--run.root", str(tmp_path), "--", *TINY, "parallel.tp=2")
    assert done.returncode != 0
    assert "error: parallel.tp = 2 does not divide the world size 1" in done.stderr, describe(done)
    assert "Traceback" not in done.stderr + done.stdout
    done = pimm("launch", "--train.config", str(CHARLM), "--run.root", str(tmp_path), "--nproc-per-node", "2", "--",
                *TINY, "model.args.n_heads=1", "parallel.tp=2", timeout=240)
    assert done.returncode != 0
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, describe(done)
    assert "parallel.tp = 2 does not divide the 1 attention heads of blocks.0 (n_heads)" in lines[0], describe(done)
    assert "Traceback" not in done.stderr + done.stdout
    assert not [r for p in tmp_path.rglob("metrics.jsonl") for r in read_jsonl(p) if r.get("split") == "train"]


def test_hugging_face_plans_compute_the_whole_models_logits_and_gradients(runs):
    """GPT-2 (MLP of each block, Conv1D) and Llama (attention and MLP) under TP 2 (_tp_hf_worker.py, a job of the
    second launch's two ranks)."""
    got = json.loads((runs / "hf.json").read_text())
    assert got["GPT2LMHeadModel"][2] == 2 * 2 * 2 and got["LlamaForCausalLM"][2] == 2 * 7  # weights (+ biases) sharded
    for name, (logits, grads, _) in got.items():
        assert logits < 1e-5 and grads < 1e-3, (name, logits, grads)


def test_dry_run_refuses_what_the_launch_refuses(tmp_path):
    base = ["launch", "--dry-run", "--train.config", str(CHARLM), "--run.root", str(tmp_path)]
    done = pimm_here(*base, "--nproc-per-node", "4", "--", *TINY, "parallel.tp=3")
    assert done.returncode != 0 and "error: parallel.tp = 3 does not divide the world size 4" in done.stderr, \
        describe(done)
    done = pimm_here(*base, "--nproc-per-node", "4", "--", *TINY, "parallel.tp=4", "train.strategy=fsdp",
                     "model.args.d_model=18")
    assert done.returncode != 0, describe(done)
    assert "error: parallel.tp = 4 does not divide the 18 output features of 'blocks.0.q'" in done.stderr, describe(done)
    assert not list(tmp_path.iterdir())  # nothing written


def test_dry_run_of_a_resume_names_the_layout_change(runs, tmp_path):
    done = pimm_here("launch", "--dry-run", "--train.config", str(CHARLM), "--run.root", str(tmp_path),
                     "--train.resume-from", str(runs / "cut" / "model" / f"full_{STOP}"), "--", *TINY)
    assert done.returncode == 0, describe(done)
    assert "policy: parallel layout changes" in done.stdout, describe(done)
    assert "tensor parallel: tp 2 x dp 1 -> tp 1 x dp 1" in done.stdout
    assert f"continue at: step {STOP}, epoch 0, iter {2 * STOP} (loader cursor restored; not bitwise: the parallel " \
           "layout changed)" in done.stdout
