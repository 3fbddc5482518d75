"""train/parallel.py: which modules train.blocks picks, activation checkpointing and
compile leave the parameter names alone, FSDP at one rank (a one-rank process group)
trains like the plain model, and the config refuses combinations that cannot work."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from pimm_core.process import dist
from pimm_core.config import load_config
from pimm_core.process.dist import DistInfo
from pimm_core.errors import ConfigError
from pimm_core.train.parallel import checkpoint_activations, find_blocks, is_fsdp, parallelize


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.relu(self.fc(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def pick_layers(model):  # a train.blocks target
    return list(model.layers)


def test_blocks_by_class_name_and_by_target():
    net = Net()
    assert find_blocks(net, ["Block"]) == list(net.layers)
    assert find_blocks(net, ["tests.unit.test_parallel:pick_layers", "Block"]) == list(net.layers)
    assert find_blocks(net, ["Linear"]) == [net.layers[0].fc, net.layers[1].fc, net.head]
    with pytest.raises(ConfigError, match="'Blok' matches no submodule.*'Block'"):
        find_blocks(net, ["Blok"])


def test_activation_checkpointing_keeps_names_and_gradients():
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    for block in b.layers:
        checkpoint_activations(block)
    assert list(a.state_dict()) == list(b.state_dict())
    x = torch.randn(4, 8)
    for net in (a, b):
        torch.manual_seed(1)  # the same dropout masks; checkpoint replays them in backward
        net(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))


def test_fsdp_at_one_rank_trains_like_the_plain_model():
    cfg = load_config(None, ["train.strategy=fsdp", 'train.blocks=["Block"]', "train.device=cpu"])
    torch.manual_seed(0)
    plain, sharded = Net(), Net()
    sharded.load_state_dict(plain.state_dict())
    dist.init(torch.device("cpu"), DistInfo(), always=True)
    try:
        model = parallelize(sharded, cfg, DistInfo(), torch.device("cpu"))
        assert model is sharded and is_fsdp(model) and not is_fsdp(plain)
        assert list(model.state_dict()) == list(plain.state_dict())  # no wrapper prefixes
        x = torch.randn(4, 8)
        for net in (plain, model):
            opt = torch.optim.AdamW(net.parameters(), lr=0.1)
            torch.manual_seed(1)
            net(x).square().mean().backward()
            opt.step()
        for (name, p), q in zip(plain.named_parameters(), model.parameters()):
            assert torch.equal(p.detach(), q.detach().full_tensor()), name
    finally:
        dist.shutdown()


@pytest.mark.parametrize("overrides,message", [
    (["train.strategy=fsdp", "checkpoint_format=legacy"], "cannot hold FSDP's sharded state; use checkpoint_format = 'standard'"),
    (["train.strategy=fsdp", "checkpoint_format=single"], "cannot hold FSDP's sharded state"),
    (["train.activation_checkpointing=true"], "needs train.blocks"),
    (["train.strategy=fsdp", "train.amp=fp16"], "use train.amp = 'bf16' or fsdp.param_dtype = 'bfloat16'"),
    (["train.blocks=[3]"], "must be a list of non-empty strings"),
    (["fsdp.param_dtype=float64"], "is not allowed"),
])
def test_config_refuses_what_cannot_work(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


@pytest.mark.parametrize("options", [["fsdp.param_dtype=bfloat16", "fsdp.reduce_dtype=float32"],
                                     ["fsdp.cpu_offload=true"], ["fsdp.reshard_after_forward=false"]])
def test_fsdp_options_take_effect(options):
    """The [fsdp] table reaches fully_shard: bf16 compute with fp32 shards; CPU offload and
    ZeRO-2-like resharding train (on this CPU-only machine offload moves nothing)."""
    cfg = load_config(None, ["train.strategy=fsdp", 'train.blocks=["Block"]', *options])
    torch.manual_seed(0)
    net = Net()
    dist.init(torch.device("cpu"), DistInfo(), always=True)
    try:
        model = parallelize(net, cfg, DistInfo(), torch.device("cpu"))
        seen = []
        model.layers[0].fc.register_forward_hook(lambda m, i, o: seen.append((m.weight.dtype, o.dtype)))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        model(torch.randn(4, 8)).float().square().mean().backward()
        opt.step()
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the shards stay fp32
        assert all(not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, model.parameters()))
        compute = torch.bfloat16 if "fsdp.param_dtype=bfloat16" in options else torch.float32
        assert seen == [(compute, compute)]
    finally:
        dist.shutdown()


def junk_none(model):  # train.blocks targets that return something else
    return None


def junk_int(model):
    return 5


def the_root(model):
    return [model]


@pytest.mark.parametrize("target,message", [
    ("junk_none", "returned NoneType, not a list of modules"),
    ("junk_int", "returned int, not a list of modules"),
    ("the_root", "returned the model itself"),
])
def test_a_blocks_target_returning_junk_is_one_config_error(target, message):
    with pytest.raises(ConfigError, match=message) as e:
        find_blocks(Net(), [f"tests.unit.test_parallel:{target}"])
    assert "\n" not in str(e.value) and "list(model.layers)" in str(e.value)


class Tied(Net):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.layers[1].fc.weight = self.proj.weight  # tied across a block and the root

    def forward(self, x):
        return super().forward(self.proj(x))


def _fsdp_trains_like_plain(blocks: list[str], make=Net) -> None:
    cfg = load_config(None, ["train.strategy=fsdp", f"train.blocks={blocks!r}".replace("'", '"')])
    torch.manual_seed(0)
    plain, sharded = make(), make()
    sharded.load_state_dict(plain.state_dict())
    dist.init(torch.device("cpu"), DistInfo(), always=True)
    try:
        model = parallelize(sharded, cfg, DistInfo(), torch.device("cpu"))
        x = torch.randn(4, 8)
        for net in (plain, model):
            opt = torch.optim.AdamW(net.parameters(), lr=0.1)
            torch.manual_seed(1)
            net(x).square().mean().backward()
            opt.step()
        for (name, p), q in zip(plain.named_parameters(), model.parameters()):
            assert torch.equal(p.detach(), q.detach().full_tensor()), name
    finally:
        dist.shutdown()


def test_nested_blocks_shard_inner_units_first():
    """A block inside another block (["Block", "Linear"]: each Block holds a Linear) is
    sharded before its parent, as FSDP2 needs; it trains like the plain model."""
    net = Net()
    assert find_blocks(net, ["Block", "Linear"]) == [net.layers[0].fc, net.layers[0], net.layers[1].fc,
                                                      net.layers[1], net.head]
    _fsdp_trains_like_plain(["Block", "Linear"])


def test_blocks_splitting_a_tied_parameter_are_one_config_error():
    with pytest.raises(ConfigError, match=r"'layers.1.fc.weight' is tied to 'proj.weight'.*different FSDP units"):
        _fsdp_trains_like_plain(["Block"], Tied)
    _fsdp_trains_like_plain(["Linear"], Net)  # no tie: every Linear its own unit


@pytest.mark.parametrize("weights", ["raw", "ema"])
def test_evaluation_leaves_every_fsdp_unit_sharded_with_the_raw_weights(weights):
    """An evaluation is a forward without a backward: a unit that does not reshard after
    forward (the root, when train.blocks is set) kept its gathered parameters, so the save
    after it failed (get_optimizer_state_dict: KeyError) and, with eval.weights = "ema",
    the next training forward used the EMA's values instead of the raw weights."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from pimm_core.train.ema import EMA
    from pimm_core.train.evaluator import Evaluator

    cfg = load_config(None, ["train.strategy=fsdp", 'train.blocks=["Block"]'])
    torch.manual_seed(0)
    plain, net = Net(), Net()
    net.load_state_dict(plain.state_dict())
    dist.init(torch.device("cpu"), DistInfo(), always=True)
    try:
        model = parallelize(net, cfg, DistInfo(), torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        ema = EMA(model, decay=0.9)
        for t in ema.shadow.values():
            t.add_(1.0)  # the average differs from the raw weights
        batch = (torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))
        Evaluator([batch], torch.device("cpu"), contextlib.nullcontext, weights=weights).evaluate(model, ema)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        get_optimizer_state_dict(model, opt)
        x = torch.randn(4, 8)
        model.eval(), plain.eval()
        assert torch.allclose(model(x), plain(x), atol=1e-6)
    finally:
        dist.shutdown()


