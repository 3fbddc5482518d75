"""Resume: restore a run's state from a checkpoint, following the resume policy.

:func:`resume` picks the intact candidate (sha256 verified on rank 0, the verdict
broadcast), loads it into the trainer's model and optimizer, applies the policy row of
:func:`pimm_core.run.topology.plan_resume` (cursor and RNG restored or discarded, the replay
boundary), restores the schedule, scaler, EMA and best-metric state, applies schedule
overrides and the new LR horizon, and returns the ``provenance.json`` entry.
"""

from __future__ import annotations

import dataclasses

import logging
import math
import os
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint.formats.choose import make_format
from ..checkpoint.formats.optim_structure import apply_built_hyperparameters
from ..checkpoint.select.branch import set_aside_later
from ..checkpoint.select.resume_path import resolve_resume_path
from ..checkpoint.select.selection import is_model_dir, select_verified, verify_candidate
from ..checkpoint.tensors.state import set_rng_state, unwrap
from ..config import TrainConfig
from ..data.global_order import running_stats_warning
from ..errors import CheckpointError
from ..process import dist
from ..run import CONFIG, METRICS, read_json, read_run_status
from ..run.metrics import MAX_LINE, records_from_end
from ..run.topology import config_diff, is_finished, plan_resume
from ..run.values import json_number
from .build import data_length
from .loadable import stateful_objective
from .schedule import WarmupCosine

if TYPE_CHECKING:
    from .host import TrainerHost

log = logging.getLogger("pimm")


def resume(tr: TrainerHost, source: Path | str, checkpoint_dir: Path | None) -> dict[str, Any]:
    """Restore state from ``source`` following the resume policy; returns the provenance entry."""
    cand, fallback, set_aside = choose_intact(tr, Path(str(source)) if not str(source).startswith("hf://") else source,
                                              checkpoint_dir)
    strict = tr.config.resume_strict_state
    # Under TP the ranks of one group saved the same cursor and RNG: each rank reads those of
    # the first rank of its data-parallel rank's group in the saved layout (topology.py)
    saved_tp = int((cand.manifest or {}).get("tp") or 1)
    source = tr.data_info.rank * saved_tp if max(saved_tp, tr.info.tp) > 1 else tr.info.rank
    loaded = make_format(cand.format, dataclasses.replace(tr.info, rank=source)).load(Path(cand.path), model=tr.model, optimizer=tr.optimizer,
                                                    strict=strict, ema_target=tr.ema.shadow if tr.ema else None)
    return apply_loaded(tr, loaded, cand.manifest or {}, str(cand.path), cand.format, checkpoint_dir,
                        fallback=fallback, set_aside=set_aside)


