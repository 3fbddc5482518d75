"""Sources pimm did not write, the Hub without a network, and ``--dry-run`` checking what the launch checks.

Every refusal is one ``error:`` line from ``pimm launch``, with exit code 2 for bad input (1 for
an unreachable Hub: the operation failed, the input may be fine), no traceback, and nothing left
behind: no run directory, not even the run root. The Hub cases and one warm start run the console
script in real processes; the others run the same command in this process (``_helpers.pimm_here``),
without a subprocess importing torch.
"""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _helpers import DIGITS, REPO, clean_env, describe, hang_s, pimm_here
from pimm_core.checkpoint.records.foreign import directory_layout, file_layout, sniff
from pimm_core.checkpoint.select.resume_path import resolve_resume_path
from pimm_core.checkpoint.weights.sources import check_weight_source
from pimm_core.checkpoint.weights.warm_start import warm_start
from pimm_core.config import load_config
from pimm_core.data.loaders import build_datasets
from pimm_core.errors import CheckpointError
from pimm_core.models import build_model

FAST = ("train.epochs=1", "train.max_steps=1", "eval.every_epochs=0")


def _digits_state_dict() -> dict[str, torch.Tensor]:
    cfg = load_config(DIGITS)
    data = build_datasets(cfg.data)
    torch.manual_seed(1)
    return build_model(cfg.model, data.in_features, data.in_shape, data.num_classes).state_dict()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One file or directory of each foreign kind, holding weights of the digits MLP where it has any."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("foreign")
    sd = _digits_state_dict()
    flat = {k: v.contiguous() for k, v in sd.items()}
    out: dict[str, Path] = {}
    # Accelerate `save_state`: model.safetensors plus its optimizer, scheduler and RNG files
    acc = root / "accelerate"
    acc.mkdir()
    save_file(flat, str(acc / "model.safetensors"))
    torch.save({"state": {}, "param_groups": []}, acc / "optimizer.bin")
    torch.save({"last_epoch": 3}, acc / "scheduler.bin")
    (acc / "random_states_0.pkl").write_bytes(pickle.dumps({"step": 3}))
    out["accelerate"] = acc
    # the same with a pytorch_model.bin (safe_serialization=False)
    acc_bin = root / "accelerate_bin"
    acc_bin.mkdir()
    torch.save(sd, acc_bin / "pytorch_model.bin")
    torch.save({"state": {}, "param_groups": []}, acc_bin / "optimizer.bin")
    (acc_bin / "random_states_0.pkl").write_bytes(pickle.dumps({"step": 3}))
    out["accelerate_bin"] = acc_bin
    # a Hugging Face model directory
    hf = root / "hf_model"
    hf.mkdir()
    save_file(flat, str(hf / "model.safetensors"))
    (hf / "config.json").write_text('{"model_type": "mlp"}')
    out["hf_dir"] = hf
    # a Lightning checkpoint: the LightningModule held the network as `self.model`
    out["lightning"] = root / "epoch=0-step=10.ckpt"
    torch.save({"epoch": 0, "global_step": 10, "pytorch-lightning_version": "2.4.0",
                "state_dict": {f"model.{k}": v for k, v in sd.items()}, "loops": {}, "callbacks": {},
                "optimizer_states": [], "lr_schedulers": []}, out["lightning"])
    # a plain state dict, random bytes, text
    out["plain"] = root / "plain.pth"
    torch.save(sd, out["plain"])
    out["random"] = root / "random.pth"
    # a ninth byte "{" after a length past the file's end: what one random file in 256 starts with, and
    # not safetensors (CI once met such a file, read as safetensors: "header too large")
    noise = random.Random(0).randbytes(4087).replace(b"PK", b"pk")
    out["random"].write_bytes(b"\xff" * 8 + b"{" + noise)
    out["text"] = root / "notes.pth"
    out["text"].write_text("these are my notes about the model\nnot a checkpoint\n")
    return out


