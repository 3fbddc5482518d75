"""One rank of the sharded-checkpoint tests (``test_sharded_checkpoint.py``).

Run as ``python -m torch.distributed.run --standalone --nproc-per-node N _sharded_worker.py MODE ROOT``
(or plainly, for one rank: a gloo process group of size 1 over a ``HashStore``, as the trainer
makes for FSDP at world size 1). Each rank builds the same tiny model (blocks sharded with
``fully_shard``, a BatchNorm buffer, two tied projections), trains a few AdamW steps with an
EMA, and saves or loads standard checkpoints under ROOT through pimm's checkpoint layer.

Every save also writes ``ROOT/<name>.ref.pt`` (rank 0): the full model, optimizer (FQN-keyed)
and EMA state it saved, gathered; every load compares what it restored with that, bitwise.
A failed check raises (non-zero exit); rank 0 prints ``ok <check>`` for each passed one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from pimm_core.checkpoint.formats.async_save import AsyncStandardFormat
from pimm_core.checkpoint.export.model_dir import export
from pimm_core.checkpoint.formats.protocol import SaveItem
from pimm_core.checkpoint.formats.sharded import read_checkpoint_weights
from pimm_core.checkpoint.formats.standard import StandardFormat, load_standard, save_standard
from pimm_core.checkpoint.tensors.state import full_state_dict, full_tensors, is_sharded
from pimm_core.checkpoint.weights.warm_start import warm_start
from pimm_core.checkpoint.weights.read import read_weight_sets
from pimm_core.process.dist import DistInfo
from pimm_core.errors import CheckpointError
from pimm_core.train.ema import EMA


class Net(nn.Module):
    """Uneven sizes (10 and 5 rows over 2 or 3 ranks), a BatchNorm buffer, a tied pair."""

    def __init__(self, out: int = 5):
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.bn = nn.BatchNorm1d(10)
        self.mid = nn.Linear(10, 10)
        self.proj1 = nn.Linear(10, 10, bias=False)
        self.proj2 = nn.Linear(10, 10, bias=False)
        self.proj2.weight = self.proj1.weight
        self.out = nn.Linear(10, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.inp(x)))
        return self.out(self.proj2(torch.tanh(self.proj1(self.mid(h)))))


def build(sharded: bool, seed: int = 0, out: int = 5) -> tuple[nn.Module, torch.optim.Optimizer, EMA]:
    torch.manual_seed(seed)
    model = Net(out)
    if sharded:
        for block in (model.inp, model.mid, model.out):
            fully_shard(block)
        fully_shard(model)  # the rest (bn, the tied pair) with the root
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, EMA(model, decay=0.9)


def train(model: nn.Module, opt: torch.optim.Optimizer, ema: EMA, steps: int = 3, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update(model)


def snapshot(model: nn.Module, opt: torch.optim.Optimizer, ema: EMA) -> dict | None:
    """Full model, optimizer and EMA-parameter state on rank 0 (collective when sharded)."""
    sd = {k: v.clone() for k, v in full_state_dict(model).items()}
    if is_sharded(model):
        osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        osd = get_optimizer_state_dict(model, opt)
    shadow = full_tensors(ema.shadow)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return {"model": sd, "optim": osd, "ema": {k: v.clone() for k, v in shadow.items()}}


def same(a, b, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), what
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{what}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            same(a[k], b[k], f"{what}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{what}/{i}")
    else:
        assert a == b, f"{what}: {a!r} vs {b!r}"


def info() -> DistInfo:
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))


def ok(msg: str) -> None:
    if info().is_main:
        print(f"ok {msg}", flush=True)


def save(root: Path, name: str, sharded: bool, *, gather: bool = True, background: bool = False) -> None:
    model, opt, ema = build(sharded)
    train(model, opt, ema)
    meta = {"trainer": {"global_step": 3, "epoch": 0, "iter": 3}, "scheduler": {}, "scaler": None,
            "world_size": info().world_size, "workers_per_rank": 0, "ema": ema.state_dict()}
    item = SaveItem(model=model, optimizer=opt, meta=meta, rank_state={"rank": info().rank},
                    manifest={"step": 3, "epoch": 0, "iter": 3}, step=3,
                    ema_weights=lambda: ema.state_dict_for(model), gather_weights=gather)
    if background:
        fmt = AsyncStandardFormat(StandardFormat(info()))
        fmt.save(root / name, item, background=True)
        fmt.wait_staged()
        train(model, opt, ema, steps=1, seed=7)  # changes after staging must not reach the files
        fmt.wait()
        model, opt, ema = build(sharded)
        train(model, opt, ema)  # the saved state again, for the reference
    else:
        StandardFormat(info()).save(root / name, item)
    ref = snapshot(model, opt, ema)
    if ref is not None:
        torch.save(ref, root / f"{name}.ref.pt")
    ok(f"save {name}")


def load(root: Path, name: str, sharded: bool) -> None:
    """Load ``name`` into a fresh model (another seed) and compare with its reference."""
    model, opt, ema = build(sharded, seed=5)
    # (a plain model is given no EMA target: the EMA weights come back as full tensors)
    loaded = load_standard(root / name / "last", model=model, optimizer=opt, info=info(),
                           ema_target=ema.shadow if sharded else None)
    assert loaded.rank_state == ({"rank": info().rank} if info().rank < len(loaded.saved_ranks) else None)
    ema.load(loaded.ema_state_dict, loaded.meta["ema"]["updates"])
    got = snapshot(model, opt, ema)
    if got is not None:
        ref = torch.load(root / f"{name}.ref.pt", weights_only=True)
        same(ref, got, name)
    ok(f"load {name} into {'sharded' if sharded else 'plain'} x{info().world_size}")


def read_back(root: Path, name: str) -> None:
    """Rank 0, no process group used: the weights of a save without weights.pth."""
    ckpt = root / name / "last"
    assert not (ckpt / "weights.pth").exists()
    ref = torch.load(root / f"{name}.ref.pt", weights_only=True)
    weights = read_checkpoint_weights(ckpt)
    same(ref["model"], weights["state_dict"], "read_checkpoint_weights")
    assert weights["state_dict"]["proj2.weight"] is weights["state_dict"]["proj1.weight"]  # tie kept
    same(ref["ema"], {k: weights["ema_state_dict"][k] for k in ref["ema"]}, "read ema")
    out = export(ckpt, root / f"{name}.export")
    same(ref["model"], read_weight_sets(out / "model.safetensors")["raw"], "export")
    plain, _, _ = build(False, seed=9)
    warm_start(plain, ckpt)
    same(ref["model"], plain.state_dict(), "warm start")
    print(f"ok read {name}", flush=True)


def main() -> None:
    run(sys.argv[1], Path(sys.argv[2]))


def run(mode: str, root: Path) -> None:
    """Run the comma-separated steps of ``mode`` on ``root``: under torchrun (``RANK`` set) in its
    process group, else in a process group of one made here (also in the test's own process: the
    group is destroyed at the end, the ``ok`` lines go to stdout)."""
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    try:
        _steps(mode, root)
    finally:
        dist.destroy_process_group()


def _steps(mode: str, root: Path) -> None:
    for step in mode.split(","):
        action, _, arg = step.partition(":")
        if action == "save":  # save:NAME:fsdp|plain[:nogather][:async]
            name, kind, *flags = arg.split(":")
            save(root, name, kind == "fsdp", gather="nogather" not in flags, background="async" in flags)
        elif action == "load":  # load:NAME:fsdp|plain
            name, kind = arg.split(":")
            load(root, name, kind == "fsdp")
        elif action == "read" and info().is_main:  # read:NAME
            read_back(root, arg)
        elif action == "bad":  # bad:NAME: a sharded model of another shape is refused, naming the tensors
            model, opt, ema = build(True, out=4)
            try:
                load_standard(root / arg / "last", model=model, optimizer=opt, info=info(), ema_target=ema.shadow)
            except CheckpointError as e:
                assert "shape mismatch (saved vs now): out.bias (5,) vs (4,), out.weight (5, 10) vs (4, 10)" in str(e), e
                ok(f"refused {arg}")
            else:
                raise AssertionError("a model of another shape loaded")
        elif action == "warm":  # warm:NAME (every rank, into a sharded model)
            model, _, _ = build(True, seed=9)
            warm_start(model, root / arg / "last")
            got = {k: v.clone() for k, v in full_state_dict(model).items()}
            if info().is_main:
                same(torch.load(root / f"{arg}.ref.pt", weights_only=True)["model"], got, "warm start sharded")
            ok(f"warm {arg} into sharded x{info().world_size}")
        dist.barrier()


if __name__ == "__main__":
    main()