def apply_loaded(tr: TrainerHost, loaded: Any, recorded: dict[str, Any], path: str, fmt: str,
                 checkpoint_dir: Path | None, *, fallback: list[str] = (), set_aside: Any = list) -> dict[str, Any]:
    """Apply a loaded checkpoint (``loaded``: its :class:`~pimm_core.checkpoint.formats.protocol.LoadedState`,
    the model and optimizer already restored) following the resume policy: position, schedule, scaler,
    EMA, callbacks, RNG and loader cursor; returns the provenance entry. ``recorded``: its manifest;
    ``path``: what the log names; ``fmt``: its format's name (``memory`` for the memory tier)."""
    fallback = list(fallback)
    strict = tr.config.resume_strict_state
    meta = loaded.meta
    saved = meta["trainer"]
    # The file itself is the authority on position and topology (a sidecar may be missing).
    manifest = {**recorded, "step": saved["global_step"], "epoch": saved["epoch"], "iter": saved["iter"],
                "world_size": meta["world_size"], "workers_per_rank": meta["workers_per_rank"]}
    if fmt == "single":
        manifest["has_loader_state"] = bool(loaded.rank_state and loaded.rank_state.get("loader") is not None) \
            if meta["world_size"] == tr.info.world_size else saved["iter"] > 0
    # (absent from older checkpoints)
    for key in ("batch_size", "grad_accum", "epoch_start_step", "data_length", "data_fingerprint", "data_order",
                "global_batch", "tp"):
        if meta.get(key, saved.get(key)) is not None:
            manifest[key] = meta.get(key, saved.get(key))
    plan = plan_resume(manifest, world_size=tr.info.world_size, strategy=tr.config.train.strategy,
                       workers_per_rank=tr.config.data.num_workers,
                       strict=strict, grad_accum=tr._t.grad_accum, batch_size=tr.config.data.batch_size,
                       legacy=fmt == "legacy", data_length=data_length(tr.data.train),
                       data_fingerprint=tr.data.fingerprint, order=tr.config.data.order,
                       global_batch=tr.config.train.global_batch, tp=tr.config.parallel.tp)
    warnings = fallback + list(plan.warnings) + provenance_diff(tr, manifest) + loaded.skipped
    if plan.row == "global_order" and manifest["world_size"] != tr.info.world_size:
        warnings += running_stats_warning(unwrap(tr.model))
    tr.state.load_state_dict(saved, epoch_start_step=plan.step if plan.iter == 0 else 0)
    tr.best.load_state_dict(saved)
    rebased = tr.best.rebase(tr.state.best_of or _best_sidecar_of(checkpoint_dir))
    if rebased is not None:
        tr.state.best_metric = tr.state.best_epoch = tr.state.best_of = None
        warnings.append(rebased)
    tr.callbacks.load_state_dict(meta.get("callbacks"))  # (None: a checkpoint from before callbacks)
    if meta.get("objective") is not None and stateful_objective(tr.objective) is not None:
        stateful_objective(tr.objective).load_state_dict(meta["objective"])
    tr.scheduler.load_state_dict(meta["scheduler"])
    if meta.get("scaler"):
        tr.scaler.load_state_dict(meta["scaler"])
    if tr.ema is not None:
        ema_meta = meta.get("ema")
        if loaded.ema_state_dict is not None and ema_meta:
            tr.ema.load(loaded.ema_state_dict, ema_meta["updates"])
        else:
            tr.ema.restart(unwrap(tr.model))
            warnings.append("the checkpoint has no EMA weights; EMA restarts from the restored raw weights")
    rank_state = loaded.rank_state or {}
    if plan.restore_rng:
        if "rng" in rank_state:
            set_rng_state(rank_state["rng"])
        else:
            warnings.append(f"rank {tr.info.rank} has no saved RNG state; its RNG starts from the seed")
    if plan.row == "global_order":  # the samples consumed, in micro-batches of the new window
        tr.state.iter = plan.iter
    elif plan.restore_cursor:
        tr._pending_loader_state = rank_state.get("loader")
    elif plan.replay_boundary is not None:
        tr.state.global_step = tr.state.epoch_start_step = plan.step
        tr.state.iter = 0
    own = isinstance(tr.scheduler, WarmupCosine)  # a [scheduler] target's schedule is all its own
    if own:
        tr.scheduler.set_step(tr.state.global_step)
    warnings += check_against_metrics(tr) if own else []
    notes = apply_built_hyperparameters(tr.optimizer, meta.get("optimizer_built"), tr.checkpointer.optimizer_built,
                                        tr.state.global_step)
    notes += apply_schedule_overrides(tr) + retarget_schedule(tr) if own else []
    if tr.info.is_main:
        for n in notes:
            log.info("%s", n)
        log.info("resuming from %s at step %d, epoch %d, iter %d: %s", path, tr.state.global_step,
                 tr.state.epoch, tr.state.iter, plan.description)
        for w in warnings[len(fallback):]:  # the fallback lines were logged as errors when chosen
            log.warning("warning: %s", w)
    # the resume is accepted and its state applied: only now is anything in the run directory changed
    # (a refused or failed resume leaves it as it was)
    warnings += set_aside()
    return {"kind": "resume", "checkpoint": path, "checkpoint_step": manifest.get("step"),
            "step": tr.state.global_step, "epoch": tr.state.epoch, "iter": tr.state.iter,
            "policy": plan.row, "exact": plan.exact, "topology": plan.topology,
            "replay_boundary": plan.replay_boundary, "restored": plan.restored, "discarded": plan.discarded,
            "warnings": warnings, "schedule": notes, "checkpoint_dir": str(checkpoint_dir) if checkpoint_dir else None}

def _best_sidecar_of(checkpoint_dir: Path | None) -> dict[str, Any] | None:
    """What ``model_best.pth`` was ranked by (its sidecar's ``selection_metric``), for a checkpoint
    from before the trainer state recorded it; None when unknown."""
    if checkpoint_dir is None:
        return None
    sel = (read_json(Path(checkpoint_dir) / "model_best.pth.json") or {}).get("selection_metric")
    return sel if isinstance(sel, dict) else None


def nothing_left(tr: TrainerHost, t: TrainConfig) -> bool:
    """The restored position reached ``t``'s end (all epochs, or ``t.max_steps``) and the run
    recorded that it finished (:func:`pimm_core.run.topology.is_finished`): nothing to train."""
    state = read_run_status(tr.run_dir).state if tr.run_dir is not None else None
    s = tr.state
    return is_finished({"step": s.global_step, "epoch": s.epoch}, epochs=t.epochs, max_steps=t.max_steps,
                       run_state=state)


