"""The Hugging Face example (``configs/hf_gpt2.toml``: ``examples.hf_gpt2.model:gpt2``, a
``transformers`` GPT2LMHeadModel, on charlm's text) through config targets only: at 2 ranks, a
run stopped by SIGTERM to the launcher and resumed ends with the weights of an uninterrupted
run, bit for bit, and its export loads back with ``transformers``' own ``from_pretrained``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from _helpers import REPO, clean_env, describe, read_json, read_jsonl

CONFIG = REPO / "configs" / "hf_gpt2.toml"
STEPS = 30
ENV = {**clean_env(), "HF_HUB_OFFLINE": "1"}


def _cmd(root: Path, name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(CONFIG), "--run.root", str(root),
            "--run.name", name, "--run.no-timestamp", "--nproc-per-node", "2", *args, "--",
            f"train.max_steps={STEPS}", "train.log_every_steps=1"]


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)


def _steps(run: Path) -> list[int]:
    if not (run / "metrics.jsonl").is_file():
        return []
    return [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r.get("split") == "train"]


def test_hf_gpt2_example_stops_resumes_bitwise_and_loads_back_with_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    from pimm_core.checkpoint.weights import read_weight_sets

    root = tmp_path / "exp"
    full = _run(_cmd(root, "full"))
    assert full.returncode == 0, describe(full)

    cut_dir = root / "hf_gpt2" / "cut"
    cut = subprocess.Popen(_cmd(root, "cut"), cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    deadline = time.monotonic() + 300  # only catches a hang
    while not any(s >= 3 for s in _steps(cut_dir)) and cut.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    cut.send_signal(signal.SIGTERM)  # a scheduler's pre-emption notice to the launcher
    out, err = cut.communicate(timeout=300)
    assert cut.returncode == 0, out + err
    status = read_json(cut_dir / "status.json")
    assert status["state"] == "stopped" and status["step"] < STEPS, (status, out[-2000:])

    resumed = _run(_cmd(root, "cut", "--train.resume"))
    assert resumed.returncode == 0, describe(resumed)
    assert read_json(cut_dir / "status.json")["state"] == "finished"
    a = read_weight_sets(root / "hf_gpt2" / "full" / "model" / "last")["raw"]
    b = read_weight_sets(cut_dir / "model" / "last")["raw"]
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []

    out_dir = tmp_path / "gpt2"
    exported = subprocess.run([sys.executable, "-m", "pimm_core.cli", "export", "--run-dir", str(cut_dir), "last",
                               str(out_dir)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, describe(exported)
    for load in (GPT2LMHeadModel.from_pretrained, AutoModelForCausalLM.from_pretrained):
        model = load(out_dir)
        state = model.state_dict()
        assert [k for k in b if not torch.equal(state[k], b[k])] == []
    assert json.loads((out_dir / "config.json").read_text())["model_type"] == "gpt2"
