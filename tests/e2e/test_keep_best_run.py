"""``checkpoint.keep_best = 2`` end to end: a real ``pimm launch`` of digits (4 epochs, evaluated
after each); afterwards ``model/`` holds exactly the two best evaluations by ``val/acc`` as
``best_<step>.pth`` (ties: the earlier, as ``model_best.pth`` ranks), each sidecar's value the
one metrics.jsonl recorded for that step and reproduced by its weights, ``model_best.pth`` the
first of them, and ``pimm checkpoints ls --json`` lists them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _helpers import describe, eval_weights, launch, pimm, read_json, read_jsonl

EPOCHS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("keep_best")
    r = launch(root, "k2", f"train.epochs={EPOCHS}", "data.num_workers=0", "checkpoint.keep_best=2",
               "checkpoint.every_epochs=0", "train.log_every_steps=45")
    assert r.returncode == 0, describe(r)
    (run_dir,) = [p for p in root.glob("*/k2")]
    return run_dir


def test_the_two_best_evaluations_remain_with_their_values(run):
    evals = [(r["step"], r["acc"]) for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "val"]
    assert len(evals) == EPOCHS
    # the selection metric's ranking: higher val/acc first, of equal values the earlier step
    expected = sorted(evals, key=lambda e: (-e[1], e[0]))[:2]
    kept = {p.name: read_json(p.with_name(p.name + ".json")) for p in (run / "model").glob("best_*.pth")}
    assert sorted(kept) == sorted(f"best_{step}.pth" for step, _ in expected), (evals, sorted(kept))
    for step, value in expected:
        side = kept[f"best_{step}.pth"]
        sel = side["selection_metric"]
        assert (side["step"], side["kind"], sel["name"], sel["mode"]) == (step, "best", "val/acc", "max")
        assert sel["value"] == pytest.approx(value)
        assert eval_weights(run, run / "model" / f"best_{step}.pth") == pytest.approx(value)
    best = read_json(run / "model" / "model_best.pth.json")
    assert (best["step"], best["selection_metric"]["value"]) == (expected[0][0], pytest.approx(expected[0][1]))
    leftovers = [p.name for p in (run / "model").iterdir() if p.name.startswith("best_")]
    assert sorted(leftovers) == sorted([*kept, *(f"{n}.json" for n in kept)])  # no orphan sidecar


def test_checkpoints_ls_lists_the_kept_files(run):
    r = pimm("checkpoints", "ls", str(run), "--json", timeout=120)
    assert r.returncode == 0, describe(r)
    listed = {c["name"]: c for c in json.loads(r.stdout)["candidates"]}
    kept = sorted(p.name for p in (run / "model").glob("best_*.pth"))
    assert len(kept) == 2
    for name in kept:
        assert (listed[name]["kind"], listed[name]["complete"], listed[name]["resumable"]) == ("best", True, False)
        assert listed[name]["step"] == int(name[5:-4])
    text = pimm("checkpoints", "ls", str(run), timeout=120)
    assert text.returncode == 0, describe(text)
    for name in kept:  # each row says the value it was ranked by
        value = read_json(run / "model" / f"{name}.json")["selection_metric"]["value"]
        (row,) = [line for line in text.stdout.splitlines() if f" {name} " in line]
        assert f"val/acc {value:.4g}" in row, text.stdout
