"""Export: model file, config.json hygiene, export.json, tied tensors, overwrite refusal, the CLI.

Checkpoints are written here with torch.save in the documented layouts, except in
``test_trained_run_export_reproduces_val_accuracy``, which exports the session's real run
(conftest's ``trained_run``) through ``pimm export``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from _helpers import hang_s
from pimm_core.checkpoint.export.model_dir import export, load_exported
from pimm_core.checkpoint.export.config import REDACTED, sanitize_config
from pimm_core.checkpoint.records.manifest import sha256_file
from pimm_core.checkpoint.tensors.ties import find_aliases
from pimm_core.checkpoint.weights.read import read_weight_sets
from pimm_core.cli import main
from pimm_core.errors import CheckpointError, UsageError

REPO = Path(__file__).resolve().parents[2]


class Tied(nn.Module):
    """A language-model-like module whose output head shares the embedding matrix."""

    def __init__(self, vocab: int = 11, dim: int = 4, tie: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)


CONFIG_TOML = """\
checkpoint_format = "standard"
[run]
root = "/home/alice/exp"
group = "g"
name = "r"
[train]
epochs = 2
resume = true
weight = "/home/alice/pretrained/weights.pth"
[data]
name = "digits"
cache = ["/scratch/cache", "relative/dir", "C:\\\\data"]
[model]
name = "mlp"
hidden = 16
"""


def fake_run(root: Path, sd: dict, *, step: int = 42, ema: dict | None = None) -> Path:
    """A run directory with config.toml and a complete standard model/last."""
    run = root / "exp" / "g" / "r"
    last = run / "model" / "last"
    (last / "trainer.dcp").mkdir(parents=True)
    (run / "config.toml").write_text(CONFIG_TOML)
    torch.save({"state_dict": sd} | ({"ema_state_dict": ema} if ema else {}), last / "weights.pth")
    files = {"weights.pth": {"size": (last / "weights.pth").stat().st_size, "sha256": sha256_file(last / "weights.pth")}}
    (last / "manifest.json").write_text(json.dumps({"format": "standard", "step": step, "epoch": 1, "iter": 0,
                                                    "metrics": {"val/acc": 0.5}, "files": files}))
    (last / ".complete").write_text("")
    return run


def strings(node) -> list[str]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return [node] if isinstance(node, str) else []


def test_export_standard_run(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Small()
    run = fake_run(tmp_path, {f"module.{k}": v for k, v in model.state_dict().items()})
    out = export("last", tmp_path / "art" / "small", run_dir=run)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "export.json", "model.safetensors"]
    assert not (tmp_path / "art" / "small.tmp").exists()

    sd = read_weight_sets(out / "model.safetensors")["raw"]
    assert sorted(sd) == sorted(model.state_dict())  # no module./_orig_mod. prefixes
    fresh = Small()
    load_exported(fresh, out)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["train"]["weight"] == "" and cfg["train"]["resume"] is False
    assert cfg["run"]["root"] == REDACTED and cfg["data"]["cache"] == [REDACTED, "relative/dir", REDACTED]
    assert not [s for s in strings(cfg) if os.path.isabs(s) or s.startswith("C:")]
    assert cfg["model"] == {"name": "mlp", "hidden": 16}

    rec = json.loads((out / "export.json").read_text())
    assert rec["source"] == str((run / "model" / "last" / "weights.pth").resolve())
    assert rec["step"] == 42 and rec["weights"] == "raw" and rec["format"] == "safetensors"
    assert rec["sha256"] == sha256_file(out / "model.safetensors")
    assert rec["config_cleared"] == ["train.weight", "train.resume"]
    assert sorted(rec["config_redacted"]) == ["data.cache[0]", "data.cache[2]", "run.root"]


def test_config_found_by_walking_up_and_bin_format(tmp_path: Path) -> None:
    model = Small()
    run = fake_run(tmp_path, model.state_dict(), step=9)
    out = export(run / "model" / "last", tmp_path / "o", fmt="bin")
    assert (out / "config.json").is_file()
    plain = torch.load(out / "pytorch_model.bin", weights_only=True)  # an ordinary state dict
    assert sorted(plain) == sorted(model.state_dict())
    assert json.loads((out / "export.json").read_text())["step"] == 9
    # a file outside any run: no config.json
    torch.save(model.state_dict(), tmp_path / "user.pt")
    out2 = export(tmp_path / "user.pt", tmp_path / "o2")
    assert not (out2 / "config.json").exists()
    assert json.loads((out2 / "export.json").read_text())["config"] is None


def test_sanitize_config_is_a_copy() -> None:
    cfg = {"train": {"weight": "rel/w.pth", "resume": True}, "x": {"y": "~/data"}}
    clean, cleared, redacted = sanitize_config(cfg)
    assert clean == {"train": {"weight": "", "resume": False}, "x": {"y": REDACTED}}
    assert cfg["train"]["weight"] == "rel/w.pth" and cleared == ["train.weight", "train.resume"]
    assert redacted == ["x.y"]


def test_tied_weights_round_trip(tmp_path: Path) -> None:
    from safetensors import safe_open

    torch.manual_seed(0)
    model = Tied()
    sd = model.state_dict()
    assert sd["head.weight"] is not None and find_aliases(sd) == {"head.weight": "embed.weight"}
    torch.save({"state_dict": sd}, tmp_path / "weights.pth")

    out = export(tmp_path / "weights.pth", tmp_path / "st")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert list(f.keys()) == ["embed.weight"]  # first in sorted order kept, alias dropped
        assert json.loads(f.metadata()["pimm.aliases"]) == {"head.weight": "embed.weight"}
    assert json.loads((out / "export.json").read_text())["aliases"] == {"head.weight": "embed.weight"}
    sets = read_weight_sets(out / "model.safetensors")["raw"]
    assert sets["head.weight"] is sets["embed.weight"]

    torch.manual_seed(1)
    fresh = Tied()
    assert load_exported(fresh, out) == {"head.weight": "embed.weight"}
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, model.embed.weight)
    untied = Tied(tie=False)  # same keys, separate parameters: load_exported re-ties them
    load_exported(untied, out)
    assert untied.head.weight is untied.embed.weight and torch.equal(untied.head.weight, model.embed.weight)

    # the choice of kept name does not depend on the state dict's order
    reordered = dict(reversed(list(sd.items())))
    torch.save({"state_dict": reordered}, tmp_path / "reordered.pth")
    again = export(tmp_path / "reordered.pth", tmp_path / "st2")
    assert json.loads((again / "export.json").read_text())["aliases"] == {"head.weight": "embed.weight"}

    # the standard loaders restore the tie: safetensors' load_model, strictly
    from safetensors.torch import load_model

    torch.manual_seed(2)
    std = Tied()
    assert load_model(std, out / "model.safetensors", strict=True) == (set(), [])
    assert torch.equal(std.head.weight, model.embed.weight)

    # one rule for every format: pytorch_model.bin holds the same names as model.safetensors
    out_bin = export(tmp_path / "weights.pth", tmp_path / "bin", fmt="bin")
    assert list(torch.load(out_bin / "pytorch_model.bin", weights_only=True)) == ["embed.weight"]
    std_bin = Tied()
    std_bin.load_state_dict(torch.load(out_bin / "pytorch_model.bin", weights_only=True), strict=False)
    assert std_bin.head.weight is std_bin.embed.weight and torch.equal(std_bin.head.weight, model.embed.weight)
    fresh_bin = Tied(tie=False)
    load_exported(fresh_bin, out_bin)
    assert fresh_bin.head.weight is fresh_bin.embed.weight


def test_refuses_existing_out_dir_without_force(tmp_path: Path, capsys) -> None:
    model = Small()
    torch.save({"state_dict": model.state_dict()}, tmp_path / "w.pth")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(UsageError, match="use --force") as e:
        export(tmp_path / "w.pth", out)
    assert e.value.exit_code == 2 and (out / "keep.txt").read_text() == "precious"
    assert main(["export", str(tmp_path / "w.pth"), str(out)]) == 2
    assert "error:" in capsys.readouterr().err
    # --force replaces only a previous export: a directory holding the user's file is not one
    assert main(["export", str(tmp_path / "w.pth"), str(out), "--force"]) == 2
    assert "is not one: it holds files an export does not write (keep.txt)" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious"
    previous = export(tmp_path / "w.pth", tmp_path / "previous")
    (previous / "model.safetensors").write_bytes(b"stale")
    assert main(["export", str(tmp_path / "w.pth"), str(previous), "--force"]) == 0
    assert sorted(p.name for p in previous.iterdir()) == ["export.json", "model.safetensors"]
    assert (previous / "model.safetensors").read_bytes() != b"stale"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "previous", "w.pth"]  # nothing set aside is left
    (tmp_path / "empty").mkdir()
    export(tmp_path / "w.pth", tmp_path / "empty")  # an empty directory is fine


def test_cli_keywords_weights_and_errors(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    raw, ema = Small(), Small()
    run = fake_run(tmp_path, raw.state_dict(), ema=ema.state_dict())
    torch.save({"state_dict": raw.state_dict()}, run / "model" / "iter_20.pth")
    it = run / "model" / "iter_20.pth"
    (run / "model" / "iter_20.pth.json").write_text(json.dumps({"format": "weights", "step": 20, "epoch": 0, "iter": 20,
        "files": {it.name: {"size": it.stat().st_size, "sha256": sha256_file(it)}}}))

    assert main(["export", "--run-dir", str(run), "last", str(tmp_path / "e"), "--weights", "ema"]) == 0
    assert "ema weights" in capsys.readouterr().out
    sd = read_weight_sets(tmp_path / "e")["raw"]
    assert torch.equal(sd["body.weight"], ema.body.weight)

    assert main(["export", "--run-dir", str(run), "iter_20", str(tmp_path / "i")]) == 0
    assert json.loads((tmp_path / "i" / "export.json").read_text())["step"] == 20

    capsys.readouterr()
    assert main(["export", "--run-dir", str(run), "best", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err.startswith("error: No weight found: best")
    assert main(["export", str(tmp_path / "missing.pth"), str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: No weight found:") and "missing.pth" in err and err.count("\n") == 1
    # a name the run does not have: the line lists the names it has (a newcomer's typo)
    assert main(["export", "--run-dir", str(run), "iter_21", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: No weight found: iter_21") and err.count("\n") == 1, err
    assert "iter_20" in err, err
    assert main(["export", "--run-dir", str(run), "lats", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "lats is not a checkpoint of" in err and "pass one of: last" in err and err.count("\n") == 1, err
    assert main(["export", "--run-dir", str(run), "last", str(tmp_path / "f"), "--format", "onnx"]) == 2
    assert not (tmp_path / "m").exists() and not (tmp_path / "f").exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_export_refuses_malicious_pickle(tmp_path: Path, capsys) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"state_dict": {"w": Evil()}}, tmp_path / "evil.pth")
    with pytest.raises(CheckpointError, match="refusing"):
        export(tmp_path / "evil.pth", tmp_path / "o")
    assert main(["export", str(tmp_path / "evil.pth"), str(tmp_path / "o")]) == 2  # a hostile file: bad input
    assert not marker.exists() and not (tmp_path / "o").exists() and not (tmp_path / "o.tmp").exists()


def test_trained_run_export_reproduces_val_accuracy(trained_run, tmp_path: Path) -> None:
    """A real run of the digits quickstart (3 epochs), `last` exported via the CLI, the export re-evaluated."""
    from pimm_core.config import DataConfig, ModelConfig
    from pimm_core.data.loaders import build_datasets
    from pimm_core.models import build_model

    assert trained_run.result.returncode == 0, trained_run.result.stderr[-2000:]
    run = trained_run.run_dir  # exported from, not modified
    evals = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if '"val"' in ln]
    final_acc = evals[-1]["acc"]

    out = tmp_path / "artifact"
    assert main(["export", "--run-dir", str(run), "last", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["run"]["root"] == REDACTED
    data = build_datasets(DataConfig(**cfg["data"]))
    model = build_model(ModelConfig(**cfg["model"]), data.in_features, data.in_shape, data.num_classes)
    load_exported(model, out)
    model.eval()
    x, y, _ = data.val.tensors
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 256]).argmax(1) == y[i:i + 256]).sum()) for i in range(0, len(y), 256))
    assert correct / len(y) == final_acc
    rec = json.loads((out / "export.json").read_text())
    assert rec["step"] == json.loads((run / "model" / "last" / "manifest.json").read_text())["step"]



def test_a_wrong_name_lists_best_where_the_run_has_it(trained_run, tmp_path: Path, capsys) -> None:
    # (a newcomer's `export ... bestt ...` was told "pass one of: last" though `best` exports fine)
    run = trained_run.run_dir
    assert (run / "model" / "model_best.pth").is_file()
    assert main(["export", "--run-dir", str(run), "bestt", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "pass one of: last, best" in err and err.count("\n") == 1, err
    assert main(["export", "--run-dir", str(run), "best", str(tmp_path / "b")]) == 0  # (the name it lists works)


# ------------------------------------------------------------------ reproducible exports
WEIGHTS_FILE = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}


def _digests(out: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(out.iterdir())}


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_export_twice_gives_the_same_bytes(tmp_path: Path, fmt: str) -> None:
    """Two `pimm export`s of one checkpoint, in two processes with different hash seeds: every file
    has the same sha256 (no export time recorded; the safetensors header, whose metadata order the
    library leaves to a hash map, is written in one order; pytorch_model.bin's inner folder is not named
    after a temporary file)."""
    torch.manual_seed(0)
    model = Tied()
    run = fake_run(tmp_path, model.state_dict(), ema=Tied().state_dict())

    def args(out: Path) -> list[str]:
        return ["export", "--run-dir", str(run), "last", str(out), "--format", fmt, "--weights", "ema"]

    # one in this process, one in a subprocess whose hash seed differs from this process's
    assert main(args(tmp_path / "out0")) == 0
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    res = subprocess.run([sys.executable, "-m", "pimm_core.cli", *args(tmp_path / "out1")], cwd=REPO,
                         capture_output=True, text=True, timeout=hang_s(120),
                         env={**os.environ, "PYTHONHASHSEED": seed})
    assert res.returncode == 0, res.stderr[-2000:]
    outs = [_digests(tmp_path / "out0"), _digests(tmp_path / "out1")]
    assert outs[0] == outs[1] and sorted(outs[0]) == sorted(["config.json", "export.json", WEIGHTS_FILE[fmt]])
    rec = json.loads((tmp_path / "out0" / "export.json").read_text())
    assert "created" not in rec and rec["sha256"] == outs[0][WEIGHTS_FILE[fmt]]


def test_safetensors_header_is_canonical(tmp_path: Path) -> None:
    from pimm_core.checkpoint.export.files import write_safetensors

    sd = Small().state_dict()
    meta = {f"k{i}": str(i) for i in range(12)}
    digests = set()
    for i in range(4):  # the library's own order differs from call to call
        write_safetensors(sd, tmp_path / f"{i}.safetensors", metadata=meta)
        digests.add(sha256_file(tmp_path / f"{i}.safetensors"))
    assert len(digests) == 1
    head = (tmp_path / "0.safetensors").read_bytes()
    n = int.from_bytes(head[:8], "little")
    header = json.loads(head[8:8 + n])
    assert n % 8 == 0 and list(header)[0] == "__metadata__"
    assert list(header["__metadata__"]) == sorted(header["__metadata__"])
    sets = read_weight_sets(tmp_path / "0.safetensors")["raw"]
    assert all(torch.equal(sets[k], v) for k, v in sd.items())


def test_export_of_ema_from_a_run_without_ema_is_bad_input(tmp_path: Path, capsys) -> None:
    run = fake_run(tmp_path, Small().state_dict())
    assert main(["export", "--run-dir", str(run), "last", str(tmp_path / "o"), "--weights", "ema"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: last has no ema weights (it has: raw)"), err
    assert "--weights raw" in lines[0] and "Traceback" not in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.tmp").exists()
