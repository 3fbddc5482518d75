"""The config keys that plug user code in (model/data targets, objective, [optimizer],
[scheduler], [log]): they load, round-trip through the saved config.toml, refuse what
cannot work with one line naming the key, and leave the older keys' meaning unchanged."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from pimm_core.config import SCHEDULER_KINDS, Config, config_from_dict, load_config, write_config
from pimm_core.data.loaders import as_datasets, build_datasets, data_spec
from pimm_core.errors import ConfigError
from pimm_core.models import build_model, model_spec
from pimm_core.targets import TargetSpec, call

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "digits.toml"

PLUGGED = """
objective = "language_modeling"
[model]
target = "pkg.models:build"
[model.args]
width = 64
class_ = "kept as written"
empty = {}
[data]
target = "pkg.data:make"
[data.args]
block = 32
[optimizer]
name = "AdamW"
[optimizer.args]
betas = [0.9, 0.95]
[scheduler]
name = "multistep"
[scheduler.args]
milestones = [10, 20]
[log]
tensorboard = true
[eval]
metric = "val/perplexity"
mode = "min"
"""


def load_text(tmp_path: Path, text: str, overrides=()) -> Config:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return load_config(p, list(overrides))


def error_of(tmp_path: Path, text: str, overrides=()) -> str:
    with pytest.raises(ConfigError) as e:
        load_text(tmp_path, text, overrides)
    assert "\n" not in str(e.value) and e.value.exit_code == 2
    return str(e.value)


def test_digits_config_writes_no_plugin_keys():
    d = load_config(DIGITS).to_dict()
    assert "optimizer" not in d and "scheduler" not in d
    assert "target" not in d["model"] and "args" not in d["model"] and "target" not in d["data"]
    assert d["objective"] == "classification" and d["log"] == {"tensorboard": False}


def test_plugged_config_loads_and_round_trips(tmp_path):
    cfg = load_text(tmp_path, PLUGGED, ["model.args.width=128", "scheduler.args.gamma=0.5"])
    assert cfg.model.target == "pkg.models:build"
    assert cfg.model.args == {"width": 128, "class_": "kept as written", "empty": {}}
    assert cfg.data.args == {"block": 32}
    assert (cfg.optimizer.name, cfg.optimizer.args) == ("AdamW", {"betas": [0.9, 0.95]})
    assert cfg.scheduler.args == {"milestones": [10, 20], "gamma": 0.5}
    assert cfg.log.tensorboard and cfg.objective == "language_modeling"
    write_config(cfg, tmp_path / "saved.toml")
    again = config_from_dict(tomllib.loads((tmp_path / "saved.toml").read_text()))
    assert again == cfg  # user arguments (even class_, or an empty table) are written as given


@pytest.mark.parametrize("text,overrides,message", [
    ("[model]\ntarget = 'pkg.models'\n", (), "model.target = 'pkg.models' is not a target; write 'package.module:attr'"),
    ("[model.args]\nwidth = 3\n", (), "model.args is set but model.target is not"),
    ("[data.args]\nblock = 3\n", (), "data.args is set but data.target is not"),
    ("[optimizer.args]\neps = 1e-6\n", (), "optimizer.args is set but optimizer.target or optimizer.name is not"),
    ("[optimizer]\nname = 'SGD'\ntarget = 'a.b:c'\n", (), "optimizer.name and optimizer.target are both set; use one"),
    ("[optimizer]\nname = 'SGD'\n[optimizer.args]\nlr = 0.1\n", (),
     "optimizer.args.lr: pimm sets it from train.lr; set train.lr instead"),
    ("[optimizer]\nname = 'SGD'\n", ["optimizer.args.weight_decay=0.1"],
     "override: optimizer.args.weight_decay: pimm sets it from train.weight_decay"),
    ("[scheduler]\nname = 'onecycle'\n[train]\nwarmup_steps = 5\n", (),
     "scheduler.name = 'onecycle' has its own warm-up (scheduler.args.pct_start); set train.warmup_steps = 0"),
    ("[scheduler]\nname = 'cosine_annealing'\n", (), "scheduler.name = 'cosine_annealing' is not allowed; use one of"),
    ("objective = 'clasification'\n", (),
     "objective = 'clasification' is not a built-in objective; did you mean 'classification'?"),
    ("objective = 'regression'\n", (), "eval.metric = 'val/acc' is not produced by the evaluator; "
                                        "use one of ['val/mae', 'val/loss']"),
    ("objective = 'pkg.obj:step'\n[eval]\nmetric = 'acc'\n", (),
     "eval.metric = 'acc' must name a validation metric 'val/<name>' of the objective"),
    ("[model]\nargs = 3\n", (), "model.args must be a table of keyword arguments, got 3"),
    ("[log]\ntensorbord = true\n", (), "unknown key log.tensorbord; did you mean log.tensorboard?"),
])
def test_plugin_key_errors_are_one_line_naming_the_key(tmp_path, text, overrides, message):
    assert message in error_of(tmp_path, text, overrides)


def test_error_names_the_file_line(tmp_path):
    msg = error_of(tmp_path, "[train]\nepochs = 2\n[model]\ntarget = 'x'\n")
    assert msg.startswith(f"{tmp_path / 'c.toml'}:4: model.target")


def test_user_objective_and_targets_load(tmp_path):
    cfg = load_text(tmp_path, "objective = 'pkg.obj:step'\n[eval]\nmetric = 'val/f1'\n"
                              "[scheduler]\ntarget = 'pkg.s:make'\n[scheduler.args]\nk = 1\n")
    assert cfg.objective == "pkg.obj:step" and cfg.scheduler.args == {"k": 1}


def test_every_scheduler_kind_is_accepted(tmp_path):
    for kind in SCHEDULER_KINDS:
        assert load_text(tmp_path, f"[scheduler]\nname = '{kind}'\n").scheduler.name == kind


def test_builtin_model_name_is_the_same_target_as_model_target():
    """``model.name = "cnn"`` and ``model.target = "pimm_core.models:cnn"`` build the same model."""
    cfg = load_config(DIGITS, ["model.name=cnn", "model.hidden=32"])
    spec = model_spec(cfg.model)
    assert (spec.key, spec.target, spec.args) == ("model.name", "pimm_core.models:cnn", {"hidden": 32, "dropout": 0.1})
    torch.manual_seed(0)
    via_name = build_model(cfg.model, 64, (1, 8, 8), 10)
    torch.manual_seed(0)
    via_target = call(model_spec(load_config(DIGITS, ['model.target="pimm_core.models:cnn"',
                                                      "model.args.hidden=32"]).model))
    a, b = via_name.state_dict(), via_target.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError, match="model.name = 'vit' is not a known model"):
        model_spec(load_config(DIGITS, ["model.name=vit"]).model)


def test_builtin_data_name_is_the_same_target_as_data_target():
    cfg = load_config(DIGITS, ["data.val_fraction=0.25"])
    spec = data_spec(cfg.data)
    assert spec.target == "pimm_core.data:digits"
    by_name = build_datasets(cfg.data)
    by_target = as_datasets(call(data_spec(load_config(DIGITS, ['data.target="pimm_core.data:digits"',
                                                               "data.args.val_fraction=0.25"]).data)), spec)
    assert by_target.fingerprint == by_name.fingerprint
    assert len(by_target.val) == len(by_name.val) == 449
    with pytest.raises(ConfigError, match="data.name = 'mnist' is not a known dataset"):
        data_spec(load_config(DIGITS, ["data.name=mnist"]).data)


def test_as_datasets_accepts_the_documented_shapes():
    spec = TargetSpec("data.target", "u.d:make", {}, "data.args")
    tr, va = torch.utils.data.TensorDataset(torch.zeros(4)), torch.utils.data.TensorDataset(torch.ones(2))
    assert as_datasets((tr, va), spec).train is tr
    assert as_datasets((tr, va, list), spec).collate_fn is list
    assert as_datasets({"train": tr, "val": va, "fingerprint": "abc"}, spec).fingerprint == "abc"

    class Stream(torch.utils.data.IterableDataset):
        def __init__(self, fp):
            self.fp = fp

        def __iter__(self):
            return iter(range(3))

        def fingerprint(self):
            return self.fp

    both = as_datasets((Stream("a"), Stream("b")), spec)
    assert both.fingerprint is not None and both.fingerprint != as_datasets((Stream("a"), Stream("c")), spec).fingerprint
    assert as_datasets((tr, va), spec).fingerprint is None
    with pytest.raises(ConfigError, match=r'^data.target = "u.d:make": returned int; return \(train, val\)'):
        as_datasets(3, spec)
    with pytest.raises(ConfigError, match="its val split is a int, not a dataset"):
        as_datasets((tr, 5), spec)
