"""Models from the libraries users live in (``transformers``, timm), named by config targets:
the built-in objectives read their outputs, and an output they cannot read is one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import REPO, clean_env, describe, read_json, read_jsonl

USERPKG = Path(__file__).resolve().parent / "userpkg"

GPT2 = """\
objective = "language_modeling"

[train]
epochs = 1
lr = 0.01
log_every_steps = 1

[data]
target = "userpkg.hf:tokens"
batch_size = 8

[model]
target = "userpkg.hf:gpt2"

[eval]
metric = "val/loss"
mode = "min"
"""


def config(tmp_path: Path, text: str) -> Path:
    if not (tmp_path / "userpkg").exists():
        (tmp_path / "userpkg").symlink_to(USERPKG)  # beside the config: found through its directory
    path = tmp_path / "hf.toml"
    path.write_text(text)
    return path


def launch(cfg: Path, root: Path, name: str, *args: str, overrides: tuple[str, ...] = (),
           timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(cfg), "--run.root", str(root),
           "--run.name", name, "--run.no-timestamp", *args]
    if overrides:
        cmd += ["--", *overrides]
    env = {**clean_env(), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_dir(root: Path, name: str) -> Path:
    (found,) = [p for p in root.rglob(name) if p.is_dir()]
    return found


def test_language_modeling_trains_a_transformers_gpt2(tmp_path: Path) -> None:
    """GPT2LMHeadModel returns a CausalLMOutputWithCrossAttentions: the built-in takes its logits."""
    cfg = config(tmp_path, GPT2)
    result = launch(cfg, tmp_path / "runs", "gpt2")
    assert result.returncode == 0, describe(result)
    rd = run_dir(tmp_path / "runs", "gpt2")
    assert read_json(rd / "status.json")["state"] == "finished"
    losses = [r["loss"] for r in read_jsonl(rd / "metrics.jsonl") if r.get("split") == "train"]
    evals = [r for r in read_jsonl(rd / "metrics.jsonl") if r.get("split") == "val"]
    assert len(losses) == 8 and evals, describe(result)  # 64 rows / batch 8; perplexity derived from val/loss
    assert 1 < evals[-1]["perplexity"] < 64  # better than chance over a 64-token vocabulary
    # provenance: the model's module is transformers' own, recorded by its distribution and version,
    # not by the git commit of the checkout the environment happens to sit in
    import transformers

    code = {c["module"]: c for c in read_json(rd / "provenance.json")["starts"][-1]["user_code"]}
    hf = code["transformers.models.gpt2.modeling_gpt2"]
    assert (hf["distribution"], hf["version"], hf["git_commit"]) == ("transformers", transformers.__version__, None)
    assert code["userpkg.hf"]["git_commit"] is not None and "distribution" not in code["userpkg.hf"]


def test_an_output_the_builtins_cannot_read_is_one_line_and_leaves_no_run(tmp_path: Path) -> None:
    cfg = config(tmp_path, GPT2.replace('target = "userpkg.hf:gpt2"', 'target = "userpkg.hf:tuple_model"'))
    result = launch(cfg, tmp_path / "runs", "bad")
    assert result.returncode == 2, describe(result)
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert "Traceback" not in result.stderr + result.stdout, describe(result)
    error = [l for l in lines if l.startswith("error:")]
    assert len(error) == 1 and "the model returned a tuple" in error[0] and "write an objective" in error[0], \
        describe(result)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("bad")), \
        sorted(map(str, (tmp_path / "runs").rglob("*")))
