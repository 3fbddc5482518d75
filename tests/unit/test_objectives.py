"""Objectives: the loss each built-in trains on, the metrics it reports, and metrics
reduced across ranks as sums and counts (never averages of averages)."""

from __future__ import annotations

import math
import sys
import uuid

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pimm_core.config import OBJECTIVES
from pimm_core.errors import ConfigError
from pimm_core.objectives import BUILTIN, MetricTotals, Objective, batch_size, get_objective


def evaluate(objective: Objective, model, batches) -> dict[str, float]:
    totals = MetricTotals()
    for b in batches:
        totals.add(objective(model, b)[1])
    return objective.finalize(totals.reduce())


def test_builtins_report_exactly_the_metrics_config_validates():
    torch.manual_seed(0)
    cls_batch = (torch.randn(5, 3), torch.randint(0, 4, (5,)), torch.arange(5))
    reg_batch = (torch.randn(5, 3), torch.randn(5))
    lm_batch = torch.randint(0, 7, (2, 6))
    models = {"classification": (nn.Linear(3, 4), cls_batch), "regression": (nn.Linear(3, 1), reg_batch),
              "language_modeling": (nn.Sequential(nn.Embedding(7, 8), nn.Linear(8, 7)), lm_batch)}
    assert set(BUILTIN) == set(OBJECTIVES)
    for name, (model, batch) in models.items():
        assert set(evaluate(BUILTIN[name], model, [batch])) == set(OBJECTIVES[name])


def test_classification_trains_on_the_summed_loss_with_its_count():
    """The loss is the (sum, count) pair a window divides by its total count (docs/objectives.md);
    targets of -100 are ignored in the sum, the count and the accuracy, as cross-entropy ignores them."""
    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    x, y = torch.randn(6, 3), torch.tensor([0, 1, 2, 3, 0, 1])
    loss, pairs = BUILTIN["classification"](model, (x, y, torch.arange(6)))
    assert torch.equal(loss.value, F.cross_entropy(model(x), y, reduction="sum")) and int(loss.count) == 6
    assert loss.value.requires_grad
    ignored = y.clone()
    ignored[2] = -100
    part, _ = BUILTIN["classification"](model, (x, ignored))
    assert int(part.count) == 5
    assert (part.value / part.count).item() == pytest.approx(F.cross_entropy(model(x), ignored).item(), rel=1e-6)
    correct = (model(x).argmax(1) == y).sum().item()
    assert pairs["acc"][0].item() == correct and pairs["acc"][1] == 6
    assert pairs["loss"][0].item() == pytest.approx(F.cross_entropy(model(x), y, reduction="sum").item(), rel=1e-6)


def test_regression_squeezes_a_trailing_dim_and_refuses_other_shapes():
    torch.manual_seed(0)
    x, y = torch.randn(4, 2), torch.tensor([1.0, -1.0, 0.5, 2.0])
    model = nn.Linear(2, 1)
    loss, pairs = BUILTIN["regression"](model, (x, y))
    pred = model(x).squeeze(1)
    assert (loss.value / loss.count).item() == pytest.approx(F.mse_loss(pred, y).item())
    assert pairs["mae"][0].item() == pytest.approx((pred - y).abs().sum().item())
    with pytest.raises(ConfigError, match=r'objective = "regression": model output shape \(4, 3\) does not match'):
        BUILTIN["regression"](nn.Linear(2, 3), (x, y))


def test_language_modeling_predicts_the_next_token():
    """A model that knows the next token (logit 20 on it) has ~0 loss; a uniform one ln V."""
    vocab = 5
    tokens = torch.tensor([[0, 1, 2, 3, 4, 0], [4, 3, 2, 1, 0, 4]])

    class Oracle(nn.Module):
        def forward(self, t):  # (B, T-1) -> logits (B, T-1, V) peaked on the true next token
            nxt = tokens[:, 1:]
            assert t.shape == nxt.shape
            return F.one_hot(nxt, vocab).float() * 20

    class Uniform(nn.Module):
        def forward(self, t):
            return torch.zeros(*t.shape, vocab)

    lm = BUILTIN["language_modeling"]
    assert evaluate(lm, Oracle(), [tokens])["loss"] < 1e-6
    m = evaluate(lm, Uniform(), [tokens, (tokens, torch.arange(2))])
    assert m["loss"] == pytest.approx(math.log(vocab)) and m["perplexity"] == pytest.approx(vocab)
    assert BUILTIN["language_modeling"](Uniform(), tokens)[1]["loss"][1] == 2 * 5  # B * (T-1) targets
    with pytest.raises(ConfigError, match="needs integer token batches"):
        lm(Uniform(), torch.zeros(2, 6))


