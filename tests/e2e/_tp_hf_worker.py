"""One rank of the Hugging Face tensor-parallel check (``test_tensor_parallel.py``), under torchrun: a job
``{"script": <this file>, "args": [out]}`` of ``_resume_driver.py`` (after the launch's other jobs), or alone.

For a tiny ``GPT2LMHeadModel`` and ``LlamaForCausalLM``: a copy parallelized with pimm's
built-in plan (``pimm_core.train.tp_plans``) over all ranks gives the whole model's logits
and gradients (gathered), within float tolerance; rank 0 writes ``{model: [max logit
difference, max gradient difference, DTensor parameters]}`` as JSON to ``argv[1]``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor


def main(out: str | Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from pimm_core.train.tensor_parallel import apply_tp
    from pimm_core.train.tp_plans import BUILT_IN

    own_group = not dist.is_initialized()  # (a job of _resume_driver.py: its ranks' group is up)
    if own_group:
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    models = [GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                         resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)),
              LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))]
    x = torch.randint(0, 64, (2, 8))
    result = {}
    for m in models:
        whole = copy.deepcopy(m)
        apply_tp(m, BUILT_IN[type(m).__name__](m), mesh)
        a, b = m(x).logits, whole(x).logits
        (a * a).sum().backward()
        (b * b).sum().backward()
        full = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in m.parameters()]
        result[type(m).__name__] = [(a - b).abs().max().item(),
                                    max((g - q.grad).abs().max().item() for g, q in zip(full, whole.parameters())),
                                    sum(isinstance(p, DTensor) for p in m.parameters())]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    if own_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
