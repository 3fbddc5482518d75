"""Many runs at a glance: the run directories under a root and one summary row each (torch-free).

:func:`find_runs` walks ``ROOT`` (``exp``), ``ROOT/GROUP`` or a single run directory, two
levels deep at most (``<root>/<group>/<run>``), never following links out of it.
:func:`summarize` reads what a row shows from small files only, so a root of hundreds of
runs lists in a fraction of a second: ``status.json`` (state, step, epoch, host, world
size, heartbeat) judged live or stale by the console's rule (:func:`~.status.read_status`
with :func:`~.status.stale_after_for` of the logging interval of the newest training
records of ``metrics.jsonl``, read backwards from its end), the last training loss from
those, the best selection metric from ``model/model_best.pth.json`` (written when the
metric improves), and what a resume would load from ``last``'s manifest (the other
candidates' only when ``last`` is not complete; completeness only: ``pimm checkpoints
verify`` runs the sha256 pass).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.records.generation import GenerationChanged
from ..checkpoint.select.selection import Candidate, describe_entry, select_resume
from ..run.jsonfile import read_json
from ..run.layout import CONFIG, METRICS, MODEL, is_run_dir
from ..run.metrics import records_from_end
from ..run.status import read_run_status
from ..run.values import finite_number, json_int, json_number
from .fmt import fmt_value
from .status import LIVE_STATES, read_status, stale_after_for

#: Bytes of ``metrics.jsonl`` read at a time from its end per run (one read holds the
#: :data:`INTERVAL_RECORDS` newest training records of a typical run).
TAIL_BYTES = 8 << 10
#: The display states, in the order ``--sort state`` uses.
STATES = ("live", "restarting", "stopping", "starting", "stale", "stopped", "failed", "finished", "unknown")


@dataclass(frozen=True)
class RunRow:
    """One run's summary.

    Attributes:
        path: the run directory.
        name: ``path`` relative to the listed root (``group/run``).
        state: one of :data:`STATES`: ``live`` (training, fresh heartbeat), ``stopping`` (a stop
            requested or in progress), ``restarting`` (a rank failed; torchrun's agent starts the ranks
            again), ``starting``, ``stale`` (a live state whose process is gone
            or whose heartbeat is old), ``stopped``, ``failed``, ``finished``, ``unknown`` (no
            readable ``status.json``).
        step, total_steps, epoch, epochs: position (optimizer steps; the LR schedule's horizon).
        loss: the last logged training loss, or None (none logged, or not a finite number).
        loss_nonfinite: ``NaN``, ``inf`` or ``-inf`` when the last logged training loss was not a
            finite number (a diverged run; JSON has no such numbers, so ``loss`` is None), else None.
        best: ``{"metric": name, "value": v, "epoch": e}`` of ``model_best.pth``, or None.
        resume: the checkpoint a resume would load (``last``, ``iter_40.pth`` ...), or None.
        resume_step: its step.
        age_s: seconds since the last heartbeat (or since ``status.json`` changed).
        host, world_size: where rank 0 ran, and the number of ranks.
        note: why the run is stale or unreadable, or None.
    """

    path: str
    name: str
    state: str
    step: int | None
    total_steps: int | None
    epoch: int | None
    epochs: int | None
    loss: float | None
    best: dict[str, Any] | None
    resume: str | None
    resume_step: int | None
    age_s: float | None
    host: str | None
    world_size: int | None
    note: str | None
    loss_nonfinite: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def loss_text(self) -> str:
        """The LOSS cell of ``pimm runs ls`` and the runs view: ``%g``, ``NaN``/``inf``/``-inf``, or ``-``."""
        if self.loss_nonfinite is not None:
            return self.loss_nonfinite
        return "-" if self.loss is None else fmt_value(self.loss)


def find_runs(root: Path) -> list[Path]:
    """Run directories at ``root`` or one or two levels below it, sorted by path.

    Directories that are links are not entered; ``model/`` and the run's own subdirectories
    are never taken for runs.
    """
    root = Path(root)
    if is_run_dir(root):
        return [root]
    found: list[Path] = []

    def scan(d: Path, depth: int) -> None:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            return
        for e in entries:
            if not e.is_dir(follow_symlinks=False) or e.name.startswith("."):
                continue
            p = Path(e.path)
            if is_run_dir(p):
                found.append(p)
            elif depth < 2:
                scan(p, depth + 1)

    scan(root, 1)
    return found


def _display_state(view) -> str:
    if view.state is None:
        return "unknown"
    if view.state in ("starting", "running", "restarting", "stopping") and not view.live:
        return "stale"
    if view.display_state == "running":
        return "live"
    return view.display_state


def summarize(run_dir: Path, root: Path, *, now: float | None = None) -> RunRow:
    """The :class:`RunRow` of ``run_dir`` (never raises for missing or damaged files)."""
    now = time.time() if now is None else now
    run_dir = Path(run_dir)
    status = read_run_status(run_dir)
    # Only the newest training records: the last loss, and for a run in a live state the logging
    # interval that judges its heartbeat (a finished run's row parses one record, not 16).
    live = status.state in LIVE_STATES
    last, interval = newest_training(run_dir / METRICS, interval=live)
    view = read_status(run_dir, now=now, stale_after=stale_after_for(interval), record=status)
    rec = view.record
    age = view.heartbeat_age
    if age is None:
        try:
            age = max(0.0, now - (run_dir / "status.json").stat().st_mtime)
        except OSError:
            age = None
    best = None
    sidecar = read_json(run_dir / MODEL / "model_best.pth.json")
    selected = sidecar.get("selection_metric") if isinstance(sidecar, dict) else None
    if isinstance(selected, dict) and isinstance(selected.get("name"), str):
        # what model_best.pth was ranked by (eval.metric may have changed since: a resume that changes
        # it keeps the file until the new metric's first evaluation)
        best = {"metric": selected["name"], "value": finite_number(selected.get("value")),
                "epoch": json_int(sidecar.get("epoch"))}
    elif isinstance(sidecar, dict) and isinstance(sidecar.get("metrics"), dict):  # (a sidecar from before
        from ..config import read_saved_config  # selection_metric was recorded; the config package: only here)

        config, _ = read_saved_config(run_dir / CONFIG)
        ev = (config or {}).get("eval") if isinstance((config or {}).get("eval"), dict) else {}
        metric = ev.get("metric") if isinstance(ev.get("metric"), str) else "val/acc"
        best = {"metric": metric, "value": finite_number(sidecar["metrics"].get(metric)),
                "epoch": json_int(sidecar.get("epoch"))}
    try:
        chosen = resume_choice(run_dir / MODEL)
    except (OSError, GenerationChanged):  # (saves kept replacing `last`: no resume choice shown this time)
        chosen = None
    last = last or {}
    loss = json_number(last.get("loss"))  # (NaN and +-Inf too: a diverged run says so)
    name = run_dir.relative_to(root).as_posix() if run_dir != root and root in run_dir.parents else run_dir.name
    return RunRow(
        path=str(run_dir), name=name, state=_display_state(view), step=rec.step, total_steps=rec.total_steps,
        epoch=rec.epoch, epochs=rec.epochs, loss=finite_number(loss), best=best,
        resume=chosen.name if chosen else None, resume_step=chosen.step if chosen else None,
        age_s=None if age is None else round(age, 1), host=rec.host, world_size=rec.world_size,
        note=view.note or view.problem,
        loss_nonfinite=None if loss is None or finite_number(loss) is not None else fmt_value(loss))


def resume_choice(model: Path) -> Candidate | None:
    """What :func:`~pimm_core.checkpoint.select.selection.select_resume` (``verify=False``) chooses in
    ``model``, reading only ``last`` when it is complete (it comes first in the resume order):
    not every snapshot's manifest, as a listing of ``model/`` would."""
    if not model.is_dir():
        return None
    last = describe_entry(model / "last", sized=False)  # (a row shows no size)
    if last is not None and last.complete and last.resumable:
        return last
    return select_resume(model, verify=False)[0]


#: How many of the newest training records give the logging interval (their median gap).
INTERVAL_RECORDS = 16


def newest_training(path: Path, *, interval: bool = True) -> tuple[dict[str, Any] | None, float | None]:
    """``(record, interval)``: the newest training record of a ``metrics.jsonl`` and the median
    seconds between its newest :data:`INTERVAL_RECORDS` training records (None: unknown), read
    backwards from its end (:data:`TAIL_BYTES` at a time) and stopping there: what a row costs
    does not grow with the file. ``interval=False``: the newest record only (interval None)."""
    newest: dict[str, Any] | None = None
    times: list[float] = []
    for rec in records_from_end(path, block=TAIL_BYTES):
        if rec is None or rec.get("split", "train") != "train":
            continue
        newest = newest or rec
        if not interval:
            break
        t = finite_number(rec.get("time"))
        if t is not None:
            times.append(t)
        if len(times) >= INTERVAL_RECORDS:
            break
    gaps = sorted(a - b for a, b in zip(times, times[1:]) if a > b)
    return newest, (gaps[len(gaps) // 2] if gaps else None)


def sort_rows(rows: list[RunRow], key: str) -> list[RunRow]:
    """``rows`` ordered by ``key``: ``name``, ``age`` (newest first), ``state`` (:data:`STATES` order),
    ``step`` (highest first) or ``best`` (highest first; runs without one last)."""
    if key == "age":
        return sorted(rows, key=lambda r: (r.age_s is None, r.age_s or 0.0))
    if key == "state":
        return sorted(rows, key=lambda r: (STATES.index(r.state), r.name))
    if key == "step":
        return sorted(rows, key=lambda r: (r.step is None, -(r.step or 0), r.name))
    if key == "best":
        return sorted(rows, key=lambda r: (r.best is None or r.best["value"] is None,
                                           -((r.best or {}).get("value") or 0.0), r.name))
    return sorted(rows, key=lambda r: r.name)
