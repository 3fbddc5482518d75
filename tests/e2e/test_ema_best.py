"""EMA evaluation, best-checkpoint semantics and export end to end through the real Trainer (issue 5).

Two tiny in-process digits runs with EMA on (dropout 0.3, one thread), the model
directory's best-checkpoint sidecar recorded after every optimizer step:

- ``min``: standard format, ``eval.metric = "val/loss"``, ``eval.mode = "min"``, raw
  weights evaluated, 3 epochs;
- ``ema``: legacy format, ``eval.weights = "ema"`` (selection on ``val/acc``, max), 2 epochs;
- ``max``: standard, ``val/loss`` with ``mode = "max"``, 2 epochs: an evaluation that does not
  improve (the loss falls), so ``model_best.pth`` must stay at epoch 0.

Checked: ``model_best.pth`` appears only after an evaluation that improved the metric,
its sidecar records the selection (name, value, mode, split, epoch), and its weights
reproduce the recorded value in a fresh model (``build_model`` + ``build_datasets``,
evaluated like the evaluator); with ``eval.weights = "ema"`` the recorded metrics are the
EMA set's; ``pimm export`` of ``best`` (raw and ``--weights ema``) loads into a fresh
model; ``Trainer.save_model`` writes the live raw/EMA sets of the final checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _api_runs import assert_same_tensors, evaluate, fresh_model, make_config, one_thread, pimm_logging, train
from _helpers import read_jsonl
from pimm_core.checkpoint.weights.read import read_weight_sets
from pimm_core.errors import ConfigError, UsageError

STEPS = 45  # optimizer steps per epoch
COMMON = ("model.dropout=0.3", "ema.enabled=true", "ema.decay=0.9", "train.log_every_steps=5")
RUNS = {
    "min": (*COMMON, "train.epochs=3", "checkpoint_format=standard", "eval.metric=val/loss", "eval.mode=min"),
    "ema": (*COMMON, "train.epochs=2", "checkpoint_format=legacy", "eval.weights=ema"),
    # val/loss falls from epoch 0 to epoch 1, so with mode=max the second evaluation does not improve
    "max": (*COMMON, "train.epochs=2", "checkpoint_format=standard", "eval.metric=val/loss", "eval.mode=max"),
}
METRIC_KEY = {"val/loss": "loss", "val/acc": "acc"}


def _sidecar(run: Path) -> dict | None:
    side = run / "model" / "model_best.pth.json"
    return json.loads(side.read_text()) if side.exists() else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """name -> {"dir", "trainer", "best_seen": {step: sidecar selection or None, read after each step}}."""
    root = tmp_path_factory.mktemp("ema_best")
    out = {}
    with one_thread():
        for name, overrides in RUNS.items():
            run = root / name
            seen: dict[int, dict | None] = {}

            def record(tr, run=run, seen=seen):
                side = _sidecar(run)
                seen[tr.state.global_step] = side["selection_metric"] if side else None

            trainer = train(run, overrides, callbacks=(record,))
            out[name] = {"dir": run, "trainer": trainer, "best_seen": seen}
    return out


def _val_records(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "val"]


def _expected_best(vals: list[float], mode: str) -> list[int | None]:
    """Index of the best value after each evaluation (strict improvement), per evaluation."""
    out, best = [], None
    for i, v in enumerate(vals):
        if best is None or (v > vals[best] if mode == "max" else v < vals[best]):
            best = i
        out.append(best)
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_best_written_only_after_an_improving_evaluation(runs, name):
    run, trainer, seen = runs[name]["dir"], runs[name]["trainer"], runs[name]["best_seen"]
    cfg = trainer.config.eval
    vals = _val_records(run)
    epochs = trainer.config.train.epochs
    assert [(r["step"], r["epoch"]) for r in vals] == [((e + 1) * STEPS, e) for e in range(epochs)]
    values = [r[METRIC_KEY[cfg.metric]] for r in vals]
    expected = _expected_best(values, cfg.mode)
    assert sorted(seen) == list(range(1, epochs * STEPS + 1))
    for step, sel in seen.items():
        epoch = (step - 1) // STEPS  # the step trains epoch `epoch`; evaluations of epochs < epoch are done
        if epoch == 0:
            assert sel is None, f"model_best.pth exists at step {step}, before any evaluation"
        else:
            best = expected[epoch - 1]
            assert sel is not None and (sel["epoch"], sel["value"]) == (best, values[best]), (step, sel)
    final = _sidecar(run)["selection_metric"]
    assert (final["epoch"], final["value"]) == (expected[-1], values[expected[-1]])
    assert (trainer.state.best_epoch, trainer.state.best_metric) == (expected[-1], values[expected[-1]])
    if name == "max":  # the non-improving evaluation left the epoch-0 file in place
        assert values[1] < values[0] and expected == [0, 0]


@pytest.mark.parametrize("name", list(RUNS))
def test_best_sidecar_records_the_selection(runs, name):
    run, trainer = runs[name]["dir"], runs[name]["trainer"]
    e = trainer.config.eval
    side = _sidecar(run)
    sel = side["selection_metric"]
    values = [r[METRIC_KEY[e.metric]] for r in _val_records(run)]
    best_value = min(values) if e.mode == "min" else max(values)
    assert {k: sel[k] for k in ("name", "value", "mode", "split", "weights")} == \
        {"name": e.metric, "value": best_value, "mode": e.mode, "split": "val", "weights": e.weights}
    assert values[sel["epoch"]] == best_value
    # the file names the epoch that produced it (as the selection metric does), all its micro-batches trained
    assert (side["step"], side["epoch"], side["iter"]) == ((sel["epoch"] + 1) * STEPS, sel["epoch"], STEPS)
    assert side["metrics"][e.metric] == best_value
    assert side["files"].keys() == {"model_best.pth"}


def test_min_mode_best_weights_reproduce_recorded_loss(runs):
    run = runs["min"]["dir"]
    sel = _sidecar(run)["selection_metric"]
    sets = read_weight_sets(run / "model" / "model_best.pth")
    assert sorted(sets) == ["ema", "raw"]
    got = evaluate(run, sets["raw"])
    assert got["val/loss"] == pytest.approx(sel["value"], rel=1e-12, abs=0)
    assert got["val/acc"] == _val_records(run)[sel["epoch"]]["acc"]


def test_eval_weights_ema_evaluates_the_ema_set(runs):
    run = runs["ema"]["dir"]
    sel = _sidecar(run)["selection_metric"]
    vals = _val_records(run)
    sets = read_weight_sets(run / "model" / "model_best.pth")
    ema, raw = evaluate(run, sets["ema"]), evaluate(run, sets["raw"])
    assert ema["val/acc"] == sel["value"] == vals[sel["epoch"]]["acc"]
    assert ema["val/loss"] == pytest.approx(vals[sel["epoch"]]["loss"], rel=1e-12, abs=0)
    assert raw["val/loss"] != pytest.approx(vals[sel["epoch"]]["loss"], rel=1e-6)  # not the raw weights
    # the last evaluation as well: EMA set of model_last.pth
    last = read_weight_sets(run / "model" / "model_last.pth")
    got = evaluate(run, last["ema"])
    assert got["val/acc"] == vals[-1]["acc"] and got["val/loss"] == pytest.approx(vals[-1]["loss"], rel=1e-12, abs=0)


def test_eval_weights_ema_without_ema_is_a_config_error():
    with pytest.raises(ConfigError, match="ema.enabled"):
        make_config(["eval.weights=ema"])
    with pytest.raises(ConfigError, match="ema.enabled"):
        make_config(["eval.weights=ema", "ema.enabled=false"])
    make_config(["eval.weights=ema", "ema.enabled=true"])


# ----------------------------------------------------------------------- export
def _load_export(run: Path, out: Path) -> dict[str, torch.Tensor]:
    """model.safetensors -> a fresh model of the run's config, strictly; returns its state dict."""
    from safetensors.torch import load_file

    model = fresh_model(run)
    model.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    return model.state_dict()


