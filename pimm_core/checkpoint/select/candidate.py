"""A checkpoint's names in ``model/`` and :class:`Candidate`, the description of one entry (torch-free).

The names every reader and writer agrees on (``weights.pth``, ``trainer.dcp``, ``iter_<step>.pth``...)
and the record :mod:`.selection` builds for each entry; :mod:`.verify` checks one against its
manifest. Both import this module and not each other.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, fields
from typing import Any

WEIGHTS = "weights.pth"
TRAINER_DCP = "trainer.dcp"
#: Manifest field of a standard checkpoint whose model weights are only in ``trainer.dcp/``
#: (sharded, ``checkpoint.gather_weights = false``): ``"weights": "trainer.dcp"``, no ``weights.pth``.
WEIGHTS_FIELD = "weights"
DCP_METADATA = ".metadata"
LEGACY_LAST = "model_last.pth"
BEST = "model_best.pth"
ITER_RE = re.compile(r"^iter_(\d+)\.pth$")
BEST_K_RE = re.compile(r"^best_(\d+)\.pth$")  # checkpoint.keep_best: one of the k best evaluations, at that step
SINGLE_RE = re.compile(r"^step_(\d+)\.pth$")
FULL_RE = re.compile(r"^full_(\d+)$")  # standard format, checkpoint.keep_full: a superseded last, kept
POINTERS = ("last", "best", "final")
RESUME_ORDER = ("last", "last.prev", LEGACY_LAST)


@dataclass
class Candidate:
    """One checkpoint (or leftover) found in a model directory.

    Attributes:
        name: entry name in the model directory (``last``, ``iter_40.pth``, ...).
        kind: ``last`` | ``last.prev`` | ``full`` | ``legacy`` | ``best`` (``model_best.pth``, the ``best``
            pointer, a ``best_<step>.pth`` of ``checkpoint.keep_best``) | ``iter`` | ``single`` | ``tmp``.
        format: ``standard`` | ``legacy`` | ``weights`` (weights-only file) | ``unknown``.
        resumable: holds trainer state, so ``--train.resume`` may pick it.
        complete: every required part is present (not a checksum check; see verify).
        reason: why it is incomplete, or ``None``.
        step, epoch, iter: from the manifest when present (``iter`` is the next batch in ``epoch``).
        size: bytes on disk (files summed for directories).
    """

    name: str
    path: str
    kind: str
    format: str
    resumable: bool
    complete: bool
    reason: str | None = None
    step: int | None = None
    epoch: int | None = None
    iter: int | None = None
    size: int = 0
    created: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None
    target: str | None = None  # for pointers: the file they point at
    verify_problems: list[str] | None = None  # set when select_resume found files not matching the manifest
    manifest_problem: str | None = None  # its manifest is unreadable or invalid (``invalid manifest: ...``)
    generation: tuple[Any, ...] | None = None  # generation.identity() of the path this was read from

    def to_json(self) -> dict[str, Any]:
        """The listing's row (``pimm checkpoints ls --json``): every field but the manifest and
        the generation (no deep copy of the manifest's file table only to drop it)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("manifest", "generation")}
        d["metrics"] = copy.deepcopy(self.metrics)
        d["verify_problems"] = None if self.verify_problems is None else list(self.verify_problems)
        return d
