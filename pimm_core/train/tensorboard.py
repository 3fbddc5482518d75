"""``log.tensorboard = true``: the metrics records also as TensorBoard scalars.

``metrics.jsonl`` stays the source the console and the tools read; the event files are a
copy for TensorBoard, written by rank 0 into ``<run_dir>/tensorboard/`` with PyTorch's
``torch.utils.tensorboard.SummaryWriter`` (which needs the ``tensorboard`` package:
``uv sync --group tensorboard`` or ``pip install tensorboard``). View them with
``tensorboard --logdir <run_dir>/tensorboard``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..run.entries import TENSORBOARD_DIR  # the directory of the event files in the run directory

#: Record keys that say where a record is, not what was measured.
_POSITION = ("step", "epoch", "iter", "split", "time")


def check_available() -> None:
    """Raises:
        ConfigError: the ``tensorboard`` package is not installed (names how to install it).
    """
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("log.tensorboard = true needs the tensorboard package, which is not installed; "
                          "install it with `uv sync --group tensorboard` (or `pip install tensorboard`), "
                          "or set log.tensorboard = false")


class TensorBoardWriter:
    """Writes each metrics record's numbers as scalars ``<split>/<name>`` at its ``step``.

    Raises:
        ConfigError: the ``tensorboard`` package is missing (:func:`check_available`).
    """

    def __init__(self, run_dir: Path):
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))

    def write(self, record: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` record (``split`` and ``step`` say where its scalars go)."""
        split, step = record.get("split", "train"), record.get("step", 0)
        for key, value in record.items():
            if key not in _POSITION and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"{split}/{key}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
