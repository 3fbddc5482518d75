"""One real single-process training run (the session fixture): exit, summary, run directory, checkpoints."""

from __future__ import annotations

import tomllib

import pytest
import torch

from _helpers import describe, eval_weights, launch, read_json, read_jsonl
from conftest import SINGLE_OVERRIDES
from pimm_core.checkpoint.records.manifest import verify_files
from pimm_core.config import config_from_dict, load_config
from pimm_core.data.loaders import build_datasets

EPOCHS, STEPS_PER_EPOCH = 3, 45  # 1,437 training samples at batch 32
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH


@pytest.fixture(scope="module")
def run(trained_run):
    assert trained_run.result.returncode == 0, describe(trained_run.result)
    return trained_run.run_dir


def test_exit_and_summary_line(trained_run, run):
    done = [line for line in trained_run.result.stdout.splitlines() if line.startswith("done:")]
    assert len(done) == 1, describe(trained_run.result)
    assert done[0].endswith(f"run {run}")
    assert f"steps {TOTAL_STEPS}" in done[0] and f"epochs {EPOCHS}" in done[0]
    assert "Traceback" not in trained_run.result.stderr


def test_run_dir_layout(run):
    for name in ("config.toml", "provenance.json", "metrics.jsonl", "status.json", "train.log"):
        assert (run / name).is_file(), name
    last = run / "model" / "last"
    for rel in ("weights.pth", "trainer.dcp/.metadata", "trainer.dcp/.complete", "trainer.dcp/__0_0.distcp",
                "manifest.json", ".complete"):
        assert (last / rel).is_file(), rel
    assert (run / "model" / "model_best.pth").is_file()
    assert (run / "model" / "model_best.pth.json").is_file()
    assert not (run / "model" / "last.prev").exists()


def test_no_temporaries_left(run):
    leftovers = [p for p in (run / "model").rglob("*") if ".tmp" in p.name]
    leftovers += [p for p in run.glob("*") if ".tmp" in p.name]
    assert leftovers == []


def test_resolved_config_written(run):
    cfg = config_from_dict(tomllib.loads((run / "config.toml").read_text()))
    expected = load_config("configs/digits.toml", list(SINGLE_OVERRIDES),
                           {"run.root": str(run.parents[1]), "run.name": "t", "run.no_timestamp": True})
    assert cfg == expected


def test_provenance(run):
    prov = read_json(run / "provenance.json")
    assert prov["world_size"] == 1
    assert prov["workers_per_rank"] == 0
    assert prov["torch_version"] == torch.__version__
    cfg = load_config("configs/digits.toml")
    assert prov["data_fingerprint"] == build_datasets(cfg.data).fingerprint
    assert len(prov["starts"]) == 1 and prov["starts"][0]["kind"] == "start"


def test_status_finished(run):
    status = read_json(run / "status.json")
    assert status["state"] == "finished"
    assert (status["step"], status["epoch"], status["iter"]) == (TOTAL_STEPS, EPOCHS, 0)
    assert status["stop_reason"] is None


def test_metrics_records(run):
    records = read_jsonl(run / "metrics.jsonl")
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    assert len(train) + len(val) == len(records)
    for r in records:
        for key in ("step", "epoch", "iter", "split", "loss", "time"):
            assert key in r, (key, r)
    assert train and all("lr" in r and "samples_per_s" in r for r in train)
    assert [r["step"] for r in train] == sorted(r["step"] for r in train)
    assert train[0]["step"] == 1
    # one evaluation per epoch, at its end
    assert [(r["epoch"], r["step"]) for r in val] == [(e, (e + 1) * STEPS_PER_EPOCH) for e in range(EPOCHS)]
    assert all(0.0 <= r["acc"] <= 1.0 for r in val)
    assert val[-1]["acc"] > 0.85


def test_manifest_matches_files(run):
    last = run / "model" / "last"
    manifest = read_json(last / "manifest.json")
    assert manifest["format"] == "standard"
    assert (manifest["step"], manifest["epoch"], manifest["iter"]) == (TOTAL_STEPS, EPOCHS, 0)
    assert manifest["world_size"] == 1
    assert {"weights.pth", "trainer.dcp/.metadata", "trainer.dcp/__0_0.distcp"} <= set(manifest["files"])
    assert verify_files(last, manifest["files"]) == []
    for side in (run / "model").glob("*.pth.json"):
        assert verify_files(side.parent, read_json(side)["files"]) == [], side


