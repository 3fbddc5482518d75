"""Checkpoint formats and warm start end to end through the real Trainer (issue 5).

Every run is a tiny in-process digits run (2 epochs of 45 steps, dropout 0.3, EMA on,
one thread) through the public API; a stop requested from ``trainer.callbacks`` after
global step K is the interruption.

- Round trips: for ``standard`` and ``single`` (K mid-epoch) and ``legacy`` (K at an
  epoch end) an uninterrupted run and an interrupted + resumed run end with bitwise-equal
  raw and EMA weight sets; a mid-epoch ``legacy`` file replays from the epoch boundary
  (provenance and train.log say so).
- ``single``: ``last``/``best``/``final`` are relative symlinks, a stop moves ``last`` but
  not ``final``, ``checkpoint.keep_last=1`` never deletes a pointer target, and a run
  directory moved elsewhere resumes from its ``model/last`` and finishes.
- Warm start through the trainer: ``pimm launch --train.weight RUN/model/last`` in this
  process (report, provenance, fresh optimizer/step), a different head, a DDP-prefixed
  save, EMA weights of a single-format pointer, a legacy file; zero match and a missing
  path exit 2 with one line.

The weight readers and the warm-start function themselves are unit-tested in
``test_weights.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from _api_runs import assert_same_tensors, listing, make_config, one_thread, pimm_logging, train
from _helpers import DIGITS, describe, pimm_here, read_json, read_jsonl
from pimm_core.checkpoint.weights.read import read_weight_sets

STEPS = 45  # optimizer steps per epoch (1,437 training samples, batch 32)
K_MID = 50  # epoch 1, iter 5
COMMON = ("train.epochs=2", "model.dropout=0.3", "ema.enabled=true", "ema.decay=0.9", "train.log_every_steps=1")
STANDARD = (*COMMON, "checkpoint_format=standard")
LEGACY = (*COMMON, "checkpoint_format=legacy")
# step saves every 20 steps (mid-epoch, `last` only) so that retention has files to prune
SINGLE = (*COMMON, "checkpoint_format=single", "checkpoint.keep_last=1", "checkpoint.every_steps=20",
          "checkpoint.keep_iter=0")
STEP_FILE = re.compile(r"^step_(\d+)\.pth$")


def _starts(run: Path) -> list[dict]:
    return read_json(run / "provenance.json")["starts"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("formats")
    moved_root = tmp_path_factory.mktemp("moved")
    out: dict = {"root": root}
    with one_thread():
        # standard: uninterrupted / interrupted mid-epoch + resumed
        train(root / "std-full", STANDARD)
        train(root / "std-cut", STANDARD, stop_at=K_MID)
        train(root / "std-cut", STANDARD, resume_from=root / "std-cut" / "model" / "last")

        # legacy: uninterrupted / stopped in the last window of epoch 0 / stopped mid-epoch
        train(root / "leg-full", LEGACY)
        train(root / "leg-end", LEGACY, stop_at=STEPS)
        out["leg-end-before"] = read_jsonl(root / "leg-end" / "metrics.jsonl")
        out["leg-end-file"] = torch.load(root / "leg-end" / "model" / "model_last.pth", weights_only=True)["progress"]
        train(root / "leg-end", LEGACY, resume_from=root / "leg-end" / "model" / "model_last.pth")
        train(root / "leg-mid", LEGACY, stop_at=K_MID)
        out["leg-mid"] = train(root / "leg-mid", LEGACY, resume_from=root / "leg-mid" / "model" / "model_last.pth")

        # single: uninterrupted, listing the model directory after every step
        snaps: dict[int, dict[str, str]] = {}
        train(root / "single-full", SINGLE,
              callbacks=(lambda tr: snaps.__setitem__(tr.state.global_step, listing(root / "single-full" / "model")),))
        out["single-snaps"] = snaps
        out["single-full-end"] = listing(root / "single-full" / "model")
        # interrupted mid-epoch, then the whole run directory moves elsewhere and resumes there
        train(root / "single-cut", SINGLE, stop_at=K_MID)
        out["single-after-stop"] = listing(root / "single-cut" / "model")
        moved = moved_root / "single-cut"
        shutil.move(root / "single-cut", moved)
        out["single-moved-state"] = train(moved, SINGLE, resume_from=moved / "model" / "last").state
        out["single-moved"] = moved
        out["single-moved-end"] = listing(moved / "model")
        # a finished run extended by an epoch and stopped: `last` moves, `final` stays
        shutil.copytree(root / "single-full", root / "single-ext", symlinks=True)
        train(root / "single-ext", [*SINGLE, "train.epochs=3"], stop_at=2 * STEPS + 5,
              resume_from=root / "single-ext" / "model" / "last")
        out["single-ext-end"] = listing(root / "single-ext" / "model")
    return out


# ------------------------------------------------------------------ round trips
def _final_sets(run: Path, fmt: str) -> dict[str, dict[str, torch.Tensor]]:
    model = run / "model"
    path = {"standard": model / "last" / "weights.pth", "legacy": model / "model_last.pth",
            "single": model / "final"}[fmt]
    return read_weight_sets(path)


@pytest.mark.parametrize("fmt,full,cut", [("standard", "std-full", "std-cut"), ("single", "single-full", None),
                                          ("legacy", "leg-full", "leg-end")])
def test_resumed_raw_and_ema_bitwise_equal(runs, fmt, full, cut):
    cut_dir = runs["single-moved"] if cut is None else runs["root"] / cut
    a, b = _final_sets(runs["root"] / full, fmt), _final_sets(cut_dir, fmt)
    assert sorted(a) == sorted(b) == ["ema", "raw"]
    assert_same_tensors(a["raw"], b["raw"])
    assert_same_tensors(a["ema"], b["ema"])
    # the EMA set is a real average, not a copy of the raw weights
    assert any(not torch.equal(a["raw"][k], a["ema"][k]) for k in a["raw"])
    resume = [s for s in _starts(cut_dir) if s["kind"] == "resume"]
    assert len(resume) == 1 and resume[0]["exact"] is True and resume[0]["replay_boundary"] is None
    assert resume[0]["policy"] == ("legacy" if fmt == "legacy" else "same")
    assert resume[0]["checkpoint_step"] == (STEPS if fmt == "legacy" else K_MID)
    assert read_json(cut_dir / "status.json")["state"] == "finished"
    # same evaluations as the uninterrupted run
    val = lambda run: [(r["step"], r["loss"], r["acc"]) for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "val"]
    assert val(cut_dir) == val(runs["root"] / full)


def test_legacy_stop_in_last_window_saves_after_eval(runs):
    """K = steps_per_epoch: the epoch's evaluation runs, then model_last.pth says (epoch 1, iter 0)."""
    progress = runs["leg-end-file"]
    assert (progress["global_step"], progress["epoch"], progress["iter"]) == (STEPS, 1, 0)
    val = [r for r in runs["leg-end-before"] if r["split"] == "val"]
    assert [(r["step"], r["epoch"]) for r in val] == [(STEPS, 0)]
    assert progress["last_eval"]["val/acc"] == val[0]["acc"]