def test_evaluation_reduces_sums_and_counts_across_ranks():
    """Two ranks with unequal shards: the reduced metric is the whole split's, which
    differs from the average of the per-rank (or per-batch) averages."""
    obj = Objective("mean_of_x", lambda model, b: (b.float().mean(), {"x": (b.float().sum(), b.numel())}))
    rank0 = [torch.tensor([1.0, 1.0, 1.0])]
    rank1 = [torch.tensor([10.0])]
    t0, t1 = MetricTotals(), MetricTotals()
    for b in rank0:
        t0.add(obj(None, b)[1])
    for b in rank1:
        t1.add(obj(None, b)[1])
    sent = []
    t1.reduce(all_reduce_sum=lambda t: sent.append(t.clone()))
    whole = t0.reduce(all_reduce_sum=lambda t: t.add_(sent[0]))
    assert whole == {"x": pytest.approx(13 / 4)}  # not (1 + 10) / 2


def test_a_rank_without_batches_joins_the_reduce():
    obj = BUILTIN["classification"]
    model = nn.Linear(2, 2)
    busy, idle = MetricTotals(), MetricTotals()
    busy.add(obj(model, (torch.randn(3, 2), torch.tensor([0, 1, 1])))[1])
    names = [sorted(busy.sums), sorted(idle.sums)]
    sent = []
    idle.reduce(all_reduce_sum=lambda t: sent.append(t.clone()), all_gather_object=lambda _: names)
    assert sent[0].tolist() == [0.0] * 4
    both = busy.reduce(all_reduce_sum=lambda t: t.add_(sent[0]), all_gather_object=lambda _: names)
    assert set(both) == {"acc", "loss"}
    assert math.isnan(MetricTotals().reduce(all_gather_object=lambda _: [["acc"]])["acc"])


def test_plain_metric_values_are_batch_means_weighted_by_batch_size():
    def step(model, batch):
        x, _ = batch
        return x.mean(), {"mean": x.mean(), "n_batches": (1, 1)}

    obj = Objective("user", step)
    m = evaluate(obj, None, [(torch.tensor([2.0, 2.0, 2.0]), None), (torch.tensor([6.0]), None)])
    assert m["mean"] == pytest.approx(3.0) and m["n_batches"] == 1.0
    assert batch_size({"a": [torch.zeros(7, 2)]}) == 7 and batch_size("text") == 1


@pytest.mark.parametrize("returned,message", [
    (3.0, "must return (loss, {metric: value}), got float"),
    ((torch.tensor(1.0), [1]), "must return (loss, {metric: value}), got tuple"),
    ((torch.ones(2), {}), "the loss must be a scalar (the batch mean) or a (sum, count) pair, got shape (2,)"),
    ((torch.tensor(1.0), {"m": torch.ones(3)}), "metric 'm' must be a scalar or a (sum, count) pair"),
])
def test_a_wrong_user_return_is_one_config_error(returned, message):
    with pytest.raises(ConfigError) as e:
        Objective("pkg.obj:step", lambda m, b: returned)(None, torch.zeros(1))
    assert str(e.value).startswith(f'objective = "pkg.obj:step": {message}') and "\n" not in str(e.value)


def test_get_objective_resolves_user_targets(tmp_path, monkeypatch):
    name = f"uobj{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n"
        "from pimm_core.objectives import Objective\n"
        "def step(model, batch):\n    return batch.sum(), {'s': (batch.sum(), batch.numel())}\n"
        "def one(model):\n    pass\n"
        "WITH_DERIVED = Objective('mine', step, lambda m: {'double': 2 * m['s']})\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        assert get_objective("classification") is BUILTIN["classification"]
        obj = get_objective(f"{name}:step")
        assert evaluate(obj, None, [torch.tensor([1.0, 3.0])]) == {"s": 2.0}
        assert evaluate(get_objective(f"{name}:WITH_DERIVED"), None, [torch.tensor([1.0, 3.0])]) == {"s": 2.0,
                                                                                                   "double": 4.0}
        with pytest.raises(ConfigError, match=f'^objective = "{name}:one": takes 1 positional arguments; pimm passes 2'):
            get_objective(f"{name}:one")
        with pytest.raises(ConfigError, match=f"^objective = \"{name}:stpe\": '{name}' has no attribute 'stpe'"):
            get_objective(f"{name}:stpe")
    finally:
        sys.modules.pop(name, None)


def test_builtins_take_the_logits_of_a_mapping_or_an_output_object() -> None:
    """A model returning ``{"logits": ...}`` (or a ``transformers`` ``ModelOutput``) trains with
    the built-ins exactly as one returning the logits tensor."""
    from transformers.modeling_outputs import CausalLMOutput

    from pimm_core.objectives import BUILTIN, ObjectiveOutputError

    torch.manual_seed(0)
    head = torch.nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0])
    plain = BUILTIN["classification"](head, (x, y))
    as_dict = BUILTIN["classification"](lambda v: {"logits": head(v), "hidden": v}, (x, y))
    as_output = BUILTIN["classification"](lambda v: CausalLMOutput(logits=head(v)), (x, y))
    assert torch.equal(plain[0].value, as_dict[0].value) and torch.equal(plain[0].value, as_output[0].value)
    with pytest.raises(ObjectiveOutputError, match=r"the model returned a dict with keys \['hidden'\].*write an objective"):
        BUILTIN["classification"](lambda v: {"hidden": v}, (x, y))
