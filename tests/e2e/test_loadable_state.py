"""A checkpoint that saves must load: state ``torch.load(weights_only=True)`` would refuse is encoded
(numpy values, a module's non-tensor extra state, ``io.BytesIO``) and given back as saved, or refused
at the save naming its owner; an optimizer of another structure is refused before anything is
loaded; the config's optimizer settings take effect on a resume. In this process: the checkpoint
functions themselves, and one-rank runs through ``pimm_here`` (FSDP at 2 ranks:
tests/e2e/test_save_failures.py's launch)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from _helpers import describe, pimm_here, read_json
from pimm_core.checkpoint.export.model_dir import export, load_exported
from pimm_core.checkpoint.tensors.safe_state import UnloadableStateError, decode, encode, extra_state_problem, install_extra_state_codec
from pimm_core.checkpoint.formats.standard import load_standard, save_standard
from pimm_core.process.dist import DistInfo
from pimm_core.errors import CheckpointError

META = {"trainer": {"global_step": 3, "epoch": 0, "iter": 3}, "scheduler": {}, "scaler": {}, "world_size": 1,
        "workers_per_rank": 0}


class Opaque:  # a user class nobody registered with torch.serialization.add_safe_globals
    pass


def test_numpy_values_and_bytesio_come_back_as_saved_and_other_objects_are_refused_by_path():
    state = {"f16": np.arange(6, dtype=np.float16).reshape(2, 3), "scalar": np.float32(0.25), "i": np.int64(7),
             "bool": np.bool_(True), "zero_d": np.array(3.5), "when": np.datetime64("2026-01-02", "ns"),
             "nested": [(np.uint8(255), "x")], "buf": io.BytesIO(b"\x00fp8"), "plain": {"a": 1, "t": torch.ones(2)}}
    buf = io.BytesIO()
    torch.save(encode(state), buf)
    buf.seek(0)
    back = decode(torch.load(buf, weights_only=True))  # the loader a resume uses
    for key in ("f16", "zero_d"):
        assert type(back[key]) is np.ndarray and back[key].dtype == state[key].dtype
        assert back[key].tobytes() == state[key].tobytes() and back[key].shape == state[key].shape
    for key in ("scalar", "i", "bool", "when"):
        assert type(back[key]) is type(state[key]) and back[key] == state[key]
    assert type(back["nested"][0]) is tuple and type(back["nested"][0][0]) is np.uint8
    assert back["buf"].getvalue() == b"\x00fp8" and back["plain"]["a"] == 1
    with pytest.raises(UnloadableStateError, match=r"\['cb'\]\[1\] is a test_loadable_state\.Opaque.*"
                                                   r"add_safe_globals\(\[Opaque\]\)"):
        encode({"cb": [1, Opaque()]})
    with pytest.raises(UnloadableStateError, match="dtype object"):
        encode(np.array([{"a": 1}], dtype=object))
    torch.serialization.add_safe_globals([Opaque])  # the user's own way to allow a class
    try:
        assert isinstance(encode({"cb": Opaque()})["cb"], Opaque)
    finally:
        torch.serialization.clear_safe_globals()


class WithExtra(nn.Module):
    """A layer whose extra state is a dict of Python and numpy values, as TransformerEngine's FP8 metadata."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.extra = {"amax": np.array([1.5, 2.0], dtype=np.float32), "recipe": "delayed", "steps": 2,
                      "blob": io.BytesIO(b"opaque")}
        self.received = None

    def forward(self, x):
        return self.lin(x)

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.received = state


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(WithExtra(), nn.ReLU(), nn.Linear(3, 2))