def _one_error(result: subprocess.CompletedProcess[str], code: int = 2) -> str:
    assert result.returncode == code, describe(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), describe(result)
    assert "Traceback" not in result.stderr + result.stdout, describe(result)
    return lines[0]


def _launch(root: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 180, here: bool = True):
    """``pimm launch --train.config configs/digits.toml --run.root ROOT ARGS``: in this process, or with
    ``here=False`` (or an ``env``, read by libraries at import) in a real subprocess."""
    if here and env is None:
        return pimm_here("launch", "--train.config", DIGITS, "--run.root", root, *args)
    cmd = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(DIGITS), "--run.root", str(root),
           *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env={**clean_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=hang_s(timeout))


# ------------------------------------------------------------------ naming (no torch.load, nothing runs)
def test_layouts_are_named_from_their_bytes(sources):
    assert directory_layout(sources["accelerate"]).what == "an Accelerate save_state directory"
    assert directory_layout(sources["accelerate"]).weights == sources["accelerate"] / "model.safetensors"
    assert directory_layout(sources["accelerate_bin"]).weights == sources["accelerate_bin"] / "pytorch_model.bin"
    assert directory_layout(sources["hf_dir"]).what == "a Hugging Face model directory"
    assert file_layout(sources["lightning"]) == "a PyTorch Lightning checkpoint"
    assert file_layout(sources["plain"]) == "a plain PyTorch state dict"
    assert sniff(sources["random"]).kind == "data" and sniff(sources["text"]).kind == "text"
    assert sniff(sources["accelerate"] / "model.safetensors").kind == "safetensors"
    assert sniff(sources["accelerate"] / "random_states_0.pkl").kind == "pickle"


# ------------------------------------------------------------------ --train.resume-from
RESUME_WORDS = {
    "accelerate": ["Accelerate save_state directory", "--train.weight {src}/model.safetensors", "train.key_rules"],
    "accelerate_bin": ["Accelerate save_state directory", "--train.weight {src}/pytorch_model.bin", "train.key_rules"],
    "hf_dir": ["Hugging Face model directory", "--train.weight {src}/model.safetensors", "train.key_rules"],
    "lightning": ["PyTorch Lightning checkpoint", "--train.weight {src}", "train.key_rules = [['^model\\.', '']]"],
    "plain": ["plain PyTorch state dict", "--train.weight {src}", "train.key_rules"],
    "random": ["is not a PyTorch checkpoint (unrecognised bytes)", "model/last"],
    "text": ["is not a PyTorch checkpoint (a text file)", "model/last"],
}


@pytest.mark.parametrize("kind", sorted(RESUME_WORDS))
def test_resume_from_a_foreign_source_names_it_and_the_warm_start_to_use(sources, kind):
    src = sources[kind]
    with pytest.raises(CheckpointError) as e:
        resolve_resume_path(src)  # what `pimm launch --train.resume-from` and its --dry-run check first
    line = str(e.value)
    assert e.value.exit_code == 2 and "\n" not in line
    for words in RESUME_WORDS[kind]:
        assert words.format(src=src) in line, line
    assert "Incomplete checkpoint directory" not in line and "holds weights only" not in line


@pytest.mark.parametrize("kind", ["accelerate", "text"])
def test_resume_from_a_foreign_source_cli(sources, tmp_path, kind):
    line = _one_error(_launch(tmp_path / "exp", "--train.resume-from", sources[kind]))
    assert line == f"error: {RESUME_REFUSALS[kind](sources[kind])}"
    assert not (tmp_path / "exp").exists()  # nothing left behind


RESUME_REFUSALS = {
    "accelerate": lambda src: (f"{src} is an Accelerate save_state directory, not a pimm checkpoint, and cannot resume "
                               "a run (pimm cannot restore its optimizer, scheduler and RNG state); warm-start a new "
                               f"run from its weights with --train.weight {src}/model.safetensors (rename keys that "
                               "differ with train.key_rules)"),
    "text": lambda src: (f"{src} is not a PyTorch checkpoint (a text file); --train.resume-from takes a pimm "
                         "checkpoint: a run's model/last, its model/ directory, model_last.pth or step_<N>.pth"),
}