def choose_intact(tr: TrainerHost, source: Path | str, checkpoint_dir: Path | None = None):
    """Resolve the resume source and check its files against the manifest (rank 0 reads,
    every rank gets the verdict). A ``model/`` directory falls back past corrupt
    candidates with a warning; an explicitly named corrupt candidate is refused. An explicit
    earlier checkpoint of ``checkpoint_dir`` (``full_<step>``) branches the run: the later ones
    are set aside (:func:`pimm_core.checkpoint.select.branch.set_aside_later`), with a warning.

    Raises:
        CheckpointError: nothing intact to resume from (names each problem).
    """
    verdict: tuple[str | None, list[str], Any] = (None, [], None)
    aside: Any = list
    if tr.info.is_main:
        try:
            if isinstance(source, Path) and is_model_dir(source):
                chosen, warnings = select_verified(source)
                if chosen is None:
                    detail = "; ".join(warnings) or "no complete candidate"
                    raise CheckpointError(f"no intact checkpoint to resume in {source}: {detail}", exit_code=1)
                aside = lambda: set_aside_corrupt_last(source, chosen)  # noqa: E731
                verdict = (chosen.path, warnings, None)
            else:
                cand = resolve_resume_path(source)
                problems = verify_candidate(cand)
                if problems:
                    raise CheckpointError(f"checkpoint {cand.path} is corrupt ({'; '.join(problems)}); resume "
                                          "from another candidate (see pimm checkpoints ls)", exit_code=1)
                # an earlier point of this run's own line: the later checkpoints are set aside
                if checkpoint_dir is not None and Path(cand.path).parent.resolve() == Path(checkpoint_dir).resolve():
                    aside = lambda: _set_aside_later(cand)  # noqa: E731
                verdict = (cand.path, [], None)
        except CheckpointError as e:
            verdict = (None, [], e)  # PimmError pickles with its class and exit code
    path, warnings, error = dist.broadcast_object(verdict)
    if error is not None:
        raise error
    if tr.info.is_main:
        for w in warnings:
            log.error("ERROR: %s", w)

    def set_aside() -> list[str]:
        """Rank 0, once the checkpoint loaded: move aside what the choice supersedes; the notes, on every rank."""
        outcome: tuple[list[str], Any] = ([], None)
        if tr.info.is_main:
            try:
                outcome = (aside(), None)
            except CheckpointError as e:
                outcome = ([], e)
            except OSError as e:  # (renaming the corrupt `last` aside)
                outcome = ([], CheckpointError(f"cannot move aside a checkpoint of {path}'s run: {e}"))
        notes, failure = dist.broadcast_object(outcome)
        if failure is not None:
            raise failure
        if tr.info.is_main:
            for n in notes:
                log.warning("warning: %s", n)
        return notes

    return resolve_resume_path(path), warnings, set_aside


def _set_aside_later(cand: Any) -> list[str]:
    try:
        return set_aside_later(cand)
    except OSError as e:
        raise CheckpointError(f"cannot set aside the checkpoints after {cand.path}: {e}") from None


def set_aside_corrupt_last(model_dir: Path, chosen) -> list[str]:
    """Rank 0, resuming from another candidate (``last.prev``, a kept ``full_<step>``) because ``last``
    failed verification: rename the corrupt ``last`` to ``last.corrupt-<time>`` (kept for
    inspection; selection ignores it).

    Otherwise the next save's rotation would remove the intact ``last.prev`` to make room for
    the corrupt ``last``, and a crash in between would leave nothing to resume from.
    """
    last = model_dir / "last"
    if chosen.name == "last" or not last.is_dir():
        return []
    dest = model_dir / f"last.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
    os.rename(last, dest)
    return [f"moved the corrupt {last} to {dest} (kept for inspection; nothing was deleted)"]