def _same_extra(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and a["amax"].tobytes() == b["amax"].tobytes() and a["amax"].dtype == b["amax"].dtype \
        and a["recipe"] == b["recipe"] and a["steps"] == b["steps"] and a["blob"].getvalue() == b["blob"].getvalue()


def test_a_modules_extra_state_is_saved_as_tensors_and_given_back_to_set_extra_state(tmp_path):
    model = _net()
    install_extra_state_codec(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    save_standard(tmp_path, model=model, optimizer=opt, meta=META, rank_state={}, manifest={"kind": "last", "step": 3},
                  info=DistInfo())
    plain = torch.load(tmp_path / "last" / "weights.pth", weights_only=True)  # a user's plain load
    assert all(isinstance(v, torch.Tensor) for v in plain["state_dict"].values())

    fresh = _net()
    fresh[0].extra = {"amax": np.zeros(2, np.float32), "recipe": "other", "steps": 0, "blob": io.BytesIO(b"")}
    install_extra_state_codec(fresh)  # (a longer or shorter encoding than the saved one: never a shape mismatch)
    load_standard(tmp_path / "last", model=fresh, optimizer=torch.optim.AdamW(fresh.parameters(), lr=1e-2),
                  info=DistInfo())
    assert _same_extra(fresh[0].received, model[0].extra)
    assert torch.equal(fresh[2].weight, model[2].weight)

    out = tmp_path / "export"
    export(tmp_path / "last", out)  # safetensors: tensors only
    bare = _net()  # a user's model without pimm's codec: load_exported decodes for it
    load_exported(bare, out)
    assert _same_extra(bare[0].received, model[0].extra)


def test_extra_state_that_cannot_be_made_loadable_names_the_module_and_the_fix():
    model = _net()
    model[0].extra = {"handle": Opaque()}
    install_extra_state_codec(model)
    problem = extra_state_problem(model)
    assert problem is not None and problem.startswith("module `0` (WithExtra.get_extra_state()): ")
    assert "get_extra_state()['handle'] is a test_loadable_state.Opaque" in problem and "add_safe_globals" in problem


def _two_groups(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": [m[0].lin.weight, m[2].weight]},
                              {"params": [m[0].lin.bias, m[2].bias], "weight_decay": 0.0}], lr=1e-2)


def _moved(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": [m[0].lin.weight]},
                              {"params": [m[0].lin.bias, m[2].bias, m[2].weight], "weight_decay": 0.0}], lr=1e-2)


STRUCTURES = {
    "groups merged": (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), "the parameter groups (2 -> 1)"),
    "another class": (lambda m: torch.optim.SGD([{"params": [m[0].lin.weight, m[2].weight]},
                                                 {"params": [m[0].lin.bias, m[2].bias]}], lr=1e-2, momentum=0.9),
                      "the class (torch.optim.adamw.AdamW -> torch.optim.sgd.SGD)"),
    "a parameter moved to another group": (_moved, "the parameters of group 0 (2 -> 1; e.g. 2.weight left it)"),
}


@pytest.mark.parametrize("case", sorted(STRUCTURES))
def test_an_optimizer_of_another_structure_is_refused_before_anything_is_loaded(tmp_path, case):
    make, says = STRUCTURES[case]
    model = _net()
    opt = _two_groups(model)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    meta = {**META, "optimizer_class": "torch.optim.adamw.AdamW"}
    save_standard(tmp_path, model=model, optimizer=opt, meta=meta, rank_state={}, manifest={"kind": "last", "step": 3},
                  info=DistInfo())
    fresh = _net()
    before = {k: v.clone() for k, v in fresh.state_dict().items() if not k.endswith("_extra_state")}
    fresh_opt = make(fresh)
    with pytest.raises(CheckpointError) as e:
        load_standard(tmp_path / "last", model=fresh, optimizer=fresh_opt, info=DistInfo())
    assert e.value.exit_code == 2 and says in str(e.value) and "resume_strict_state = false" in str(e.value)
    assert not fresh_opt.state and all(torch.equal(v, fresh.state_dict()[k]) for k, v in before.items())
    # best effort: the weights load, the optimizer starts fresh, and the warning says so
    loaded = load_standard(tmp_path / "last", model=fresh, optimizer=fresh_opt, info=DistInfo(), strict=False)
    assert not fresh_opt.state and any(says in s and "starts fresh" in s for s in loaded.skipped)
    assert torch.equal(fresh[2].weight, model[2].weight)


