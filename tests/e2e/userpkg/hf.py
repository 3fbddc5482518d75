"""Models nobody here wrote: a tiny ``transformers`` GPT-2 and a timm ResNet, built from
configs (no downloads), and token data for the language model."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


def gpt2(n_layer: int = 2, n_embd: int = 32, vocab_size: int = 64, n_positions: int = 32):
    """A ``GPT2LMHeadModel`` (its head tied to ``transformer.wte``) from a ``GPT2Config``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=vocab_size,
                                      n_positions=n_positions, bos_token_id=0, eos_token_id=0))


def resnet(num_classes: int = 10):
    """timm's ``resnet18`` (random weights) for 8x8 one-channel digits."""
    import timm

    return timm.create_model("resnet18", pretrained=False, num_classes=num_classes, in_chans=1)


class Tokens(Dataset):
    """``n`` rows of ``length`` int64 tokens below ``vocab_size``: a counting pattern with a
    per-row start, so a language model can learn it."""

    def __init__(self, n: int, length: int, vocab_size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (n, 1), generator=g)
        self.rows = (start + torch.arange(length)) % vocab_size

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


def tokens(train: int = 64, val: int = 16, length: int = 16, vocab_size: int = 64):
    return Tokens(train, length, vocab_size, 0), Tokens(val, length, vocab_size, 1)


class Wrapped(torch.nn.Module):
    """A model whose output no built-in objective can read (a tuple of tensors)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 8)

    def forward(self, x):
        return (self.emb(x), self.emb(x))


def tuple_model():
    return Wrapped()


class Images(Dataset):
    """Digits as ``(1, 8, 8)`` float images and int64 labels."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def digit_images(train: int = 64, val: int = 32):
    from pimm_core.data.loaders import digits_arrays

    data, target = digits_arrays()
    x = torch.tensor(data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(target, dtype=torch.int64)
    return Images(x[:train], y[:train]), Images(x[train:train + val], y[train:train + val])
