"""Choosing a checkpoint format by name (``checkpoint_format``, or the format a candidate has)."""

from __future__ import annotations

from ...errors import ConfigError
from ...process.dist import DistInfo
from .protocol import CheckpointFormat
from .standard import StandardFormat

FORMAT_NAMES = ("standard", "legacy", "single")


def make_format(name: str, info: DistInfo, *, background: bool = False, keep_last: int = 0,
                keep_full: int = 1) -> CheckpointFormat:
    """The format called ``name``, for this process's rank layout.

    Args:
        background: ``checkpoint.async``: the standard format wrapped in
            :class:`~pimm_core.checkpoint.formats.async_save.AsyncStandardFormat` (creates a gloo
            process group when distributed, so every rank must make the same call);
            ignored by the file formats.
        keep_last: ``checkpoint.keep_last``, the single format's retention (0 keeps all).
        keep_full: ``checkpoint.keep_full``, the standard format's full checkpoints kept (``last``
            and the newest ``keep_full - 1`` superseded ones as ``full_<step>/``).

    Raises:
        ConfigError: an unknown name.
    """
    # (the other formats' modules import torch.distributed.checkpoint: imported when asked for)
    if name == "standard":
        standard = StandardFormat(info, keep_full=keep_full)
        if not background:
            return standard
        from .async_save import AsyncStandardFormat

        return AsyncStandardFormat(standard)
    if name == "legacy":
        from .files import LegacyFormat

        return LegacyFormat(info)
    if name == "single":
        from .files import SingleFormat

        return SingleFormat(info, keep_last=keep_last)
    raise ConfigError(f"unknown checkpoint format {name!r}; expected one of {', '.join(FORMAT_NAMES)}")