# ---------------------------------------------------------------- whole runs (one rank, this process)
USER = '''
import io
import numpy as np
import torch
from torch import nn

from pimm_core.objectives import classification


class NumpyCallback:
    """Keeps numpy values in its state, as many metric trackers do."""

    def __init__(self, out):
        self.out, self.best, self.seen = out, np.float32(0.0), np.zeros(3, dtype=np.int64)

    def on_step_end(self, trainer):
        self.best = np.float32(self.best + 0.5)
        self.seen = self.seen + 1

    def state_dict(self):
        return {"best": self.best, "seen": self.seen}

    def load_state_dict(self, state):
        with open(self.out, "w") as f:
            import json
            json.dump({k: [type(v).__name__, str(v.dtype), v.tolist()] for k, v in state.items()}, f)


class Holder:
    pass


class BadCallback:
    def state_dict(self):
        return {"ok": 1, "handle": Holder()}

    def load_state_dict(self, state):
        pass


class Objective:
    """A stateful objective (a running count in numpy)."""

    def __init__(self):
        self.calls = np.int64(0)

    def __call__(self, model, batch):
        self.calls += 1
        return classification(model, batch)

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        assert type(state["calls"]) is np.int64, state
        self.calls = state["calls"]


class FP8Like(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.meta = {"amax": np.ones(2, dtype=np.float32), "recipe": "delayed"}

    def forward(self, x):
        if self.training:  # (the encoded state grows: a resume reads it at its saved length, not the model's)
            self.meta["history"] = self.meta.get("history", []) + [len(x)]
        return self.net(x)

    def get_extra_state(self):
        return self.meta

    def set_extra_state(self, state):
        self.meta = state


objective = Objective()


def fp8like(hidden=16):
    return FP8Like(hidden)
'''


@pytest.fixture
def user(tmp_path) -> Path:
    (tmp_path / "loadpkg").mkdir()
    (tmp_path / "loadpkg" / "__init__.py").write_text("")
    (tmp_path / "loadpkg" / "parts.py").write_text(USER)
    return tmp_path


def _config(user: Path, callback: str) -> Path:
    path = user / "load.toml"
    path.write_text(f'''objective = "loadpkg.parts:objective"
[train]
epochs = 2
max_steps = 6
log_every_steps = 1
[data]
name = "digits"
batch_size = 256
[model]
target = "loadpkg.parts:fp8like"
[checkpoint]
every_steps = 3
[eval]
every_epochs = 0
[[callbacks]]
target = "loadpkg.parts:{callback}"
{'[callbacks.args]' + chr(10) + f'out = "{user / "restored.json"}"' if callback == "NumpyCallback" else ""}
''')
    return path


def _launch(user: Path, callback: str, *overrides: str):
    return pimm_here("launch", "--train.config", str(_config(user, callback)), "--run.root", str(user / "exp"),
                     "--run.name", "r", "--run.no-timestamp", *(["--", *overrides] if overrides else []),
                     fresh="loadpkg")


@pytest.mark.parametrize("fmt", ["standard", "single"])
def test_numpy_state_of_callbacks_and_objective_and_dict_extra_state_resume(user, fmt):
    first = _launch(user, "NumpyCallback", "train.max_steps=3", f"checkpoint_format={fmt}")
    assert first.returncode == 0, describe(first)
    run = user / "exp" / "default" / "r"
    verify = pimm_here("checkpoints", "verify", str(run / "model" / "last"))
    assert verify.returncode == 0, describe(verify)
    if fmt == "standard":
        assert read_json(run / "model" / "last" / "manifest.json")["state_checked"] == "torch.load(weights_only=True)"
    second = pimm_here("resume", str(run), "--", "train.max_steps=6", fresh="loadpkg")
    assert second.returncode == 0, describe(second)
    restored = json.loads((user / "restored.json").read_text())
    assert restored == {"best": ["float32", "float32", 1.5], "seen": ["ndarray", "int64", [3, 3, 3]]}
    assert read_json(run / "status.json")["step"] == 6


