"""CPU staging buffers kept from one snapshot to the next (torch).

A background save (``checkpoint.async``) and the memory tier's snapshot both copy the
checkpointed tensors to CPU while training waits, then write the copies on another thread.
Copying into new tensors makes the training thread fault in every page of a fresh
allocation (on this project's VMs, which hand freed memory back to the host, that is most of
the copy's time); copying into buffers kept from the previous copy, already mapped, is 3-4x
faster. The cost: one resident CPU copy of the staged state between snapshots.

Sound only when the previous copy is no longer read when the next one starts (both callers
keep at most one save or snapshot in flight and wait for it before staging the next).
"""

from __future__ import annotations

from typing import Any

import torch


class StagingBuffers:
    """CPU copies of tensors, each written into the buffer its key had at the previous copy.

    A key whose shape or dtype changed gets a new buffer; a tensor that is not a plain
    ``torch.Tensor`` (a ``DTensor``) gets a plain new CPU copy each time (not kept).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` copied to CPU into ``key``'s buffer (same shape and dtype; detached)."""
        if type(t) is not torch.Tensor:
            return t.detach().to("cpu", copy=True)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._buffers[key] = torch.empty(t.shape, dtype=t.dtype)
        return buf.copy_(t.detach())

    def copy_tree(self, key: str, obj: Any) -> Any:
        """``obj`` (tensors in nested dicts, lists and tuples) with every tensor copied by :meth:`copy`,
        keyed by its path below ``key``; other values are returned as they are."""
        if isinstance(obj, torch.Tensor):
            return self.copy(key, obj)
        if isinstance(obj, dict):
            return {k: self.copy_tree(f"{key}/{k}", v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.copy_tree(f"{key}/{i}", v) for i, v in enumerate(obj))
        return obj