def apply_schedule_overrides(tr: TrainerHost) -> list[str]:
    """Apply this config's schedule and optimizer keys to the restored state; one line each.

    The checkpoint restores the saved base LR, floor, warmup and kind, and the saved
    optimizer hyper-parameters. A resume whose config changes any of them gets the new
    value from the resume step on (the LR may jump there, as asked).
    """
    t, sch = tr._t, tr.scheduler
    step = tr.state.global_step
    notes: list[str] = []
    named = tr.config.scheduler.name is not None  # [scheduler] name: its kind is not train.scheduler
    ratio = t.min_lr / t.lr if t.lr else 0.0
    saved_lr = sch.base_lrs[0]
    if not math.isclose(saved_lr, t.lr, rel_tol=1e-12, abs_tol=0.0):
        sch.base_lrs = [t.lr for _ in sch.base_lrs]
        notes.append(f"train.lr changed {saved_lr:g} -> {t.lr:g} on resume: applied from step {step}")
    saved_min = saved_lr * sch.min_ratio
    if not math.isclose(saved_min, t.min_lr, rel_tol=1e-9, abs_tol=1e-30):
        notes.append(f"train.min_lr changed {saved_min:g} -> {t.min_lr:g} on resume: applied from step {step}")
    sch.min_ratio = ratio  # the floor stays min_lr whatever the base LR
    for key, attr in (("warmup_steps", "warmup"), ("scheduler", "kind")):
        value = tr.config.scheduler.name if key == "scheduler" and named else getattr(t, key)
        if getattr(sch, attr) != value:
            name = "scheduler.name" if key == "scheduler" and named else f"train.{key}"
            notes.append(f"{name} changed {getattr(sch, attr)!r} -> {value!r} on resume: applied from step {step}")
            setattr(sch, attr, value)
    # (every other hyperparameter of the optimizer's groups: optim_structure.apply_built_hyperparameters)
    if notes:
        sch.set_step(step)
    return notes

def retarget_schedule(tr: TrainerHost) -> list[str]:
    """Move the LR schedule's horizon to the step this resume will really end at."""
    sch, step = tr.scheduler, tr.state.global_step
    before, end = sch.total, tr.end_step(tr._t)
    if before == end:
        return []
    sch.retarget(step, end)
    sch.set_step(step)
    lr = sch.get_last_lr()[0]
    then = "stays constant" if sch.kind == "constant" else f"decays to train.min_lr {tr._t.min_lr:g} at step {end}"
    return [f"LR schedule horizon moved from step {before} to step {end} (where this resume ends): "
            f"LR {lr:.6e} at step {step} is kept and {then}"]

def provenance_diff(tr: TrainerHost, manifest: dict[str, Any]) -> list[str]:
    """Warnings for config, code, data and torch differences from the checkpoint's run."""
    out = []
    if tr.run_dir is not None and (tr.run_dir / CONFIG).is_file():
        try:
            saved = tomllib.loads((tr.run_dir / CONFIG).read_text())
        except (OSError, tomllib.TOMLDecodeError):
            saved = None
        diff = config_diff(saved, tr.config.to_dict()) if saved is not None else ["saved config.toml unreadable"]
        if diff:
            out.append("config differs from the interrupted run: " + "; ".join(diff))
    for key, now in (("data_fingerprint", tr.data.fingerprint), ("code_version", tr._code_version),
                     ("torch_version", torch.__version__)):
        then = manifest.get(key)
        if then is not None and now is not None and then != now:
            out.append(f"{key} differs: checkpoint {then}, now {now}")
    return out

def check_against_metrics(tr: TrainerHost) -> list[str]:
    """Compare the restored step and LR schedule with the log of the interrupted run.

    The last train record at or before the restored step must carry the LR this
    config's schedule gives for that step; otherwise the resumed schedule differs.
    """
    if tr.run_dir is None or not tr.info.is_main:
        return []
    step = tr.state.global_step
    last, damaged = None, 0
    for r in records_from_end(tr.run_dir / METRICS):  # newest first: stops at the record it needs
        if r is None:
            damaged += 1
        elif r.get("split") == "train" and type(r.get("step")) is int and r["step"] <= step:
            last = r
            break
    warnings = [f"metrics.jsonl: {damaged} damaged line(s) skipped (not a JSON object, nested too deeply, or "
                f"longer than {MAX_LINE} bytes)"] if damaged else []
    if last is None:
        return warnings + ([f"metrics.jsonl has no train record up to step {step}; cannot check the resumed "
                            "schedule"] if step else [])
    sch = tr.scheduler
    expected = sch.base_lrs[0] * sch.logged_factor(last["step"])
    logged = json_number(last.get("lr"))
    logged = float("nan") if logged is None else logged
    log.info("resume check: restored step %d, next lr %.6e; log before interruption: step %d lr %.6e "
             "(this schedule: %.6e)", step, sch.get_last_lr()[0], last["step"], logged, expected)
    if not math.isclose(expected, logged, rel_tol=1e-6, abs_tol=1e-12):
        return warnings + [f"LR schedule differs from the interrupted run: at step {last['step']} the log says "
                           f"{last.get('lr')}, this config gives {expected}"]
    return warnings