def test_fsdp_reduces_gradients_once_per_accumulation_window(monkeypatch):
    """Inside a window the micro-batches' gradients accumulate unsharded; the reduce-scatter
    runs once per FSDP unit at the window's last micro-batch, and the result equals the
    plain model's accumulated gradients."""
    from pimm_core.train.step import gradient_sync

    cfg = load_config(None, ["train.strategy=fsdp", 'train.blocks=["Block"]'])
    torch.manual_seed(0)
    plain, sharded = Net(), Net()
    sharded.load_state_dict(plain.state_dict())
    plain.eval(), sharded.eval()  # no dropout: the two models see the same function
    dist.init(torch.device("cpu"), DistInfo(), always=True)
    try:
        model = parallelize(sharded, cfg, DistInfo(), torch.device("cpu"))
        # FSDP2's gradient reduction of one unit (the reduce-scatter; at one rank it moves nothing)
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group

        calls = []
        real = _fsdp_param_group.foreach_reduce
        monkeypatch.setattr(_fsdp_param_group, "foreach_reduce", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
        batches = [torch.randn(4, 8) for _ in range(3)]
        per_batch = []
        for i, x in enumerate(batches):
            with gradient_sync(model, i == len(batches) - 1):
                model(x).square().mean().backward()
            per_batch.append(len(calls))
            plain(x).square().mean().backward()
        assert per_batch == [0, 0, 3]  # 2 blocks + the root, once, at the window's end
        for (name, p), q in zip(plain.named_parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad.full_tensor(), msg=name)
    finally:
        dist.shutdown()
