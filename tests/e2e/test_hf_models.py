"""Models from the libraries users live in (``transformers``, timm), named by config targets:
the built-in objectives read their outputs, and an output they cannot read is one line.

The launches and exports run in this process (``pimm_here``): what they check does not depend on
a fresh process, and a subprocess here spends ~5 CPU-s importing torch and transformers or timm
before it does anything. The examples' tests (test_examples_hf.py) run both libraries' launches
and exports in fresh processes, as users do."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import describe, pimm_here, read_json, read_jsonl

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


@contextlib.contextmanager
def _offline():
    """Hugging Face offline, and ``sys.path`` as it was afterwards (a launch puts the config's directory first)."""
    path = list(sys.path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        try:
            yield
        finally:
            sys.path[:] = path


def launch(cfg: Path, root: Path, name: str, *args: str,
           overrides: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``pimm launch`` in this process."""
    cmd = ["launch", "--train.config", str(cfg), "--run.root", str(root), "--run.name", name, "--run.no-timestamp",
           *args]
    if overrides:
        cmd += ["--", *overrides]
    with _offline():
        return pimm_here(*cmd)


def run_dir(root: Path, name: str) -> Path:
    (found,) = [p for p in root.rglob(name) if p.is_dir()]
    return found


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    tmp = tmp_path_factory.mktemp("gpt2")
    result = launch(config(tmp, GPT2), tmp / "runs", "gpt2")
    assert result.returncode == 0, describe(result)
    return run_dir(tmp / "runs", "gpt2"), result


def test_language_modeling_trains_a_transformers_gpt2(gpt2_run) -> None:
    """GPT2LMHeadModel returns a CausalLMOutputWithCrossAttentions: the built-in takes its logits."""
    rd, result = gpt2_run
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


def _export(rd: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``pimm export`` in this process."""
    with _offline():
        return pimm_here("export", "--run-dir", str(rd), "last", str(out), *args)


def _trained(rd: Path) -> dict:
    from pimm_core.checkpoint.weights.read import read_weight_sets

    return read_weight_sets(rd / "model" / "last")["raw"]


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_an_exported_gpt2_loads_back_with_transformers_own_calls(gpt2_run, tmp_path: Path, fmt: str) -> None:
    """The export directory is what save_pretrained writes: from_pretrained and AutoModelForCausalLM
    build the trained 2-layer model from its own config.json, tied head included; pimm's run
    config is pimm_config.json."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    rd, _ = gpt2_run
    out = tmp_path / "export"
    result = _export(rd, out, "--format", fmt)
    assert result.returncode == 0, describe(result)
    weights = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    assert {"config.json", weights, "pimm_config.json", "export.json"} <= {p.name for p in out.iterdir()}
    assert "train" in json.loads((out / "pimm_config.json").read_text())
    trained = _trained(rd)
    for load in (GPT2LMHeadModel.from_pretrained, AutoModelForCausalLM.from_pretrained):
        model = load(out)
        assert type(model) is GPT2LMHeadModel and model.config.n_layer == 2 and model.config.n_embd == 32
        assert model.lm_head.weight is model.transformer.wte.weight
        state = model.state_dict()
        assert sorted(state) == sorted(trained)
        assert all(torch.equal(state[k], trained[k]) for k in trained)
    record = json.loads((out / "export.json").read_text())
    assert record["library"] == "transformers" and record["aliases"] == {"lm_head.weight": "transformer.wte.weight"}


def test_a_gpt2_export_loads_with_safetensors_load_model_and_shards_as_transformers_does(gpt2_run,
                                                                                        tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from pimm_core.checkpoint.export.model_dir import export

    rd, _ = gpt2_run
    out = export("last", tmp_path / "one", run_dir=rd)
    model = GPT2LMHeadModel(GPT2Config.from_pretrained(out))
    assert load_model(model, out / "model.safetensors", strict=True) == (set(), [])  # tied weight stored once
    trained = _trained(rd)
    assert all(torch.equal(model.state_dict()[k], trained[k]) for k in trained)

    sharded = export("last", tmp_path / "sharded", run_dir=rd, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (sharded / "model.safetensors").exists()
    back = GPT2LMHeadModel.from_pretrained(sharded)
    assert all(torch.equal(back.state_dict()[k], trained[k]) for k in trained)


TIMM = """\
objective = "classification"

[train]
epochs = 1
lr = 0.01

[data]
target = "userpkg.hf:digit_images"
batch_size = 16

[model]
target = "userpkg.hf:resnet"
"""


def test_an_exported_timm_model_loads_back_through_timm(tmp_path: Path) -> None:
    """timm's resnet18 trained from a config target, exported, and built again by timm itself
    from the export's model.safetensors (pretrained_cfg_overlay), with the trained weights."""
    import timm
    import torch

    result = launch(config(tmp_path, TIMM), tmp_path / "runs", "timm")
    assert result.returncode == 0, describe(result)
    rd = run_dir(tmp_path / "runs", "timm")
    out = tmp_path / "export"
    exported = _export(rd, out)
    assert exported.returncode == 0, describe(exported)
    # the training config is config.json (timm reads the weights file only)
    assert "train" in json.loads((out / "config.json").read_text())
    model = timm.create_model("resnet18", pretrained=True, num_classes=10, in_chans=1,
                              pretrained_cfg_overlay=dict(file=str(out / "model.safetensors"), num_classes=10))
    trained = _trained(rd)
    state = model.state_dict()
    assert sorted(state) == sorted(trained)
    assert [k for k in trained if not torch.equal(state[k], trained[k])] == []
