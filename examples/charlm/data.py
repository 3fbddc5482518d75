"""The char-LM's text: the source of a few standard-library modules, as UTF-8 bytes.

Python ships its standard library as source, so the corpus needs no download: about
360 kB of English docstrings, comments and code (``argparse``, ``textwrap``, ``difflib``...).
Its exact content depends on the Python version; the data fingerprint says which text a
run saw. The last ``val_fraction`` of the text (after concatenating the modules in order)
is the validation split, so no validation window overlaps a training one.

Tokens are bytes (vocabulary 256). A sample is a window of ``block_size + 1`` tokens: the
model reads the first ``block_size`` and predicts the last ``block_size``
(:mod:`pimm_core.objectives`' ``language_modeling``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
from pathlib import Path

import torch

from pimm_core.data.loaders import Datasets
from pimm_core.data.rng import EpochSeeded

#: The modules whose source is the corpus (stable, prose-rich, all pure Python).
MODULES = ("argparse", "textwrap", "difflib", "dataclasses", "functools", "heapq", "string", "contextlib")


def corpus(modules: tuple[str, ...] | list[str] = MODULES) -> bytes:
    """The concatenated source of ``modules`` (found without importing them), UTF-8."""
    parts = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise ValueError(f"no Python source for standard-library module {name!r}")
        parts.append(Path(spec.origin).read_bytes())
    return b"\n".join(parts)


class Windows(EpochSeeded, torch.utils.data.Dataset):
    """Non-overlapping windows of ``block_size + 1`` tokens over ``tokens`` (int64 ``(N,)``).

    Item ``i`` is int64 ``(block_size + 1,)`` starting at ``i * block_size``; with
    ``jitter``, each epoch moves every window by a random offset in ``[0, block_size)``
    drawn from the sample's own RNG (:mod:`pimm_core.data.rng`), so the model sees other
    alignments each epoch and a resume (at any worker count) sees the same ones.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, *, jitter: bool = False, seed: int = 0):
        super().__init__(seed)
        self.tokens, self.block_size, self.jitter = tokens, block_size, jitter
        self.n = (len(tokens) - 1 - (block_size if jitter else 0)) // block_size
        if self.n < 1:
            raise ValueError(f"{len(tokens)} tokens make no window of {block_size + 1}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.block_size
        if self.jitter:
            start += int(torch.randint(self.block_size, (1,), generator=self.generator(i)))
        return self.tokens[start:start + self.block_size + 1]


def charlm(block_size: int = 128, val_fraction: float = 0.1, seed: int = 0,
           modules: tuple[str, ...] | list[str] = MODULES) -> Datasets:
    """Train and validation windows of the corpus (the ``data.target`` of configs/charlm.toml).

    Args:
        block_size: context length in bytes (the model's ``block_size``).
        val_fraction: the share of the text, at its end, held out.
        seed: the training windows' jitter seed.
        modules: standard-library modules whose source is the text.

    Returns:
        :class:`~pimm_core.data.Datasets` with a fingerprint of the text and the split.
    """
    text = corpus(modules)
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(len(tokens) * (1 - val_fraction))
    fp = hashlib.sha256(text + f"|{block_size}|{val_fraction}|{seed}".encode()).hexdigest()[:16]
    return Datasets(Windows(tokens[:cut], block_size, jitter=True, seed=seed), Windows(tokens[cut:], block_size),
                    fingerprint=fp)


def unigram_baseline(train: torch.Tensor, val: torch.Tensor, vocab_size: int = 256) -> dict[str, float]:
    """Cross-entropy of the validation targets under the training text's byte frequencies.

    Args:
        train: int64 training tokens (the counts, add-one smoothed over ``vocab_size``).
        val: int64 tokens scored, e.g. the targets of every validation window.

    Returns:
        ``{"loss": nats per token, "perplexity": exp(loss)}``: what a model that ignores
        context reaches; a language model must do clearly better.
    """
    counts = torch.bincount(train, minlength=vocab_size).double() + 1
    logp = (counts / counts.sum()).log()
    loss = float(-logp[val].mean())
    return {"loss": loss, "perplexity": math.exp(loss)}


def baseline_of(data: Datasets) -> dict[str, float]:
    """:func:`unigram_baseline` of :func:`charlm`'s splits, scored on exactly the targets
    the evaluation scores (every validation window's last ``block_size`` tokens)."""
    val: Windows = data.val
    targets = torch.cat([val[i][1:] for i in range(len(val))])
    return unigram_baseline(data.train.tokens, targets)


if __name__ == "__main__":  # python -m examples.charlm.data [CONFIG]: the corpus and its baseline
    import sys

    from pimm_core import load_config

    d = charlm(**(load_config(sys.argv[1] if len(sys.argv) > 1 else "configs/charlm.toml").data.args or {}))
    b = baseline_of(d)
    print(f"train windows {len(d.train)}, val windows {len(d.val)}, fingerprint {d.fingerprint}; "
          f"unigram baseline: val loss {b['loss']:.4f} nats/byte, perplexity {b['perplexity']:.2f}")