def test_legacy_mid_epoch_replays_from_epoch_boundary(runs):
    run = runs["root"] / "leg-mid"
    resume = [s for s in _starts(run) if s["kind"] == "resume"]
    assert len(resume) == 1
    r = resume[0]
    assert r["policy"] == "legacy" and r["exact"] is False
    assert r["replay_boundary"] == {"epoch": 1, "step": STEPS, "from_iter": K_MID - STEPS}
    assert (r["step"], r["epoch"], r["iter"], r["checkpoint_step"]) == (STEPS, 1, 0, K_MID)
    assert any("replay" in w for w in r["warnings"])
    log = runs["leg-mid"].test_log  # the rank-0 log lines (what `pimm launch` prints)
    assert any(level == "WARNING" and "batches already completed in that epoch will replay" in msg
               for level, msg in log), log[:5]
    # the replayed steps are trained again and the run still ends at the configured length; each step
    # is in metrics.jsonl once, the interrupted run's records after the boundary kept aside
    steps = [x["step"] for x in read_jsonl(run / "metrics.jsonl") if x["split"] == "train"]
    assert steps == list(range(1, 2 * STEPS + 1))
    aside = [x["step"] for x in read_jsonl(run / "metrics.superseded.jsonl") if x["split"] == "train"]
    assert aside == list(range(STEPS + 1, K_MID + 1))
    state = runs["leg-mid"].state
    assert state.finished and state.global_step == 2 * STEPS


