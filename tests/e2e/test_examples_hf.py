"""The library examples through config targets only, each at 2 ranks: a run stopped by SIGTERM to
the launcher and resumed ends with the weights of an uninterrupted run, bit for bit, and its
export (in this process: it needs no process of its own) loads back with the library's own calls.

- ``configs/hf_gpt2.toml`` (``examples.hf_gpt2.model:gpt2``, a ``transformers`` GPT2LMHeadModel
  on charlm's text): ``from_pretrained``;
- ``configs/timm_digits.toml`` (``examples.timm_digits.model:timm_model``, a timm ResNet on the
  augmented digits, 2 workers per rank): ``timm.create_model(..., pretrained_cfg_overlay=...)``.

Each run overrides the example's model size only (:data:`SMALL`): the same classes and code paths
(GPT-2 with its tied head; timm's ResNet with batch-norm buffers, built and loaded back by name), at a
fraction of the CPU. timm's ``test_resnet`` (0.37 M parameters, timm's own model for tests) instead of
resnet18 (11.2 M) cuts a 2-rank launch from ~26 to ~20 CPU-s, its checkpoints from 172 to 6 MiB."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from _helpers import REPO, clean_env, describe, hang_s, pimm_here, read_json, read_jsonl

STEPS = {"hf_gpt2.toml": 30, "timm_digits.toml": 12}  # optimizer steps of each run (2 ranks)
TIMM = "test_resnet"
SMALL = {"hf_gpt2.toml": ["model.args.n_layer=1", "model.args.n_embd=32"],  # 4 heads of 8
         "timm_digits.toml": [f"model.args.name={TIMM}"]}
ENV = {**clean_env(), "HF_HUB_OFFLINE": "1"}


def _cmd(config: str, root: Path, name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(REPO / "configs" / config),
            "--run.root", str(root),
            "--run.name", name, "--run.no-timestamp", "--nproc-per-node", "2", *args, "--",
            f"train.max_steps={STEPS[config]}", "train.log_every_steps=1", *SMALL[config]]


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=hang_s(600))


def _steps(run: Path) -> list[int]:
    if not (run / "metrics.jsonl").is_file():
        return []
    return [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r.get("split") == "train"]


def _stop_resume_export(tmp_path: Path, config: str, group: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """Train ``config`` uninterrupted and cut-and-resumed at 2 ranks; assert bitwise equal weights;
    export the resumed run. Returns the export directory and the trained weights."""
    from pimm_core.checkpoint.weights.read import read_weight_sets

    root = tmp_path / "exp"
    full = _run(_cmd(config, root, "full"))
    assert full.returncode == 0, describe(full)

    cut_dir = root / group / "cut"
    cut = subprocess.Popen(_cmd(config, root, "cut"), cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    deadline = time.monotonic() + hang_s(300)  # only catches a hang
    while not any(s >= 3 for s in _steps(cut_dir)) and cut.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    cut.send_signal(signal.SIGTERM)  # a scheduler's pre-emption notice to the launcher
    out, err = cut.communicate(timeout=hang_s(300))
    assert cut.returncode == 0, out + err
    status = read_json(cut_dir / "status.json")
    assert status["state"] == "stopped" and status["step"] < STEPS[config], (status, out[-2000:])

    resumed = _run(_cmd(config, root, "cut", "--train.resume"))
    assert resumed.returncode == 0, describe(resumed)
    assert read_json(cut_dir / "status.json")["state"] == "finished"
    a = read_weight_sets(root / group / "full" / "model" / "last")["raw"]
    b = read_weight_sets(cut_dir / "model" / "last")["raw"]
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []

    out_dir = tmp_path / "export"  # (in this process: the console script's export is test_export_outputs.py's)
    exported = pimm_here("export", "--run-dir", str(cut_dir), "last", str(out_dir), env={"HF_HUB_OFFLINE": "1"})
    assert exported.returncode == 0, describe(exported)
    return out_dir, b


def test_hf_gpt2_example_stops_resumes_bitwise_and_loads_back_with_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    out_dir, b = _stop_resume_export(tmp_path, "hf_gpt2.toml", "hf_gpt2")
    for load in (GPT2LMHeadModel.from_pretrained, AutoModelForCausalLM.from_pretrained):
        model = load(out_dir)
        state = model.state_dict()
        assert [k for k in b if not torch.equal(state[k], b[k])] == []
    assert json.loads((out_dir / "config.json").read_text())["model_type"] == "gpt2"


def test_timm_example_stops_resumes_bitwise_and_loads_back_through_timm(tmp_path: Path) -> None:
    import timm

    out_dir, b = _stop_resume_export(tmp_path, "timm_digits.toml", "timm_digits")
    model = timm.create_model(TIMM, pretrained=True, num_classes=10, in_chans=1,
                              pretrained_cfg_overlay=dict(file=str(out_dir / "model.safetensors"), num_classes=10))
    state = model.state_dict()
    assert sorted(state) == sorted(b) and [k for k in b if not torch.equal(state[k], b[k])] == []
