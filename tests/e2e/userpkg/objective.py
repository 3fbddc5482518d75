"""The user objective: label-smoothed cross-entropy, reporting the error rate as a batch mean.

With ``USERPKG_SIGTERM_AT=N`` and ``USERPKG_SIGTERM_MARK=path`` (tests only), rank 0's N-th
training call sends SIGTERM to its own process once (the mark file remembers it), as a
scheduler's pre-emption notice would: the run stops cleanly after that step.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch.nn.functional as F

_calls = 0


def _maybe_sigterm() -> None:
    global _calls
    at, mark = os.environ.get("USERPKG_SIGTERM_AT"), os.environ.get("USERPKG_SIGTERM_MARK")
    if not at or not mark or os.environ.get("RANK", "0") != "0" or Path(mark).exists():
        return
    _calls += 1
    if _calls == int(at):
        Path(mark).touch()
        os.kill(os.getpid(), signal.SIGTERM)


def smoothed_ce(model, batch):
    x, y = batch
    logits = model(x)
    if model.training:
        _maybe_sigterm()
    loss = F.cross_entropy(logits, y, label_smoothing=0.1)
    return loss, {"loss": loss.detach(), "err": (logits.argmax(1) != y).float().mean()}


def seen_ce(model, batch):
    """Cross-entropy of ``(x, y, index)`` batches; with ``USERPKG_SEEN=path`` each training call appends
    ``{"epoch_batch": [indices]}`` lines to ``<path>.rank<RANK>`` (the samples each rank trained, in order)."""
    x, y, index = batch
    logits = model(x)
    if model.training:
        seen = os.environ.get("USERPKG_SEEN")
        if seen:
            with open(f"{seen}.rank{os.environ.get('RANK', '0')}", "a") as f:
                f.write(" ".join(str(int(i)) for i in index) + "\n")
        _maybe_sigterm()
    loss = F.cross_entropy(logits, y)
    return loss, {"loss": loss.detach()}


def seen_sum_ce(model, batch):
    """:func:`seen_ce` returning its loss as ``(sum, count)`` (a per-sample window average)."""
    x, y, index = batch
    logits = model(x)
    if model.training:
        seen = os.environ.get("USERPKG_SEEN")
        if seen:
            with open(f"{seen}.rank{os.environ.get('RANK', '0')}", "a") as f:
                f.write(" ".join(str(int(i)) for i in index) + "\n")
    total = F.cross_entropy(logits, y, reduction="sum")
    return (total, len(y)), {"loss": (total.detach(), len(y))}