def test_final_weights_reproduce_final_val_acc(run):
    val = [r for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "val"]
    manifest = read_json(run / "model" / "last" / "manifest.json")
    assert manifest["metrics"]["val/acc"] == val[-1]["acc"]
    assert eval_weights(run, run / "model" / "last" / "weights.pth") == val[-1]["acc"]


def test_best_weights_reproduce_best_val_acc(run):
    val = [r for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "val"]
    best = max(val, key=lambda r: r["acc"])  # first epoch reaching the maximum
    side = read_json(run / "model" / "model_best.pth.json")
    assert side["selection_metric"]["value"] == best["acc"]
    assert side["selection_metric"]["epoch"] == best["epoch"]
    # one epoch numbering: the file says the epoch that produced it, as the selection metric and metrics.jsonl do
    assert (side["epoch"], side["iter"], side["step"]) == (best["epoch"], STEPS_PER_EPOCH, best["step"])
    assert eval_weights(run, run / "model" / "model_best.pth") == best["acc"]


def test_weights_file_is_plain_state_dict(run):
    obj = torch.load(run / "model" / "last" / "weights.pth", map_location="cpu", weights_only=True)
    assert set(obj) == {"state_dict"}
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in obj["state_dict"])


def test_step_snapshots_and_retention(run):
    # every_steps=20 saves at 20, 40, ..., 120 (135 is the end); keep_iter=2 keeps the newest two
    snaps = sorted(p.name for p in (run / "model").glob("iter_*"))
    assert snaps == ["iter_100.pth", "iter_100.pth.json", "iter_120.pth", "iter_120.pth.json"]
    for step in (100, 120):
        side = read_json(run / "model" / f"iter_{step}.pth.json")
        assert side["step"] == step and side["kind"] == "iter"
        obj = torch.load(run / "model" / f"iter_{step}.pth", map_location="cpu", weights_only=True)
        assert set(obj) == {"state_dict"}
    log = (run / "train.log").read_text()
    for step in (20, 40, 60, 80, 100, 120, TOTAL_STEPS):
        assert f"(step {step}," in log, step


DIVERGE = ("train.epochs=1", "train.max_steps=3", "train.lr=3e13", 'train.optimizer="sgd"', "train.grad_clip=0.0",
           "train.warmup_steps=0", "train.log_every_steps=1", 'train.scheduler="constant"')


def test_non_finite_gradient_stops_before_it_is_applied(tmp_path):
    """Case nonfinite-metrics-console's run, with the default train.on_nonfinite = "stop"."""
    r = launch(tmp_path, "diverge", *DIVERGE)
    assert r.returncode == 1, describe(r)
    assert "done:" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, describe(r)
    assert lines[0].startswith("error: non-finite loss or gradient at step 2 (epoch 0, iter 2); the step was not "
                               "applied; the run's last checkpoint (step 1) holds the weights from before it"), lines
    run = tmp_path / "digits" / "diverge"
    command = lines[0].split("Resume with a lower LR: ")[1]
    assert command.endswith("resume " + str(run) + " -- train.lr=3e+12")
    status = read_json(run / "status.json")
    assert (status["state"], status["step"]) == ("stopped", 1) and "non-finite" in status["stop_reason"]
    weights = torch.load(run / "model" / "last" / "weights.pth", weights_only=True)["state_dict"]
    assert all(bool(torch.isfinite(v).all()) for v in weights.values())
    assert read_json(run / "model" / "last" / "manifest.json")["step"] == 1


def test_non_finite_policy_skip_and_continue(tmp_path):
    # in this process (the stop above runs the console script): the same code, no torch import
    skip = launch(tmp_path, "skip", *DIVERGE, 'train.on_nonfinite="skip"', here=True)
    assert skip.returncode == 0, describe(skip)
    assert "step skipped (train.on_nonfinite = 'skip')" in skip.stdout
    cont = launch(tmp_path, "cont", *DIVERGE, 'train.on_nonfinite="continue"', here=True)
    assert cont.returncode == 1 and "done:" not in cont.stdout, describe(cont)  # never "done" with NaN weights
    assert cont.stderr.startswith("error: the weights are not finite after step 3"), describe(cont)
    assert read_json(tmp_path / "digits" / "cont" / "status.json")["state"] == "failed"
