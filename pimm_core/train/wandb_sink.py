"""``[log.wandb]``: the metrics records as the history of one Weights & Biases run (rank 0).

The W&B run's id is kept in ``<run_dir>/wandb.json``: a resumed or requeued run continues the
same W&B run (``wandb.init(id=..., resume="allow")``). W&B's files go under ``WANDB_DIR`` when
it is set, else under the run directory (``<run_dir>/wandb/``), so pimm writes nothing outside
the run directory unless told to. The run's config (nested tables, typed values) and its
provenance (``provenance.*``) are the W&B run's config.

A W&B history cannot be cut back (``resume_from`` needs the server, and does not work offline),
so after a resume each step is logged once this way: pimm reads which steps W&B already holds
for the run (the run's ``.wandb`` transaction logs, read with W&B's own reader
``wandb leet inspect --json``; online, also the step the server reports), sends again from
``metrics.jsonl`` the steps up to the resumed position that W&B lost (an offline run killed
before W&B flushed its file loses the unflushed part: W&B writes it every 15 s), and then
sends only the records of steps W&B does not hold yet. For a step the interrupted run had
already sent past the resumed position, W&B keeps the values that run logged (a resume is
exact: the same values, but for the timing metrics).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from ..config import Config
from ..run import METRICS, read_json, read_metrics, write_json
from ..run.entries import WANDB_ID

log = logging.getLogger("pimm")

_POSITION = ("step", "epoch", "iter", "split", "time")
_EXIT = {"finished": 0, "stopped": 0, "failed": 1}


def session_logs(wandb_dir: Path, run_id: str) -> list[Path]:
    """The transaction log of each W&B session of run ``run_id`` under ``<wandb_dir>/wandb/``, by
    name: a session's directory is ``<mode>-run-<time>-<id>``, or ``...-<id>-<n>`` when it started in
    the same second as an earlier session of the run (a quick resume); both hold steps W&B has."""
    session = re.compile(rf".*-{re.escape(run_id)}(-\d+)?")
    return sorted(f for f in Path(wandb_dir).glob(f"wandb/*-{run_id}*/run-{run_id}.wandb")
                  if session.fullmatch(f.parent.name))


def logged_steps(wandb_dir: Path, run_id: str) -> list[int]:
    """The history steps W&B's local transaction logs of run ``run_id`` hold, in file order
    (``<wandb_dir>/wandb/*-<run_id>[-<n>]/run-<run_id>.wandb``, read with ``wandb leet inspect --json``:
    a file cut short by a kill is read up to its last complete record).

    Raises:
        OSError: W&B's reader could not be run or failed on a file (its message says why).
    """
    steps: list[int] = []
    for f in session_logs(wandb_dir, run_id):
        r = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(f)],
                           capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise OSError(f"`wandb leet inspect --json {f}` failed: {(r.stderr or r.stdout).strip()[-300:]}")
        for line in r.stdout.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("type") == "history":
                steps.append(int(rec["history"].get("step", {}).get("num", 0)))
    return steps


class WandbSink:
    """Sends each record's numbers as ``<split>/<name>`` at its ``step`` to one W&B run (a
    train and an eval record of the same step are one W&B history row).

    Args:
        config: the run's config (``[log.wandb]``; the group names the default project).
        run_dir: where ``wandb.json`` keeps the W&B run's id (and, without ``WANDB_DIR``, W&B's files).
        resumed_at: the global step a resumed run continues from; None: a fresh start (a new W&B run).
        run_config: the W&B run's config (the run's config and provenance).
    """

    what = "the W&B run"  # (a failed write is one warning naming it)

    def __init__(self, config: Config, run_dir: Path, *, resumed_at: int | None, run_config: dict[str, Any]):
        import wandb

        c, run_dir = config.log.wandb, Path(run_dir)
        self.id_file = run_dir / WANDB_ID
        saved = read_json(self.id_file) if resumed_at is not None else None
        run_id = saved.get("run_id") if saved else None
        root = Path(os.environ.get("WANDB_DIR") or run_dir)
        self.floor = -1  # the last step W&B holds: only later steps are sent
        if run_id:
            try:
                self.floor = max(logged_steps(root, run_id), default=-1)
            except (OSError, subprocess.TimeoutExpired) as e:  # assume W&B holds what was logged up to the
                self.floor = resumed_at or 0  # resumed position (nothing is sent twice but what came after it)
                log.warning("warning: cannot read which steps the W&B run %s holds (%s); the steps after step %d "
                            "the interrupted run logged may be in it twice", run_id, e, self.floor)
        else:
            run_id = uuid.uuid4().hex[:12]  # (W&B: letters and digits, unique in the project)
            write_json(self.id_file, {"run_id": run_id})
        root.mkdir(parents=True, exist_ok=True)
        # console="off": pimm's terminal and train.log stay its own (W&B would wrap stdout/stderr)
        self.run = wandb.init(id=run_id, resume="allow", project=c.project or config.run.group,
                              entity=c.entity or None, mode=c.mode or None, dir=str(root), name=run_dir.name,
                              config=run_config, allow_val_change=True, settings=wandb.Settings(console="off"))
        if self.run.resumed:  # online: the server's next step (what it holds, even if the local files are gone)
            self.floor = max(self.floor, self.run.step - 1)
        if resumed_at is not None:  # the steps up to the resumed position W&B does not hold (metrics.jsonl
            for rec in read_metrics(run_dir / METRICS):  # is already cut there)
                self.write(rec)

    def write(self, record: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` record (a step W&B already holds is not sent again)."""
        split, step = record.get("split", "train"), int(record.get("step", 0))
        if step <= self.floor:
            return
        data = {f"{split}/{k}": v for k, v in record.items()
                if k not in _POSITION and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if data:
            self.run.log(data, step=step)

    def close(self, state: str | None) -> None:
        """Finish the W&B run (flushes its files): exit code 0 for a finished or stopped session
        (a stop is marked preempting: the run resumes later), 1 for a failed one; a session that failed
        while torchrun restarts the ranks (``restarting``) is marked preempting with exit code 0: the
        restarted ranks continue the W&B run."""
        if state in ("stopped", "restarting"):
            self.run.mark_preempting()
        self.run.finish(exit_code=_EXIT.get(state or "", 0))
