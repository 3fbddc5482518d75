"""``log.tensorboard = true``: the metrics records also as TensorBoard scalars.

``metrics.jsonl`` stays the source the console and the tools read; the event files are a
copy for TensorBoard, written by rank 0 into ``<run_dir>/tensorboard/`` with PyTorch's
``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package; ``uv sync`` installs
it with the dev group, or ``pip install tensorboard``). View them with
``tensorboard --logdir <run_dir>/tensorboard``.

Each step is shown once after any resume: a resumed writer starts with a purge marker
(``SummaryWriter(purge_step=...)``), so TensorBoard hides what the interrupted run logged
after the resumed position; a fresh start purges from step 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..run import METRICS, read_metrics
from ..run.entries import TENSORBOARD_DIR  # the directory of the event files in the run directory

#: Record keys that say where a record is, not what was measured.
_POSITION = ("step", "epoch", "iter", "split", "time")


class TensorBoardWriter:
    """Writes each metrics record's numbers as scalars ``<split>/<name>`` at its ``step``.

    Args:
        run_dir: the run directory (events go to ``run_dir/tensorboard``).
        resumed_at: the global step a resumed run continues from; None: a fresh start.
        eval_done: the evaluation at ``resumed_at`` is in the checkpoint (it is not redone).

    The ``tensorboard`` package must be installed (:func:`~.sinks.check_available` says so first).
    """

    what = "the TensorBoard events"  # (a failed write is one warning naming it)

    def __init__(self, run_dir: Path, *, resumed_at: int | None = None, eval_done: bool = True):
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard's purge hides every event at or after purge_step; an evaluation at the resumed
        # step that is done again needs the purge there, and the kept train record re-written
        purge = 0 if resumed_at is None else resumed_at + (1 if eval_done else 0)
        self._writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR), purge_step=purge)
        if resumed_at is not None and not eval_done:
            for rec in read_metrics(Path(run_dir) / METRICS):  # (already cut at the resumed step)
                if rec.get("step") == resumed_at:
                    self.write(rec)

    def write(self, record: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` record (``split`` and ``step`` say where its scalars go)."""
        split, step = record.get("split", "train"), record.get("step", 0)
        for key, value in record.items():
            if key not in _POSITION and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"{split}/{key}", value, step)
        self._writer.flush()

    def close(self, state: str | None = None) -> None:
        self._writer.close()