def test_state_a_resume_could_not_load_is_refused_at_the_first_save_naming_its_owner(user):
    r = _launch(user, "BadCallback")
    assert r.returncode == 2, describe(r)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, describe(r)
    assert "callback 0:loadpkg.parts.BadCallback: state_dict()['handle'] is a loadpkg.parts.Holder" in errors[0]
    assert "add_safe_globals([Holder])" in errors[0] and "Traceback" not in r.stderr
    run = user / "exp" / "default" / "r"
    model = run / "model"
    assert not list(model.iterdir()) if model.exists() else True  # no checkpoint, no last.tmp
    assert read_json(run / "status.json")["state"] == "failed"
    assert "state_dict()['handle']" in (run / "train.log").read_text()


# ---------------------------------------------------------------- the config's settings take effect
def _api_run(tmp_path: Path, *overrides: str, resume: bool = False):
    import logging

    from pimm_core import Trainer, load_config
    from _helpers import DIGITS

    logger = logging.getLogger("pimm")
    before, level = list(logger.handlers), logger.level
    logger.setLevel(logging.INFO)
    try:
        cfg = load_config(DIGITS, ["train.epochs=1", "eval.every_epochs=0", "optimizer.name=AdamW",
                                   "scheduler.name=cosine", "train.log_every_steps=1", *overrides])
        tr = Trainer(cfg, run_dir=tmp_path / "r")
        tr.train(checkpoint_dir=tmp_path / "r" / "model", resume_from=tmp_path / "r" / "model" if resume else None)
        return tr
    finally:
        for h in [h for h in logger.handlers if h not in before]:
            logger.removeHandler(h)
            h.close()
        logger.setLevel(level)


def test_every_optimizer_and_schedule_setting_the_diff_reports_takes_effect_on_resume(tmp_path):
    from pimm_core.run.topology import config_diff

    first = _api_run(tmp_path, "train.max_steps=3")
    saved = [dict(g) for g in first.optimizer.param_groups]
    assert saved[0]["weight_decay"] == 0.01 and saved[1]["weight_decay"] == 0.0  # [optimizer]: decay and no-decay groups
    changes = ["train.max_steps=4", "optimizer.args.betas=[0.8, 0.95]", "optimizer.args.eps=1e-6",
               "train.weight_decay=0.05", "scheduler.name=linear"]
    second = _api_run(tmp_path, *changes, resume=True)
    groups = second.optimizer.param_groups
    assert [tuple(g["betas"]) for g in groups] == [(0.8, 0.95), (0.8, 0.95)] and [g["eps"] for g in groups] == [1e-6] * 2
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]  # each group its own: the no-decay group stays 0
    assert second.scheduler.kind == "linear"
    entry = read_json(tmp_path / "r" / "provenance.json")["starts"][-1]
    assert "optimizer param_groups[0].weight_decay changed 0.01 -> 0.05 on resume (this config's value): applied " \
           "from step 3" in entry["schedule"]
    assert "optimizer param_groups[1].eps changed 1e-08 -> 1e-06 on resume (this config's value): applied from " \
           "step 3" in entry["schedule"]
    assert "scheduler.name changed 'cosine' -> 'linear' on resume: applied from step 3" in entry["schedule"]
    log = (tmp_path / "r" / "train.log").read_text()
    assert "param_groups[1].betas changed (0.9, 0.999) -> (0.8, 0.95)" in log
    # a resume with the config unchanged keeps the saved values (a callback's change included) and says nothing
    third = _api_run(tmp_path, *changes[1:], "train.max_steps=5", resume=True)
    assert [g["weight_decay"] for g in third.optimizer.param_groups] == [0.05, 0.0]
    assert not [n for n in read_json(tmp_path / "r" / "provenance.json")["starts"][-1]["schedule"] if "param_groups" in n]
    # what cannot take effect says so in the diff itself
    line = config_diff({"scheduler": {"target": "torch.optim.lr_scheduler:StepLR", "args": {"step_size": 10}}},
                       {"scheduler": {"target": "torch.optim.lr_scheduler:StepLR", "args": {"step_size": 20}}})
    assert any(x.startswith("scheduler.args.step_size: 10 -> 20 (not applied on resume: a [scheduler] target's")
               for x in line), line
