"""Optimizers and LR schedules from the config: parameter groups, every torch.optim class by
name, user targets, each schedule kind's curve, and an exact resume of every schedule."""

from __future__ import annotations

import copy
import sys
import uuid

import pytest
import torch
from torch import nn

from pimm_core.config import SCHEDULER_KINDS, load_config
from pimm_core.errors import ConfigError
from pimm_core.optim import build_optimizer, build_scheduler, observe_metric, param_groups
from pimm_core.train.schedule import WarmupCosine, WarmupSchedule


class TiedNet(nn.Module):
    """Embedding tied to the output head, a norm, a BatchNorm, a frozen layer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.bn = nn.BatchNorm1d(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, t):
        return self.head(self.bn(self.norm(self.body(self.emb(t)))))


def cfg(*overrides: str):
    return load_config(None, ["train.lr=1.0", "train.weight_decay=0.1", *overrides])


# ------------------------------------------------------------------ optimizers
def test_default_groups_exempt_biases_and_norm_weights_and_count_tied_once():
    m = TiedNet()
    decay, no_decay = param_groups(m, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(decay["params"]) == ids([m.emb.weight, m.body.weight])  # head.weight is emb.weight
    assert ids(no_decay["params"]) == ids([m.body.bias, m.norm.weight, m.norm.bias, m.bn.weight, m.bn.bias])
    (one,) = param_groups(m, 0.1, decay_bias_and_norm=True)
    assert len(one["params"]) == 7 and one["weight_decay"] == 0.1


def test_legacy_keys_build_the_same_single_group_optimizer_as_before():
    m = TiedNet()
    opt = build_optimizer(cfg(), m)
    assert type(opt) is torch.optim.AdamW and len(opt.param_groups) == 1
    assert opt.param_groups[0]["params"] == list(m.parameters()) and opt.param_groups[0]["weight_decay"] == 0.1
    sgd = build_optimizer(cfg('train.optimizer="sgd"', "train.momentum=0.5"), m)
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["momentum"] == 0.5


def test_any_torch_optimizer_by_name_with_its_arguments():
    m = TiedNet()
    opt = build_optimizer(cfg('optimizer.name="adamw"', "optimizer.args.betas=[0.8, 0.9]"), m)
    assert type(opt) is torch.optim.AdamW and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert tuple(opt.param_groups[0]["betas"]) == (0.8, 0.9) and opt.param_groups[0]["lr"] == 1.0
    rms = build_optimizer(cfg('optimizer.name="RMSprop"', "optimizer.args.alpha=0.9"), m)
    assert type(rms) is torch.optim.RMSprop
    rprop = build_optimizer(cfg('optimizer.name="Rprop"'), m)  # takes no weight_decay: one group
    assert len(rprop.param_groups) == 1 and "weight_decay" not in rprop.param_groups[0]


@pytest.mark.parametrize("overrides,message", [
    (['optimizer.name="Adamx"'], "optimizer.name = 'Adamx' is not a torch.optim optimizer; did you mean 'Adamax'?"),
    (['optimizer.name="adamw"', "optimizer.args.beta=[0.9, 0.9]"],
     "optimizer.args.beta: adamw has no parameter 'beta'; did you mean 'betas'?"),
])
def test_optimizer_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        build_optimizer(cfg(*overrides), TiedNet())
    assert str(e.value).startswith(message)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"uopt{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n"
        "def make(params, lr, eps=1e-8):\n    return torch.optim.Adam(params, lr=lr, eps=eps)\n"
        "def no_lr(params):\n    return torch.optim.Adam(params)\n"
        "def wrong(params, lr):\n    return 'not an optimizer'\n"
        "def sched(optimizer, total_steps, warmup_steps, floor=0.0):\n"
        "    f = lambda s: max(floor, min(1.0, (s + 1) / max(1, warmup_steps)) * (1 - s / total_steps))\n"
        "    return torch.optim.lr_scheduler.LambdaLR(optimizer, f)\n"
        "def sched_no_warmup(optimizer, gamma):\n    return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name
    sys.modules.pop(name, None)


def test_optimizer_target(user_module):
    opt = build_optimizer(cfg(f'optimizer.target="{user_module}:make"', "optimizer.args.eps=0.5"), TiedNet())
    assert type(opt) is torch.optim.Adam and opt.param_groups[0]["eps"] == 0.5 and len(opt.param_groups) == 2
    with pytest.raises(ConfigError, match=f'optimizer.target = "{user_module}:no_lr": takes no \'lr\''):
        build_optimizer(cfg(f'optimizer.target="{user_module}:no_lr"'), TiedNet())
    with pytest.raises(ConfigError, match="returned str, not a torch.optim.Optimizer"):
        build_optimizer(cfg(f'optimizer.target="{user_module}:wrong"'), TiedNet())


# ------------------------------------------------------------------ schedule curves
def lrs_of(sch, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(sch.get_last_lr()[0])
        sch.optimizer.step()
        sch.step()
    return out


def make(overrides=(), total=20, kind_overrides=()):
    c = cfg(*overrides, *kind_overrides)
    opt = build_optimizer(c, nn.Linear(2, 2))
    return build_scheduler(c, opt, total), opt


def test_step_multistep_exponential_curves_count_steps_after_warmup():
    w = ["train.warmup_steps=2"]
    step, _ = make(w + ['scheduler.name="step"', "scheduler.args.step_size=3", "scheduler.args.gamma=0.5"])
    assert lrs_of(step, 9) == [0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25]
    multi, _ = make(w + ['scheduler.name="multistep"', "scheduler.args.milestones=[1, 4]"])
    assert lrs_of(multi, 8) == pytest.approx([0.5, 1.0, 1.0, 0.1, 0.1, 0.1, 0.01, 0.01])
    expo, _ = make(["train.min_lr=0.3", 'scheduler.name="exponential"', "scheduler.args.gamma=0.5"])
    assert lrs_of(expo, 4) == [1.0, 0.5, 0.3, 0.3]  # floored at train.min_lr


def test_linear_and_onecycle_reach_their_ends_at_the_horizon():
    lin, _ = make(["train.min_lr=0.1", 'scheduler.name="linear"'], total=10)
    assert lrs_of(lin, 11) == pytest.approx([1 - 0.09 * k for k in range(11)])
    one, _ = make(['scheduler.name="onecycle"', "scheduler.args.pct_start=0.25"], total=20)
    lrs = lrs_of(one, 21)
    assert lrs[0] == pytest.approx(1 / 25) and max(lrs) == pytest.approx(1.0) and lrs.index(max(lrs)) == 5
    assert lrs[-1] == pytest.approx(1 / 25 / 1e4)
    s = one  # a resume that changes the horizon keeps the LR and still ends at the floor
    before = s.factor(12)
    s.retarget(12, 40)
    assert s.factor(12) == pytest.approx(before) and s.factor(40) == pytest.approx(1 / 25 / 1e4)


def test_plateau_lowers_the_lr_after_patience_bad_evaluations():
    sch, opt = make(["train.min_lr=0.005", 'scheduler.name="plateau"', "scheduler.args.patience=1",
                     "scheduler.args.cooldown=1", 'eval.mode="min"', 'eval.metric="val/loss"'])
    assert isinstance(sch, WarmupSchedule)
    seen = [observe_metric(sch, v) for v in (1.0, 0.9, 0.95, 0.96, 0.97, 0.98, 0.99, 1.0, 1.1, 1.2)]
    assert seen == [False, False, False, True, False, False, True, False, False, True]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.005)  # 1 -> 0.1 -> 0.01 -> floor, applied at once
    assert not observe_metric(make(['scheduler.name="cosine"'])[0], 0.5)


@pytest.mark.parametrize("overrides,message", [
    (['scheduler.name="step"', "scheduler.args.step_sise=3"],
     "scheduler.args.step_sise: step has no parameter 'step_sise'; did you mean 'step_size'?"),
    (['scheduler.name="step"'], "scheduler.args: step needs 'step_size'; set scheduler.args.step_size"),
    (['scheduler.name="step"', "scheduler.args.step_size=2", "scheduler.args.gamma=2"],
     "scheduler.args.gamma = 2: must be a number in (0, 1]"),
    (['scheduler.name="multistep"', "scheduler.args.milestones=[5, 2]"],
     "scheduler.args.milestones = [5, 2]: must be a list of ascending integers >= 0"),
    (['scheduler.name="plateau"', 'scheduler.args.threshold_mode="relative"'],
     "scheduler.args.threshold_mode = 'relative': must be 'rel' or 'abs'"),
    (['scheduler.name="cosine"', "scheduler.args.x=1"], "scheduler.args.x: cosine has no parameter 'x'"),
])
def test_scheduler_option_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        make(overrides)
    assert str(e.value).startswith(message) and e.value.exit_code == 2


def test_scheduler_target_gets_the_horizon_and_warmup(user_module):
    sch, _ = make(["train.warmup_steps=2", f'scheduler.target="{user_module}:sched"'], total=10)
    assert lrs_of(sch, 4) == pytest.approx([0.5, 0.9, 0.8, 0.7])
    with pytest.raises(ConfigError, match="takes no warmup_steps; set train.warmup_steps = 0"):
        make(["train.warmup_steps=2", f'scheduler.target="{user_module}:sched_no_warmup"', "scheduler.args.gamma=0.5"])
    sch, _ = make([f'scheduler.target="{user_module}:sched_no_warmup"', "scheduler.args.gamma=0.5"])
    assert lrs_of(sch, 3) == [1.0, 0.5, 0.25]


# ------------------------------------------------------------------ exact resume
KIND_ARGS = {
    "constant": [], "cosine": [], "linear": [], "onecycle": ["scheduler.args.pct_start=0.2"],
    "step": ["scheduler.args.step_size=4"], "multistep": ["scheduler.args.milestones=[3, 9, 15]"],
    "exponential": ["scheduler.args.gamma=0.9"],
    "plateau": ["scheduler.args.patience=1", "scheduler.args.factor=0.5", "scheduler.args.cooldown=1"],
}
CASES = [[f'scheduler.name="{k}"', *KIND_ARGS[k], *([] if k == "onecycle" else ["train.warmup_steps=3"])]
         for k in SCHEDULER_KINDS]
CASES += [['train.scheduler="cosine"', "train.warmup_steps=3"], ['train.scheduler="constant"', "train.warmup_steps=3"],
          ['scheduler.target="torch.optim.lr_scheduler:StepLR"', "scheduler.args.step_size=5"]]


def run(sch, opt, steps: range, metrics: list[float]) -> list[float]:
    """Steps with an evaluation (the selection metric observed) every 4 steps."""
    lrs = []
    for s in steps:
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sch.step()
        if (s + 1) % 4 == 0:
            observe_metric(sch, metrics[s // 4])
    return lrs


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: o[0].split("=")[1].strip('"'))
def test_every_schedule_resumes_exactly(overrides):
    metrics = [1.0, 0.8, 0.85, 0.9, 0.7, 0.75, 0.8, 0.9, 1.0]
    c = cfg('eval.metric="val/loss"', 'eval.mode="min"', *overrides)
    model = nn.Linear(2, 2)
    opt = build_optimizer(c, model)
    sch = build_scheduler(c, opt, 30)
    first = run(sch, opt, range(13), metrics)
    saved_opt, saved_sch = copy.deepcopy(opt.state_dict()), copy.deepcopy(sch.state_dict())
    straight = run(sch, opt, range(13, 30), metrics)

    opt2 = build_optimizer(c, nn.Linear(2, 2))
    sch2 = build_scheduler(c, opt2, 30)
    opt2.load_state_dict(saved_opt)
    sch2.load_state_dict(saved_sch)
    if isinstance(sch2, WarmupCosine):
        sch2.set_step(13)  # as the trainer's resume does
    resumed = run(sch2, opt2, range(13, 30), metrics)
    assert resumed == straight  # bitwise
    assert len(set(first + straight)) > 1 or "constant" in overrides[0]


# ------------------------------------------------------------------ the pre-launch check
CHECK_CASES = [  # (keys taken out of the good config, overrides added, how the error starts)
    (["model.args.width"], ["model.args.widht=3"], "model.args.widht: "),
    (["data.target"], ['data.target="{parts}:dta"'], 'data.target = "{parts}:dta": '),
    (["objective"], ['objective="{parts}:stpe"'], 'objective = "{parts}:stpe": '),
    (["optimizer.target"], ['optimizer.target="nope.mod:x"'], 'optimizer.target = "nope.mod:x": module'),
    ([], ["scheduler.args.gamma=5"], "scheduler.args.gamma = 5: "),
    (["model.target", "model.args.width"], ['model.name="vit"'], "model.name = 'vit' is not a known model"),
]


@pytest.mark.parametrize("drop,add,start", CHECK_CASES)
def test_check_targets_finds_each_wrong_key_without_building(user_module, tmp_path, drop, add, start):
    """``check_targets`` reports what the launch would, and builds nothing (targets that
    raise when called are only resolved)."""
    from pimm_core.train.plugins import check_targets

    parts = f"{user_module}_parts"
    (tmp_path / f"{parts}.py").write_text(
        "def model(width):\n    raise AssertionError('built')\n"
        "def data():\n    raise AssertionError('built')\n"
        "def step(model, batch):\n    raise AssertionError('ran')\n")
    good = {"model.target": f'"{parts}:model"', "model.args.width": "3", "data.target": f'"{parts}:data"',
            "objective": f'"{parts}:step"', "eval.metric": '"val/x"', "optimizer.target": f'"{user_module}:make"',
            "scheduler.name": '"step"', "scheduler.args.step_size": "2"}
    try:
        check_targets(cfg(*[f"{k}={v}" for k, v in good.items()]))
        overrides = [f"{k}={v}" for k, v in good.items() if k not in drop] + [a.format(parts=parts) for a in add]
        with pytest.raises(ConfigError) as e:
            check_targets(cfg(*overrides))
        assert str(e.value).startswith(start.format(parts=parts))
    finally:
        sys.modules.pop(parts, None)


def test_check_targets_passes_the_builtin_config():
    from pimm_core.train.plugins import check_targets

    check_targets(cfg())
