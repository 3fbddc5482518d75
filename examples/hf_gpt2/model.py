"""A Hugging Face ``transformers`` GPT-2 built from a ``GPT2Config`` (no download).

The model is the library's own ``GPT2LMHeadModel`` (its head tied to the token
embedding); pimm's built-in ``language_modeling`` objective reads the logits of the
``CausalLMOutputWithCrossAttentions`` it returns. ``pimm export`` writes it with
``save_pretrained``, so ``GPT2LMHeadModel.from_pretrained(export_dir)`` loads it back.
"""

from __future__ import annotations


def gpt2(vocab_size: int = 256, n_positions: int = 64, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
         dropout: float = 0.1):
    """``GPT2LMHeadModel(GPT2Config(...))`` over byte tokens (vocabulary 256)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                        n_head=n_head, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)
