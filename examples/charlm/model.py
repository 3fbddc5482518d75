"""A small GPT-style character (byte) Transformer with tied input/output embeddings.

``CharTransformer`` maps int64 byte tokens ``(B, T)`` (``T <= block_size``) to logits
``(B, T, vocab_size)`` over the next byte. Pre-norm blocks (LayerNorm, causal
self-attention, LayerNorm, GELU MLP), learned positions, dropout on the embeddings,
attention and residual branches; the output head shares the token embedding's weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """One pre-norm Transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``; ``(B, T, d)``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not a multiple of n_heads {n_heads}")
        self.n_heads, self.dropout = n_heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        # three projections, not one fused: a tensor-parallel plan splits each by heads (a column
        # shard of a fused q|k|v would give one rank queries and keys)
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        # (-1: the heads this rank holds; all of them unless tensor parallel splits q/k/v by heads)
        q, k, v = (m(h).view(b, t, -1, d // self.n_heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))
        return x + self.drop(self.mlp(self.ln2(x)))


class CharTransformer(nn.Module):
    """Byte-level causal Transformer LM.

    Args:
        vocab_size: token ids are in ``[0, vocab_size)`` (256: raw UTF-8 bytes).
        block_size: the longest context, in tokens.
        d_model, n_layers, n_heads: width, depth, attention heads.
        dropout: dropout probability (embeddings, attention, residual branches).
    """

    def __init__(self, vocab_size: int = 256, block_size: int = 128, d_model: int = 128, n_layers: int = 4,
                 n_heads: int = 4, dropout: float = 0.1):
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)
        self.head.weight = self.tok.weight  # tied: one matrix embeds bytes and scores them

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)  # GPT-2's initialization
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` int64 tokens -> ``(B, T, vocab_size)`` logits of the next token."""
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size {self.block_size}")
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@torch.no_grad()
def generate(model: CharTransformer, prompt: str, n: int, *, temperature: float = 0.8, top_k: int | None = None,
             generator: torch.Generator | None = None) -> str:
    """Sample ``n`` bytes after ``prompt`` (UTF-8), one at a time, in eval mode.

    Args:
        model: a trained model (left in the train/eval mode it was in).
        prompt: the text to continue; may be empty (starts from a newline).
        n: bytes to sample.
        temperature: logits are divided by it (lower: more conservative).
        top_k: sample among the ``top_k`` most likely bytes only.
        generator: the sampling RNG (reproducible samples).

    Returns:
        ``prompt`` followed by the sample, decoded as UTF-8 (invalid bytes replaced).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    idx = torch.tensor([list((prompt or "\n").encode("utf-8"))], dtype=torch.long, device=device)
    for _ in range(n):
        logits = model(idx[:, -model.block_size:])[:, -1].float() / max(temperature, 1e-6)
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    model.train(was_training)
    out = bytes(idx[0].tolist()).decode("utf-8", errors="replace")
    return out if prompt else out[1:]