def test_resume_from_a_directory_of_something_else_is_not_called_incomplete(tmp_path):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"\xff\xd8\xff")
    with pytest.raises(CheckpointError) as e:
        resolve_resume_path(other)
    assert e.value.exit_code == 2
    assert str(e.value).startswith(f"{other} is not a pimm checkpoint directory"), e.value


# ------------------------------------------------------------------ --train.weight
@pytest.mark.parametrize("kind, words", [("random", "(unrecognised bytes)"), ("text", "(a text file)")])
def test_warm_start_from_something_that_is_not_a_checkpoint(sources, kind, words):
    model = build_model(load_config(DIGITS).model, 64, (1, 8, 8), 10)
    for check in (lambda: check_weight_source(sources[kind]), lambda: warm_start(model, sources[kind])):
        with pytest.raises(CheckpointError) as e:  # the launch's check, and the trainer's read
            check()
        assert e.value.exit_code == 2
        assert str(e.value).startswith(f"{sources[kind]} is not a PyTorch checkpoint {words}"), e.value


def test_warm_start_from_text_cli(sources, tmp_path):
    line = _one_error(_launch(tmp_path / "exp", "--train.weight", sources["text"]))
    assert line.startswith(f"error: {sources['text']} is not a PyTorch checkpoint (a text file); "), line
    assert "KeyError" not in line and "weights_only" not in line
    assert not (tmp_path / "exp").exists()


def test_warm_start_from_lightning_names_it_and_the_key_rule(sources, tmp_path):
    line = _one_error(_launch(tmp_path / "exp", "--train.weight", sources["lightning"], "--", *FAST))
    assert "no parameters matched" in line and "(a PyTorch Lightning checkpoint)" in line, line
    assert line.endswith("add train.key_rules = [['^model\\.', '']]"), line
    assert not (tmp_path / "exp").exists()  # the trainer failed: the run directory it had made is gone


@pytest.mark.parametrize("kind, overrides", [("plain", ()),
                                             ("lightning", ("train.key_rules=[['^model\\.', '']]",))])
def test_foreign_weights_warm_start(sources, tmp_path, kind, overrides):
    """A plain state dict and, with the suggested key rule, a Lightning checkpoint warm-start
    a launch: every parameter is loaded."""
    result = _launch(tmp_path / "exp", "--run.name", "w", "--run.no-timestamp", "--train.weight", sources[kind],
                     "--", *FAST, *overrides, here=kind != "plain")
    assert result.returncode == 0, describe(result)
    prov = json.loads((tmp_path / "exp" / "digits" / "w" / "provenance.json").read_text())
    ws = prov["starts"][0]["warm_start"]
    assert ws["loaded_params"] == ws["model_params"] == 6 and ws["missing"] == ws["unexpected"] == 0, ws


@pytest.mark.parametrize("kind", ["accelerate", "accelerate_bin", "hf_dir", "plain"])
def test_foreign_weights_load_every_parameter(sources, kind):
    model = build_model(load_config(DIGITS).model, 64, (1, 8, 8), 10)
    report = warm_start(model, sources[kind])
    assert report.loaded_params == report.model_params == 6 and not report.missing and not report.unexpected
    want = _digits_state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


# ------------------------------------------------------------------ hf:// without a network
HF_DOWN = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "3"}


def test_hub_unreachable_fails_fast_in_one_line_and_leaves_nothing(tmp_path):
    result = _launch(tmp_path / "exp", "--train.weight", "hf://org/repo", env={**HF_DOWN, "HF_HOME": str(tmp_path)})
    line = _one_error(result, code=1)  # and no "Retrying in 8s" lines: one probe, no back-off
    assert "the Hugging Face Hub at http://127.0.0.1:9 is unreachable" in line and "HF_HUB_OFFLINE=1" in line, line
    assert "none of" not in line
    assert not (tmp_path / "exp").exists()
    dry = _launch(tmp_path / "exp", "--dry-run", "--train.weight", "hf://org/repo",
                  env={**HF_DOWN, "HF_HOME": str(tmp_path)})
    assert "unreachable" in _one_error(dry, code=1)