@pytest.mark.parametrize("name,weights", [("min", "raw"), ("ema", "ema"), ("min", "ema")])
def test_cli_export_best_loads_into_a_fresh_model(runs, tmp_path, capsys, name, weights):
    from pimm_core.cli import main

    run = runs[name]["dir"]
    out = tmp_path / "export"
    args = ["export", "--run-dir", str(run), "best", str(out)] + (["--weights", "ema"] if weights == "ema" else [])
    assert main(args) == 0, capsys.readouterr().err
    assert f"{weights} weights" in capsys.readouterr().out
    sd = _load_export(run, out)
    assert_same_tensors(sd, read_weight_sets(run / "model" / "model_best.pth")[weights])
    record = json.loads((out / "export.json").read_text())
    sel = _sidecar(run)["selection_metric"]
    assert (record["weights"], record["step"]) == (weights, (sel["epoch"] + 1) * STEPS)
    assert "train" in json.loads((out / "config.json").read_text())
    if weights == runs[name]["trainer"].config.eval.weights:  # the evaluated set reproduces the recorded value
        assert evaluate(run, sd)[sel["name"]] == pytest.approx(sel["value"], rel=1e-12, abs=0)


def test_save_model_writes_the_final_checkpoints_sets(runs, tmp_path):
    from safetensors.torch import load_file

    run, trainer = runs["min"]["dir"], runs["min"]["trainer"]
    final = read_weight_sets(run / "model" / "last" / "weights.pth")
    assert trainer.save_model(tmp_path / "ema.safetensors", weights="ema") == tmp_path / "ema.safetensors"
    assert_same_tensors(load_file(str(tmp_path / "ema.safetensors")), final["ema"])
    trainer.save_model(tmp_path / "raw.bin")
    assert_same_tensors(torch.load(tmp_path / "raw.bin", weights_only=True), final["raw"])
    assert any(not torch.equal(final["raw"][k], final["ema"][k]) for k in final["raw"])


def test_save_model_ema_without_ema_raises(tmp_path):
    from pimm_core import Trainer

    with one_thread(), pimm_logging():
        trainer = Trainer(make_config(["ema.enabled=false"]), run_dir=None)
    with pytest.raises(UsageError, match="ema.enabled"):
        trainer.save_model(tmp_path / "m.safetensors", weights="ema")
    assert not (tmp_path / "m.safetensors").exists()