# ------------------------------------------------------------- single format
def _assert_pointers_relative(entries: dict[str, str], model_dir: Path | None = None) -> None:
    for name in ("last", "best", "final"):
        if name not in entries:
            continue
        target = entries[name]
        assert "/" not in target and not os.path.isabs(target) and target != name, (name, target)
        assert STEP_FILE.match(target), (name, target)
        assert target in entries, f"{name} -> {target} dangles"
        if model_dir is not None:
            assert (model_dir / name).is_symlink() and (model_dir / name).resolve() == (model_dir / target).resolve()


def test_single_pointers_are_relative_symlinks(runs):
    root = runs["root"]
    for run, entries in ((root / "single-full", runs["single-full-end"]), (runs["single-moved"], runs["single-moved-end"]),
                         (root / "single-ext", runs["single-ext-end"])):
        assert {"last", "best"} <= entries.keys()
        _assert_pointers_relative(entries, run / "model")
    for entries in runs["single-snaps"].values():
        _assert_pointers_relative(entries)
    _assert_pointers_relative(runs["single-after-stop"])


def test_single_stop_moves_last_not_final_and_end_sets_final(runs):
    stopped = runs["single-after-stop"]
    assert stopped["last"] == f"step_{K_MID}.pth" and "final" not in stopped
    # before the end no snapshot has `final`; the normal end sets it (and `last`) to the final step
    assert not any("final" in s for s in runs["single-snaps"].values())
    for end in (runs["single-full-end"], runs["single-moved-end"]):
        assert end["final"] == end["last"] == f"step_{2 * STEPS}.pth"
    # a finished run extended and stopped at step 95: `last` follows the stop, `final` keeps the end
    ext = runs["single-ext-end"]
    assert ext["last"] == f"step_{2 * STEPS + 5}.pth" and ext["final"] == f"step_{2 * STEPS}.pth"


def test_single_retention_never_deletes_a_pointer_target(runs):
    seen: set[str] = set()
    pruned_newer_than_best = False
    for step in sorted(runs["single-snaps"]):
        entries = runs["single-snaps"][step]
        files = {n for n in entries if STEP_FILE.match(n)}
        targets = {entries[p] for p in ("last", "best", "final") if p in entries}
        assert targets <= files, f"step {step}: a pointer target was deleted: {entries}"
        newest = max(files, key=lambda n: int(STEP_FILE.match(n).group(1)), default=None)
        assert files <= targets | {newest}, f"step {step}: keep_last=1 kept extra files: {sorted(files)}"
        if "best" in entries:
            best_step = int(STEP_FILE.match(entries["best"]).group(1))
            pruned = seen - files
            pruned_newer_than_best |= any(int(STEP_FILE.match(n).group(1)) > best_step for n in pruned)
        seen |= files
    assert pruned_newer_than_best, "no snapshot showed best's target kept while a newer file was pruned"
    # `best` appears only once the first evaluation (end of epoch 0) ran
    snaps = runs["single-snaps"]
    assert not any("best" in snaps[s] for s in range(1, STEPS + 1))
    assert all(snaps[s]["best"] == f"step_{STEPS}.pth" for s in range(STEPS + 1, 2 * STEPS + 1))
    # the extension's stop pruned step_80 but kept final/best's step_90
    ext = runs["single-ext-end"]
    assert f"step_{2 * STEPS}.pth" in ext and "step_80.pth" not in ext


