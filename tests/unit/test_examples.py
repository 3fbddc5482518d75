"""The examples' user code (examples/charlm, examples/digits_aug) and their configs: shapes,
tied embeddings, the data splits, and augmentation that depends only on the sample."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pimm_core.config import load_config
from pimm_core.data.loaders import as_datasets, data_spec
from pimm_core.models import model_spec
from pimm_core.objectives import BUILTIN
from pimm_core.targets import call

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.chdir(REPO)


# ------------------------------------------------------------------ char LM
def test_char_transformer_shapes_and_tied_embeddings():
    from examples.charlm.model import CharTransformer

    torch.manual_seed(0)
    m = CharTransformer(block_size=16, d_model=32, n_layers=2, n_heads=4, dropout=0.1)
    x = torch.randint(0, 256, (3, 16))
    assert m(x).shape == (3, 16, 256)
    assert m.head.weight is m.tok.weight
    sd = m.state_dict()
    assert sd["head.weight"].data_ptr() == sd["tok.weight"].data_ptr()  # one tensor in the state dict
    assert len(list(m.parameters())) == len({id(p) for p in m.parameters()})
    with pytest.raises(ValueError, match="longer than block_size 16"):
        m(torch.zeros(1, 17, dtype=torch.long))
    m.eval()
    assert torch.equal(m(x), m(x))
    m.train()
    assert not torch.equal(m(x), m(x))  # dropout is active in training


def test_causal_model_does_not_see_the_future():
    from examples.charlm.model import CharTransformer

    m = CharTransformer(block_size=8, d_model=16, n_layers=1, n_heads=2, dropout=0.0).eval()
    a, b = torch.randint(0, 256, (1, 8)), torch.randint(0, 256, (1, 8))
    b[:, :5] = a[:, :5]
    assert torch.allclose(m(a)[:, :5], m(b)[:, :5], atol=1e-6)


def test_generate_continues_the_prompt_reproducibly():
    from examples.charlm.model import CharTransformer, generate

    m = CharTransformer(block_size=8, d_model=16, n_layers=1, n_heads=2)
    out = generate(m, "def ", 20, generator=torch.Generator().manual_seed(1))
    assert out.startswith("def ") and m.training
    assert out == generate(m, "def ", 20, generator=torch.Generator().manual_seed(1))
    assert len(generate(m, "", 5, top_k=1, generator=torch.Generator().manual_seed(0)).encode("utf-8", "replace")) >= 1


def test_charlm_data_splits_windows_and_baseline():
    from examples.charlm.data import Windows, baseline_of, charlm, corpus

    d = charlm(block_size=32, val_fraction=0.1)
    text = corpus()
    assert len(text) > 200_000
    cut = int(len(text) * 0.9)
    assert bytes(d.val[0].tolist()) == text[cut:cut + 33]  # validation is the text's tail
    assert d.train[0].shape == (33,) and d.train[0].dtype == torch.int64
    assert d.fingerprint == charlm(block_size=32, val_fraction=0.1).fingerprint != charlm(block_size=64).fingerprint
    # jitter: the same window per (seed, epoch, index), another one next epoch, never past the end
    assert torch.equal(d.train[5], d.train[5])
    first = [d.train[i] for i in range(20)]
    d.train.set_epoch(1)
    assert any(not torch.equal(a, d.train[i]) for i, a in enumerate(first))
    last = d.train[len(d.train) - 1]
    assert last.shape == (33,)
    with pytest.raises(ValueError, match="make no window"):
        Windows(torch.zeros(10, dtype=torch.long), 32)
    base = baseline_of(d)
    assert 2.0 < base["loss"] < math.log(256) and base["perplexity"] == pytest.approx(math.exp(base["loss"]))


def test_an_untrained_lm_scores_far_above_the_unigram_baseline():
    """The comparison the README makes starts from near ln 256 (untrained), well above the baseline."""
    from examples.charlm.data import baseline_of, charlm
    from examples.charlm.model import CharTransformer

    torch.manual_seed(0)
    d = charlm(block_size=16)
    m = CharTransformer(block_size=16, d_model=32, n_layers=1, n_heads=2).eval()
    loss, pairs = BUILTIN["language_modeling"](m, torch.stack([d.val[i] for i in range(8)]))
    assert pairs["loss"][1] == 8 * 16  # B * block_size next-token targets
    assert loss.mean().item() > baseline_of(d)["loss"] + 1.0


# ------------------------------------------------------------------ augmented digits
def test_digits_aug_items_and_model_shapes():
    from examples.digits_aug.data import digits_aug
    from examples.digits_aug.model import BNNet

    d = digits_aug()
    x, y, i = d.train[3]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64 and int(i) == 3
    assert float(x.min()) >= 0 and float(x.max()) <= 1
    assert len(d.train) + len(d.val) == 1797 and d.fingerprint
    vx, _, _ = d.val[0]
    assert torch.equal(vx, d.val.images[0])  # validation is not augmented
    m = BNNet()
    assert m(torch.stack([d.train[k][0] for k in range(4)])).shape == (4, 10)
    assert m(torch.zeros(2, 64)).shape == (2, 10)
    assert any(k.endswith("running_mean") for k in m.state_dict())  # BatchNorm buffers are saved


def test_digits_augmentation_depends_only_on_seed_epoch_and_index():
    """Three simulated workers with their own global RNG, loading in another order, give
    every sample the augmentation one worker gives it."""
    from examples.digits_aug.data import digits_aug

    d = digits_aug(seed=3)
    d.train.set_epoch(4)

    def load(workers: int) -> dict[int, torch.Tensor]:
        out = {}
        for w in range(workers):
            torch.manual_seed(w)
            for k in reversed(range(w, 60, workers)):
                out[k] = d.train[k][0]
        return out

    one, three = load(1), load(3)
    assert all(torch.equal(one[k], three[k]) for k in range(60))
    assert any(not torch.equal(one[k], d.train.images[k]) for k in range(60))  # it does augment
    d.train.set_epoch(5)
    assert any(not torch.equal(one[k], d.train[k][0]) for k in range(60))  # and anew each epoch


# ------------------------------------------------------------------ the configs
@pytest.mark.parametrize("name", ["charlm", "digits_aug"])
def test_example_configs_load_and_their_targets_build(name):
    cfg = load_config(REPO / "configs" / f"{name}.toml")
    model = call(model_spec(cfg.model), config_path=REPO / "configs" / f"{name}.toml")
    spec = data_spec(cfg.data)
    data = as_datasets(call(spec, config_path=REPO / "configs" / f"{name}.toml"), spec)
    batch = torch.utils.data.default_collate([data.train[k] for k in range(4)])
    loss, _ = BUILTIN[cfg.objective](model, batch)
    assert loss.value.dim() == 0 and math.isfinite(loss.mean().item())
    if name == "charlm":
        assert model.block_size == cfg.data.args["block_size"]


def test_sample_script_generates_from_saved_weights(tmp_path, capsys):
    from examples.charlm.sample import main

    cfg_path = REPO / "configs" / "charlm.toml"
    model = call(model_spec(load_config(cfg_path).model))
    torch.save(model.state_dict(), tmp_path / "w.pth")
    text = main([str(tmp_path / "w.pth"), "--config", str(cfg_path), "--prompt", "import ", "-n", "10"])
    assert text.startswith("import ") and text in capsys.readouterr().out