def _fake_hub_cache(home: Path, sd: dict[str, torch.Tensor]) -> Path:
    """``org/repo``'s ``model.safetensors`` at ``main`` in the layout huggingface_hub caches it."""
    from safetensors.torch import save_file

    repo = home / "hub" / "models--org--repo"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(snap / "model.safetensors"))
    return snap / "model.safetensors"


@pytest.mark.parametrize("env", [HF_DOWN, {"HF_HUB_OFFLINE": "1"}], ids=["unreachable", "offline"])
def test_hub_cached_file_is_used_without_network(tmp_path, env):
    cached = _fake_hub_cache(tmp_path / "hf", _digits_state_dict())
    code = ("from pimm_core.checkpoint.weights.sources import resolve_weight_source as r; "
            "print(r('hf://org/repo')); print(r('hf://org/repo/model.safetensors'))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=hang_s(60),
                            env={**clean_env(), **env, "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 0, describe(result)
    assert result.stdout.split() == [str(cached.resolve())] * 2
    if "HF_HUB_OFFLINE" in env:
        missing = subprocess.run([sys.executable, "-c", code.replace("org/repo'", "org/other'", 1)], cwd=REPO,
                                 capture_output=True, text=True, timeout=hang_s(60),
                                 env={**clean_env(), **env, "HF_HOME": str(tmp_path / "hf")})
        assert "HubUnreachableError: cannot use hf://org/other: HF_HUB_OFFLINE is set" in missing.stderr


# ------------------------------------------------------------------ --dry-run checks what the launch checks
def test_dry_run_refuses_an_unknown_model_like_the_launch(tmp_path):
    dry = _one_error(_launch(tmp_path / "exp", "--dry-run", "--", "model.name=resnet"))
    real = _one_error(_launch(tmp_path / "exp", "--", "model.name=resnet"))
    assert dry == real and "model.name = 'resnet' is not a known model" in dry
    assert not (tmp_path / "exp").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_line_at_dry_run_and_launch(tmp_path):
    dry = _one_error(_launch(tmp_path / "exp", "--dry-run", "--", "train.device=cuda"))
    real = _one_error(_launch(tmp_path / "exp", "--", "train.device=cuda"))
    assert dry == real and "train.device = 'cuda' but CUDA is not available" in dry
    assert not (tmp_path / "exp").exists()


def test_dry_run_names_the_warm_start_and_fails_like_the_launch(sources, tmp_path):
    missing = tmp_path / "nonexistent.pth"
    dry = _launch(tmp_path / "exp", "--dry-run", "--train.weight", missing)
    assert f"warm start from {missing}" in dry.stdout, describe(dry)
    assert "nothing will be restored" not in dry.stdout
    real = _launch(tmp_path / "exp", "--train.weight", missing)
    assert _one_error(dry) == _one_error(real) and "No weight found" in _one_error(real)
    assert not (tmp_path / "exp").exists()


def test_dry_run_of_a_warm_start_reports_what_it_would_load(sources, tmp_path):
    result = _launch(tmp_path / "exp", "--dry-run", "--train.weight", sources["accelerate"])
    assert result.returncode == 0, describe(result)
    out = result.stdout.splitlines()
    assert f"fresh start (no resume requested); warm start from {sources['accelerate']}: model weights only" in out
    assert f"  reads {sources['accelerate'] / 'model.safetensors'}, raw weights" in out
    assert "  loaded 6 tensors (6/6 model parameters)" in out
    assert out[-1] == "dry run: nothing was trained or written"
    assert not (tmp_path / "exp").exists()
