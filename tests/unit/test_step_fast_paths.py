"""The small-model step's fast paths give the bits of the general ones: the lean gradient norm and
clipping are torch's, the training loss of the built-in classification is its evaluation loss, the
host-side window average matches the device-side one, the EMA follows its parameters, and the
gradient norm is computed only on a step where something reads it (a record or clipping; an
``on_nonfinite`` policy that acts on a NaN/Inf gradient checks the other steps with one fused pass
that changes no bit)."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from pimm_core import Trainer, load_config
from pimm_core.config import TrainConfig
from pimm_core.errors import TrainingError
from pimm_core.train.ema import EMA
from pimm_core.objectives import BUILTIN, Objective, classification, classification_loss
from pimm_core.train.state import TrainState
from pimm_core.train.step import WindowStep, all_finite, clip_grad_norm, total_norm
from pimm_core.train.window_average import WindowAverage, WindowLoss


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))


def _with_grads(scale: float) -> nn.Module:
    net = _net()
    torch.manual_seed(1)
    (net(torch.randn(9, 6) * scale) ** 2).sum().backward()
    return net


def test_total_norm_and_clipping_are_torch_bit_for_bit():
    for scale in (1e-3, 1.0, 1e3):
        net = _with_grads(scale)
        grads = [p.grad for p in net.parameters()]
        assert torch.equal(total_norm(grads), torch.nn.utils.get_total_norm(grads))
        for max_norm in (1e-3, 1.0, 1e9):
            ours, theirs = copy.deepcopy(net), copy.deepcopy(net)
            for a, b, p in zip(ours.parameters(), theirs.parameters(), net.parameters()):
                a.grad, b.grad = p.grad.clone(), p.grad.clone()
            assert torch.equal(clip_grad_norm(list(ours.parameters()), max_norm),
                               torch.nn.utils.clip_grad_norm_(list(theirs.parameters()), max_norm))
            assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_fused_finite_check_finds_nan_and_inf_and_changes_no_bit(dtype):
    info = torch.finfo(dtype)
    special = torch.tensor([0.0, -0.0, info.tiny / 4, -info.tiny / 4, info.max, -info.max], dtype=dtype)
    torch.manual_seed(0)
    # (small and large tensors: the kernel's scalar and vectorised paths)
    grads = [special, torch.cat([special.repeat(100), torch.randn(1003).to(dtype)]), torch.randn(4, 3).to(dtype)]
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[special.element_size()]
    before = [g.clone() for g in grads]
    assert all_finite(grads) is True
    assert all(torch.equal(a.view(bits), b.view(bits)) for a, b in zip(grads, before))
    for where, bad in ((2, float("nan")), (1, float("inf")), (2, -float("inf"))):
        grads[where].view(-1)[-1] = bad
        before = [g.clone() for g in grads]
        assert all_finite(grads) is False
        assert all(torch.equal(a.view(bits), b.view(bits)) for a, b in zip(grads, before))  # (NaN payloads too)
        assert all_finite([grads[0]]) is True  # (the flag is cleared between calls)
        grads[where].view(-1)[-1] = 0


def test_gradients_the_fused_check_cannot_take_go_the_norms_way():
    embedding = nn.Embedding(5, 4, sparse=True)
    embedding(torch.tensor([1, 2])).sum().backward()
    assert embedding.weight.grad.is_sparse
    cases = {"sparse": [embedding.weight.grad],
             "complex": [torch.ones(3, dtype=torch.complex64)],
             "an expanded view": [torch.ones(1).expand(4)],
             "mixed dtypes": [torch.ones(2, dtype=torch.bfloat16), torch.ones(2)],
             "none": []}
    for name, grads in cases.items():
        assert all_finite(grads) is None, name
    # and a real step with a sparse gradient trains under the default policy (the norm decides there)
    model = nn.Sequential(nn.Embedding(5, 4, sparse=True), nn.Flatten(), nn.Linear(8, 3))
    step = WindowStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", enabled=False),
                      None, TrainConfig(grad_clip=0.0, on_nonfinite="stop"), autocast=contextlib.nullcontext,
                      distributed=False, records_next=lambda: False)
    model(torch.tensor([[1, 2]])).sum().backward()
    assert step.finish() == "applied"


def test_mixed_dtypes_go_through_torch():
    grads = [torch.ones(3), torch.ones(2, dtype=torch.float64)]
    assert torch.equal(total_norm(grads), torch.nn.utils.get_total_norm(grads))


def test_the_training_loss_is_the_objectives_loss_without_its_metrics():
    net, x = _net(), torch.randn(5, 6)
    y = torch.tensor([0, 1, -100, 3, 2])
    (loss, n), metrics = classification(net, (x, y))
    total, count = classification_loss(net, (x, y))
    assert torch.equal(total, loss) and int(count) == int(n) == 4 and "acc" in metrics
    got = BUILTIN["classification"].loss(net, (x, y))
    assert torch.equal(got.value, loss) and int(got.count) == 4
    # a user objective's step is called once per training batch; its metrics are not read there
    calls = []

    def step(model, batch):
        calls.append(1)
        return F.cross_entropy(model(batch[0]), batch[1]), {"never_reduced": object()}
    y2 = torch.tensor([0, 1, 2, 3, 0])
    got = Objective("user", step).loss(net, (x, y2))
    assert torch.equal(got.value, F.cross_entropy(net(x), y2)) and got.count is None and calls == [1]


def test_host_window_average_gives_the_device_path_bits():
    """Windows of 4+3 and a 5 (counts not powers of two): the Python-float path of one process
    against the tensor path it replaces there (forced through ``host = False``)."""
    torch.manual_seed(2)
    x, y = torch.randn(12, 6), torch.randint(0, 4, (12,))
    batches = [(x[:4], y[:4]), (x[4:7], y[4:7]), (x[7:], y[7:])]
    nets = []
    for host in (True, False):
        net = _net()
        avg = WindowAverage(torch.device("cpu"), False)
        losses = []
        for window in (batches[:2], batches[2:]):
            for b in window:
                avg.host = host if host is False else None
                avg.to_backward(BUILTIN["classification"].loss(net, b), window_len=len(window)).backward()
            assert avg.host is host
            losses.append(avg.finish(net.parameters()))
        nets.append(([p.grad.clone() for p in net.parameters()], losses))
    (g1, l1), (g2, l2) = nets
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert all(torch.equal(a, b) and a.dtype == b.dtype == torch.float32 for a, b in zip(l1, l2))


def test_the_loss_read_when_a_record_needs_it_has_the_bits_of_the_eager_one():
    """The step's window loss is a WindowLoss (its float64 sum and division run when a record
    reads it): the same value as the tensor finish() returns, for (sum, count) and mean windows."""
    torch.manual_seed(2)
    x, y = torch.randn(12, 6), torch.randint(0, 4, (12,))
    windows = [[(x[:4], y[:4]), (x[4:7], y[4:7])], [(x[7:], y[7:])]]
    mean = Objective("mean", lambda m, b: (F.cross_entropy(m(b[0]), b[1]), {}))
    for objective in (BUILTIN["classification"], mean):
        for window in windows:
            got = []
            for lazy in (False, True):
                net, avg = _net(), WindowAverage(torch.device("cpu"), False)
                for b in window:
                    avg.to_backward(objective.loss(net, b), window_len=len(window)).backward()
                got.append(avg.finish(net.parameters(), lazy=lazy))
            eager, lazy_loss = got
            assert isinstance(lazy_loss, WindowLoss) and lazy_loss.tensor().dtype == torch.float32
            assert torch.equal(lazy_loss.tensor(), eager) and lazy_loss.item() == eager.item()


def test_ema_follows_the_parameters_it_was_made_from():
    net = _net()
    ema = EMA(net, 0.5, warmup=False)
    step = WindowStep(net, torch.optim.SGD(net.parameters(), lr=0.1), torch.amp.GradScaler("cpu", enabled=False),
                      ema, TrainConfig(grad_accum=1, grad_clip=None), autocast=contextlib.nullcontext,
                      distributed=False)
    torch.manual_seed(3)
    batches = [(torch.randn(4, 6), torch.randint(0, 4, (4,))) for _ in range(3)]
    expected = {n: p.detach().clone() for n, p in net.named_parameters()}
    for _ in step.windows(batches, TrainState(), len(batches), torch.device("cpu")):
        for n, p in net.named_parameters():
            expected[n] = 0.5 * expected[n] + 0.5 * p.detach()
    for n, avg in ema.shadow.items():
        assert torch.allclose(avg, expected[n], atol=1e-7, rtol=0)
    assert any(not torch.equal(avg, p) for avg, p in zip(ema.shadow.values(), net.parameters()))


# ----------------------------------------------------------------------------------------------
# The gradient norm is computed only where something reads it (WindowStep.norm_unread): a record or
# clipping. An on_nonfinite policy that acts on a NaN/Inf gradient ("stop", "skip") checks the
# other steps with one fused finiteness pass (step.all_finite); "continue" checks nothing.

DIGITS = Path(__file__).resolve().parents[2] / "configs" / "digits.toml"
STEPS, LOG_EVERY = 12, 5
RECORD_STEPS = [1, 5, 10, 12]  # every log_every_steps, step 1 and the run's last step
OTHER_STEPS = [s for s in range(1, STEPS + 1) if s not in RECORD_STEPS]


class NormsTaken(TorchFunctionMode):
    """The steps (the ``global_step`` being taken) of ``trainer`` at which torch computed a
    gradient norm (:attr:`steps`) and at which it ran the fused finiteness check (:attr:`checks`):
    every way to a norm in the step (the lean :func:`total_norm`, clipping, torch's
    ``get_total_norm``) starts with ``torch._foreach_norm``, the check is
    ``torch._amp_foreach_non_finite_check_and_unscale_``, and nothing else of these runs calls
    either. Observed as torch is called (a function mode), with nothing replaced."""

    def __init__(self, trainer: Trainer):
        super().__init__()
        self.trainer, self.steps, self.checks = trainer, [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._foreach_norm:
            self.steps.append(self.trainer.state.global_step + 1)
        elif func is torch._amp_foreach_non_finite_check_and_unscale_:
            self.checks.append(self.trainer.state.global_step + 1)
        return func(*args, **(kwargs or {}))


def _train(tmp_path: Path, name: str, *overrides: str, objective=None):
    cfg = load_config(DIGITS, ["train.epochs=1", f"train.max_steps={STEPS}", f"train.log_every_steps={LOG_EVERY}",
                               "train.warmup_steps=0", "data.num_workers=0", "train.device=cpu",
                               "eval.every_epochs=0", "checkpoint.every_epochs=0", "checkpoint.every_steps=0",
                               *overrides])
    torch.manual_seed(0)
    trainer = Trainer(cfg, run_dir=tmp_path / name, objective=objective)
    applied: list[int] = []  # optimizer steps applied, by the step being taken
    trainer.optimizer.register_step_post_hook(lambda *_: applied.append(trainer.state.global_step + 1))
    return trainer, applied


def _run_checked(trainer: Trainer) -> tuple[list[int], list[int]]:
    """Train; the steps at which a gradient norm was computed, and those at which the fused
    finiteness check ran (:class:`NormsTaken`)."""
    with NormsTaken(trainer) as norms:
        trainer.train()
    return norms.steps, norms.checks


def _train_records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def test_without_a_reader_the_norm_is_computed_only_at_record_steps_and_training_is_unchanged(tmp_path):
    """No clipping: only a record reads the norm. It is computed at those steps (and logged);
    ``"continue"`` checks nothing else, ``"stop"`` and ``"skip"`` run the fused finiteness check
    at every other step. The check changes no gradient: the weights and the logged norms and
    losses of the three are the same bits."""
    runs = {}
    for policy in ("continue", "stop", "skip"):
        trainer, _ = _train(tmp_path, policy, "train.grad_clip=0", f'train.on_nonfinite="{policy}"')
        norms, checks = _run_checked(trainer)
        assert norms == RECORD_STEPS, policy
        assert checks == ([] if policy == "continue" else OTHER_STEPS), policy
        records = _train_records(tmp_path / policy)
        assert [r["step"] for r in records] == RECORD_STEPS
        assert all(r["grad_norm"] > 0 for r in records), records
        runs[policy] = ([(r["step"], r["grad_norm"], r["loss"]) for r in records], trainer.model.state_dict())
    for policy in ("stop", "skip"):
        assert runs[policy][0] == runs["continue"][0]
        for a, b in zip(runs[policy][1].values(), runs["continue"][1].values()):
            assert torch.equal(a, b)


def test_clipping_reads_the_norm_every_step(tmp_path):
    trainer, _ = _train(tmp_path, "run", "train.grad_clip=1.0", 'train.on_nonfinite="continue"')
    assert _run_checked(trainer) == (list(range(1, STEPS + 1)), [])
    assert all(r["grad_norm"] > 0 for r in _train_records(tmp_path / "run"))


def _nan_at(step: int):
    """The built-in classification objective, whose loss is NaN at the ``step``-th call (one
    micro-batch per step: that optimizer step's gradient is NaN)."""
    calls = [0]

    def objective(model, batch):
        calls[0] += 1
        (total, count), metrics = classification(model, batch)
        return (total * float("nan") if calls[0] == step else total, count), metrics
    return objective


def test_on_nonfinite_still_acts_on_a_nan_gradient_at_a_step_that_writes_no_record(tmp_path):
    """Step 3 writes no record; its NaN gradient is still caught (by the fused check, no norm): "stop" stops before applying it,
    "skip" skips it and trains on, "continue" applies it and the run fails on its NaN weights."""
    assert 3 not in RECORD_STEPS
    stop, applied = _train(tmp_path, "stop", "train.grad_clip=0", 'train.on_nonfinite="stop"', objective=_nan_at(3))
    assert _run_checked(stop) == ([1], [2, 3]) and applied == [1, 2]  # (caught by the fused check)
    state = stop.state
    assert state.global_step == 2 and "non-finite" in state.stop_reason and not state.finished
    assert all(bool(torch.isfinite(p).all()) for p in stop.model.parameters())

    skip, applied = _train(tmp_path, "skip", "train.grad_clip=0", 'train.on_nonfinite="skip"', objective=_nan_at(3))
    assert _run_checked(skip) == (RECORD_STEPS, OTHER_STEPS)
    state = skip.state
    assert applied == [s for s in range(1, STEPS + 1) if s != 3] and state.global_step == STEPS and state.finished
    assert all(bool(torch.isfinite(p).all()) for p in skip.model.parameters())

    cont, applied = _train(tmp_path, "cont", "train.grad_clip=0", 'train.on_nonfinite="continue"',
                           objective=_nan_at(3))
    with pytest.raises(TrainingError, match="not finite"):
        cont.train()  # (no norm read at step 3: nothing acts on it, as documented; the weights do)
    assert applied == list(range(1, STEPS + 1))
