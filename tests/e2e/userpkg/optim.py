"""A user optimizer with state of its own: AdamW counting its steps (``steps``) and, through a step
hook it registers, the hook's calls (``hook_calls``). Its constructor takes a required ``tag``, so
it cannot be rebuilt from its parameter groups alone."""

from __future__ import annotations

import torch


class CountingAdamW(torch.optim.AdamW):
    def __init__(self, params, lr: float, tag: str, **kw):
        super().__init__(params, lr=lr, **kw)
        self.tag, self.steps, self.hook_calls = tag, 0, 0
        self.register_step_post_hook(lambda opt, args, kwargs: setattr(opt, "hook_calls", opt.hook_calls + 1))

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


def counting_adamw(params, lr: float, tag: str = "user", **kw) -> CountingAdamW:
    return CountingAdamW(params, lr, tag, **kw)
