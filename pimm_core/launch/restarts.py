"""The launcher's view of torchrun's restarts (``pimm launch --max-restarts K``): ``status.json`` says
``restarting`` from the moment the agent sees a failed rank with restarts left, even when the rank that
died was rank 0 (which writes the run's status, and could not say it).

The agent reports its monitoring through torch's elastic metrics API
(:mod:`torch.distributed.elastic.metrics`: ``workers.<role>.remaining_restarts`` then
``workers.<role>.<state>`` at every monitor interval, in this process); a handler of the
``torchelastic`` group turns a ``failed``/``unhealthy`` report with restarts left into
:func:`~pimm_core.run.status.mark_restarting`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from ..run.status import mark_restarting

_GROUP = "torchelastic"


@contextlib.contextmanager
def watch_restarts(run_dir: Path) -> Iterator[None]:
    """While inside, a rank failure that torchrun's agent (in this process) will restart marks the run
    ``restarting``; the previous handler of the metrics group is put back on exit."""
    from torch.distributed.elastic import metrics

    class _Handler(metrics.MetricHandler):
        remaining = 0

        def emit(self, data: metrics.MetricData) -> None:
            name = data.name.rsplit(".", 1)[-1]
            if name == "remaining_restarts":
                self.remaining = int(data.value)
            elif name in ("failed", "unhealthy") and data.value and self.remaining > 0:
                try:
                    mark_restarting(run_dir, os.getpid(), f"a rank failed; torchrun restarts the ranks "
                                                          f"({self.remaining} restart(s) left)")
                except OSError:
                    pass  # (best effort: the restarted rank 0 writes the status again)

    previous = metrics.getStream(_GROUP).handler
    metrics.configure(_Handler(), _GROUP)
    try:
        yield
    finally:
        metrics.configure(previous, _GROUP)