def test_single_moved_run_resumes_and_finishes(runs):
    moved = runs["single-moved"]
    assert not (runs["root"] / "single-cut").exists()  # nothing was written at the old location
    state = runs["single-moved-state"]
    assert state.finished and state.global_step == 2 * STEPS and state.stop_reason is None
    resume = [s for s in _starts(moved) if s["kind"] == "resume"][0]
    assert Path(resume["checkpoint"]).parent == moved / "model"


# ----------------------------------------------------------------- warm start
@pytest.fixture(scope="module")
def cli_warm(runs, tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
    """``pimm launch --train.weight <std-full>/model/last``, 5 steps, in this process (``pimm_here``;
    test_foreign_sources.py warm-starts a launch in a real process)."""
    root = tmp_path_factory.mktemp("warm_cli")
    source = runs["root"] / "std-full" / "model" / "last"
    r = pimm_here("launch", "--train.config", DIGITS, "--run.root", root, "--run.name", "w", "--run.no-timestamp",
                  "--train.weight", source, "--", "train.epochs=1", "train.max_steps=5", "train.log_every_steps=1")
    return source, root / "digits" / "w", r


def test_cli_warm_start_reports_and_starts_fresh(cli_warm):
    source, run, r = cli_warm
    assert r.returncode == 0, describe(r)
    log = r.stdout  # the rank-0 log on the console
    assert f"warm start from {source}" in log
    for line in ("loaded 6 tensors (6/6 model parameters)", "missing 0", "unexpected 0", "shape-mismatched 0",
                 "are not restored"):
        assert line in log, line
    starts = _starts(run)
    assert [s["kind"] for s in starts] == ["start"]
    ws = starts[0]["warm_start"]
    assert ws["resolved"] == str(source / "weights.pth") and ws["weight_set"] == "raw"
    assert (ws["loaded"], ws["missing"], ws["unexpected"], ws["mismatched"]) == (6, 0, 0, 0)
    # optimizer, schedule and step are not restored: step 1 with the first warm-up LR
    train_recs = [x for x in read_jsonl(run / "metrics.jsonl") if x["split"] == "train"]
    assert [x["step"] for x in train_recs] == [1, 2, 3, 4, 5]
    cfg = make_config()
    assert train_recs[0]["lr"] == pytest.approx(cfg.train.lr / cfg.train.warmup_steps, rel=1e-9)
    assert read_json(run / "model" / "last" / "manifest.json")["step"] == 5


# A warm-started run that trains one optimizer step at learning rate 0: the weights stay
# exactly what the warm start loaded, and the optimizer/step show what was (not) restored.
FROZEN = ("train.epochs=1", "train.max_steps=1", "train.lr=0", "train.min_lr=0", "train.weight_decay=0")


def _check_fresh_after_one_step(tr, expected: dict[str, torch.Tensor]) -> None:
    from pimm_core.checkpoint.tensors.state import unwrap

    assert_same_tensors(unwrap(tr.model).state_dict(), expected)
    if tr.ema is not None:  # the new run's EMA starts from the loaded weights
        assert all(torch.equal(tr.ema.shadow[k], expected[k]) for k in tr.ema.shadow)
        assert tr.ema.updates == 1
    # step, optimizer state and schedule start over (the source run took 90 steps)
    assert tr.state.global_step == 1 and tr.state.epoch == 0
    assert {int(v["step"]) for v in tr.optimizer.state_dict()["state"].values()} == {1}


@pytest.mark.parametrize("source,weight_set", [("std-full/model/last", "raw"), ("single-full/model/best", "ema"),
                                                ("leg-full/model/model_last.pth", "raw")])
def test_warm_start_loads_the_named_weight_set(runs, tmp_path, source, weight_set):
    path = runs["root"] / source
    with one_thread():
        tr = train(tmp_path / "run", [*FROZEN, f"train.weight_set={weight_set}", "ema.enabled=true"],
                   extra={"train.weight": str(path)})
    rep = tr.warm_start_report
    assert (rep.loaded_params, rep.model_params, rep.missing, rep.unexpected, rep.mismatched) == (6, 6, [], [], [])
    assert rep.weight_set == weight_set
    _check_fresh_after_one_step(tr, read_weight_sets(path)[weight_set])


def test_warm_start_from_ddp_prefixed_state_dict(runs, tmp_path):
    raw = read_weight_sets(runs["root"] / "std-full" / "model" / "last" / "weights.pth")["raw"]
    torch.save({"state_dict": {"module." + k: v for k, v in raw.items()}}, tmp_path / "ddp.pth")
    with one_thread():
        tr = train(tmp_path / "run", FROZEN, extra={"train.weight": str(tmp_path / "ddp.pth")})
    rep = tr.warm_start_report
    assert rep.renamed == len(raw) and (rep.loaded_params, rep.model_params) == (6, 6)
    assert rep.loaded == sorted(raw) and not (rep.missing or rep.unexpected or rep.mismatched)
    _check_fresh_after_one_step(tr, raw)
    assert _starts(tmp_path / "run")[0]["warm_start"]["renamed"] == len(raw)


def test_warm_start_different_head_reports_mismatches_and_trains(runs, tmp_path):
    """model.hidden 128 -> 64: every hidden-sized tensor mismatches; only net.6.bias (10 classes) loads."""
    from pimm_core.checkpoint.tensors.state import unwrap

    source = runs["root"] / "std-full" / "model" / "last"
    raw = read_weight_sets(source)["raw"]
    run = tmp_path / "head"
    with one_thread():
        tr = train(run, ["model.hidden=64", "train.epochs=1", "train.max_steps=3"], extra={"train.weight": str(source)})
    rep = tr.warm_start_report
    assert rep.loaded == ["net.6.bias"] and rep.missing == [] and rep.unexpected == []
    assert rep.mismatched == [("net.0.bias", (128,), (64,)), ("net.0.weight", (128, 64), (64, 64)),
                              ("net.3.bias", (128,), (64,)), ("net.3.weight", (128, 128), (64, 64)),
                              ("net.6.weight", (10, 128), (10, 64))]
    assert tr.state.finished and tr.state.global_step == 3
    assert not torch.equal(unwrap(tr.model).net[6].bias, raw["net.6.bias"])  # loaded, then trained
    ws = _starts(run)[0]["warm_start"]
    assert (ws["loaded"], ws["mismatched"], ws["loaded_params"]) == (1, 5, 1)
    log = "\n".join(msg for _, msg in tr.test_log)
    assert "shape-mismatched 5" in log and "net.0.weight [128, 64] in checkpoint vs [64, 64] in model" in log


def _cli_launch(tmp_path: Path, name: str, weight: str, *overrides: str) -> int:
    from pimm_core.cli import main

    with pimm_logging():
        return main(["launch", "--train.config", str(DIGITS), "--run.root", str(tmp_path), "--run.name", name,
                     "--run.no-timestamp", "--train.weight", weight, "--", "train.epochs=1", *overrides])


def test_warm_start_zero_match_exits_2(runs, tmp_path, capsys):
    source = runs["root"] / "std-full" / "model" / "last"
    with one_thread():
        assert _cli_launch(tmp_path, "zero", str(source), "model.name=cnn") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no parameters matched") and err.count("\n") == 1, err
    model_dir = tmp_path / "digits" / "zero" / "model"
    assert not model_dir.exists() or not any(model_dir.iterdir())  # nothing trained, nothing saved


def test_warm_start_missing_path_exits_2(tmp_path, capsys):
    with one_thread():
        assert _cli_launch(tmp_path, "missing", str(tmp_path / "nope" / "weights.pth")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: No weight found") and "nope" in err and err.count("\n") == 1, err
