"""Per-sample accumulation windows, in one process: a window of micro-batches 4 + 3 takes the
same optimizer step as one batch of 7 when the objective returns ``(sum, count)`` (every
built-in); the gradient norm and clipping see the divided gradients; fp16-style loss scaling
and the non-finite policy still work; a user objective returning a plain mean keeps the mean
of the micro-batch means. (At 2 ranks under DDP and FSDP: tests/e2e/test_window_average_ranks.py.)"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pimm_core.config import TrainConfig
from pimm_core.errors import ConfigError
from pimm_core.objectives import BUILTIN, Objective
from pimm_core.train.state import TrainState
from pimm_core.train.step import APPLIED, SKIPPED, WindowStep


def _net(out: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, out))


def _step(model: nn.Module, batches: list, *, accum: int, objective: Objective = BUILTIN["classification"],
          scaler: torch.amp.GradScaler | None = None, **train) -> tuple[list, WindowStep]:
    """Train ``batches`` as windows of ``accum`` with SGD at lr 1 (the weight change is minus the
    gradient; no clipping unless ``grad_clip`` is given)."""
    train.setdefault("grad_clip", None)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = scaler or torch.amp.GradScaler("cpu", enabled=False)
    step = WindowStep(model, opt, scaler, None, TrainConfig(grad_accum=accum, **train),
                      autocast=contextlib.nullcontext, distributed=False, objective=objective)
    out = list(step.windows(batches, TrainState(), len(batches), torch.device("cpu")))
    return out, step


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _data():
    torch.manual_seed(1)
    return torch.randn(7, 5), torch.randint(0, 3, (7,))


def test_a_window_of_4_and_3_samples_steps_as_one_batch_of_7():
    x, y = _data()
    split, whole = _net(), _net()
    (outcome, loss, samples), = _step(split, [(x[:4], y[:4]), (x[4:], y[4:])], accum=2)[0]
    (_, whole_loss, _), = _step(whole, [(x, y)], accum=1)[0]
    assert outcome == APPLIED and samples == 7
    assert _max_diff(split, whole) < 1e-6
    # the logged loss is the per-sample mean of the window, not the mean of the two means
    full = F.cross_entropy(_net()(x), y).item()
    assert loss.item() == pytest.approx(full, abs=1e-6) and whole_loss.item() == pytest.approx(full, abs=1e-6)
    # today's mean of means is measurably elsewhere (the bug this fixes)
    means = _net()
    _step(means, [(x[:4], y[:4]), (x[4:], y[4:])], accum=2, objective=Objective("mean", _mean_ce))
    assert _max_diff(means, whole) > 1e-3


def _mean_ce(model, batch):
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    return loss, {"loss": loss.detach()}


def test_a_user_objective_returning_a_mean_keeps_the_mean_of_micro_batch_means():
    x, y = _data()
    model, ref = _net(), _net()
    (_, loss, _), = _step(model, [(x[:4], y[:4]), (x[4:], y[4:])], accum=2, objective=Objective("mean", _mean_ce))[0]
    l1, l2 = F.cross_entropy(ref(x[:4]), y[:4]), F.cross_entropy(ref(x[4:]), y[4:])
    ((l1 + l2) / 2).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= p.grad
    assert _max_diff(model, ref) < 1e-6
    assert loss.item() == pytest.approx(((l1 + l2) / 2).item(), abs=1e-6)


def test_grad_norm_and_clipping_see_the_per_sample_gradient():
    x, y = _data()
    split, whole = _net(), _net()
    _, split_step = _step(split, [(x[:4], y[:4]), (x[4:], y[4:])], accum=2, grad_clip=0.05)
    _, whole_step = _step(whole, [(x, y)], accum=1, grad_clip=0.05)
    assert split_step.grad_norm.item() == pytest.approx(whole_step.grad_norm.item(), rel=1e-6)
    assert split_step.grad_norm.item() > 0.05  # the clip acted, on the divided gradients
    assert _max_diff(split, whole) < 1e-6


def test_language_modeling_counts_the_tokens_that_are_not_padding():
    """Two micro-batches with different amounts of right padding step as the whole window would:
    the per-token mean over the 13 real target tokens, not the mean of the two batches' means."""
    torch.manual_seed(2)
    vocab = 11
    tokens = torch.randint(0, vocab, (4, 6))
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[0, 3:] = 0   # 2 targets count
    mask[1, 5:] = 0   # 4
    mask[2, 2:] = 0   # 1
    mask[3, 4:] = 0   # 3 ... plus [1, ...] below: 10 targets in all
    labels = tokens.clone()
    labels[3, 2] = -100  # one ignored label inside a sequence: 9 counted targets

    def lm():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(vocab, 8), nn.Linear(8, vocab))

    def batch(rows):
        return {"input_ids": tokens[rows], "attention_mask": mask[rows], "labels": labels[rows]}

    split, whole, ref = lm(), lm(), lm()
    obj = BUILTIN["language_modeling"]
    (_, loss, _), = _step(split, [batch([0, 1]), batch([2, 3])], accum=2, objective=obj)[0]
    _step(whole, [batch([0, 1, 2, 3])], accum=1, objective=obj)
    assert _max_diff(split, whole) < 1e-6
    # the reference: cross-entropy averaged over exactly the counted next-token targets
    targets = labels[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    assert int((targets != -100).sum()) == 9
    expected = F.cross_entropy(ref(tokens[:, :-1]).flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    expected.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= p.grad
    assert _max_diff(split, ref) < 1e-6


def test_loss_scaling_leaves_the_per_sample_step_unchanged():
    """fp16's GradScaler path (on CPU here): the scaled, K-weighted sums unscale to the same step."""
    x, y = _data()
    scaled, plain = _net(), _net()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    (outcome, _, _), = _step(scaled, [(x[:4], y[:4]), (x[4:], y[4:])], accum=2, scaler=scaler)[0]
    _step(plain, [(x, y)], accum=1)
    assert outcome == APPLIED and scaler.get_scale() == 2.0**16  # nothing overflowed
    assert _max_diff(scaled, plain) < 1e-6


def test_a_non_finite_loss_is_still_caught_after_the_division():
    x, y = _data()
    x = x.clone()
    x[5, 0] = float("nan")
    model = _net()
    before = copy.deepcopy(model)
    (outcome, _, _), = _step(model, [(x[:4], y[:4]), (x[4:], y[4:])], accum=2, on_nonfinite="skip")[0]
    assert outcome == SKIPPED and _max_diff(model, before) == 0.0


def test_an_objective_switching_forms_inside_a_window_is_refused():
    calls = []

    def flip(model, batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y, reduction="sum")
        calls.append(1)
        return (loss, len(y)) if len(calls) == 1 else loss / len(y), {}

    x, y = _data()
    with pytest.raises(ConfigError, match=r"return the same form for every batch"):
        _step(_net(), [(x[:4], y[:4]), (x[4:], y[4:])], accum=2, objective=Objective("flip", flip))


@pytest.mark.parametrize("loss, message", [
    ((torch.ones(2), 3), r"the loss sum must be a scalar"),
    ((torch.tensor(1.0), "3"), r"the loss count must be an int or a 0-d tensor, got str"),
    ((torch.tensor(1.0), torch.ones(2)), r"the loss count must be a number"),
    (("a", 1), r"the loss must be a scalar tensor \(the batch mean\) or a \(sum tensor, count\) pair, "
               r"got a tuple of \(str, int\)"),
])
def test_a_malformed_loss_pair_names_the_contract(loss, message):
    obj = Objective("mine", lambda model, batch: (loss, {}))
    with pytest.raises(ConfigError, match=r'objective = "mine": ' + message):
        obj(nn.Identity(), torch.zeros(1))
