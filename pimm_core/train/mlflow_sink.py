"""``[log.mlflow]``: the metrics records as MLflow metrics of one tracked run (rank 0).

The tracked run's id is kept in ``<run_dir>/mlflow.json``: a resumed or requeued run logs
into the same MLflow run (set back to ``RUNNING``; ``FINISHED``, ``KILLED`` for a stop, or
``FAILED`` at the session's end; a session that failed while torchrun restarts the ranks,
``restarting``, leaves it ``RUNNING``: the restarted ranks continue it). The run's config and provenance are its parameters
(a parameter cannot change in MLflow: a resume adds only new keys). MLflow cannot delete a
metric point, so a resumed run does not send again a step the tracked run already has: each
step is in its history once (a step the interrupted run's background sender never delivered, even
one before a step it did deliver, is sent) (for those steps, the values the interrupted run logged; a
resume is exact, so they are the same but for the timing metrics). Metrics are sent in the
background (MLflow's asynchronous logging) and flushed at the end.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ..config import Config
from ..run import read_json, write_json
from ..run.entries import MLFLOW_ID

_POSITION = ("step", "epoch", "iter", "split", "time")
_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


class MlflowSink:
    """Sends each record's numbers as ``<split>/<name>`` at its ``step`` to one MLflow run.

    Args:
        config: the run's config (``[log.mlflow]``; the group names the default experiment).
        run_dir: where ``mlflow.json`` keeps the tracked run's id.
        resumed: a resume (continue the recorded run) or a fresh start (a new one).
        params: the run's parameters (:func:`~.sinks.run_params`).
    """

    what = "the MLflow run"  # (a failed write is one warning naming it)

    def __init__(self, config: Config, run_dir: Path, *, resumed: bool, params: dict[str, str]):
        from mlflow import MlflowClient

        c = config.log.mlflow
        self.uri = c.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self.client = MlflowClient(tracking_uri=self.uri)
        self.id_file = Path(run_dir) / MLFLOW_ID
        saved = read_json(self.id_file) if resumed else None
        # metric key -> the steps the tracked run has (a set, not the last one: MLflow's asynchronous
        # logging of a killed process can deliver step 10 and lose step 9)
        self.sent: dict[str, set[int]] = {}
        self.was: str | None = None  # the tracked run's status before this session
        if saved and saved.get("run_id"):
            self.run_id = saved["run_id"]
            run = self.client.get_run(self.run_id)
            self.was = run.info.status
            for key in run.data.metrics:
                self.sent[key] = {m.step for m in self.client.get_metric_history(self.run_id, key)}
            self.client.update_run(self.run_id, status="RUNNING")
            have = set(run.data.params)
        else:
            name = c.experiment or config.run.group
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            self.run_id = self.client.create_run(exp_id, run_name=Path(run_dir).name).info.run_id
            write_json(self.id_file, {"run_id": self.run_id, "experiment_id": exp_id, "tracking_uri": self.uri})
            have = set()
        self._params({k: v for k, v in params.items() if k not in have})

    def _params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def write(self, record: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` record (a step the tracked run already has is not sent again)."""
        from mlflow.entities import Metric

        split, step = record.get("split", "train"), int(record.get("step", 0))
        stamp = int(time.time() * 1000)
        metrics = [Metric(f"{split}/{k}", float(v), stamp, step) for k, v in record.items()
                   if k not in _POSITION and isinstance(v, (int, float)) and not isinstance(v, bool)
                   and step not in self.sent.get(f"{split}/{k}", ())]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics, synchronous=False)

    def close(self, state: str | None) -> None:
        """Flush what is still being sent and mark the tracked run with how the session ended
        (``state`` None: nothing was trained, its earlier status is put back)."""
        import mlflow

        mlflow.flush_async_logging()
        if state == "restarting":
            return  # the ranks are being restarted (pimm launch --max-restarts): the run goes on
        self.client.set_terminated(self.run_id, _STATUS.get(state or "", self.was or "KILLED"))
