"""What a checkpoint recorded vs. what a resume will run with, and the policy that follows.

The resume policy, one row per condition (checked in this order)::

    legacy mid-epoch checkpoint            no structured cursor; replay from an epoch boundary
    resume_strict_state=False              best-effort state restore; loader cursor skipped
    the optimizer's structure changes      refused before anything is loaded or written
    world size changes                     reshard compatible state (DCP); discard loader cursor
                                           and per-rank RNG; restart the saved epoch
    per-rank micro-batch size changes      discard loader cursor; restart the saved epoch
    accumulation window changes            discard loader cursor; restart the saved epoch
    per-rank worker count changes          discard loader cursor; restart the saved epoch
    the training data changed              discard loader cursor; restart the saved epoch
    checkpoint has no loader state         restart the saved epoch
    strategy changes (ddp <-> fsdp) alone  reshard model, optimizer and EMA exactly (DCP); keep loader
                                           cursor and per-rank RNG; continue from the saved iteration
    layout changes (parallel.tp, and the   reshard model, optimizer and EMA exactly (DCP); keep each
    world size with it) at the same number data-parallel rank's loader cursor and RNG; continue from
    of data-parallel ranks                 the saved iteration
    same world size, strategy, batching,   restore cursor; continue from the saved iteration
    workers

Under the global data order (``data.order = "global"``, saved and planned, with the same
``train.global_batch`` and micro-batch size, the same data, strict state) the batching does not
depend on the ranks (:mod:`pimm_core.data.global_order`), so a change of world size, window, workers
or strategy is the ``global_order`` row, checked right after ``non_strict``: keep the cursor
(the samples consumed, from the counters), derive the window, continue from the saved
iteration; nothing replays; the same trajectory up to the order of floating-point additions.
A change of the order itself (or of ``train.global_batch``) is the ``order`` row.

A strategy change (``train.strategy``; a manifest without ``strategy`` counts as ``ddp``)
discards nothing by itself: the sample order (``DistributedSampler`` over rank and world
size) and each rank's RNG streams do not depend on how ranks share the model, so at the
same world size the cursor and RNG carry over. It is not promised bitwise (gradients are
reduced another way), so the plan is not ``exact``. Under any earlier row (a world-size,
batching or worker change...) that row's rules apply, and the strategy change is named
as well: in ``topology`` (``saved_strategy`` -> ``strategy``) and in a warning.

"Restart the saved epoch" means the in-epoch iteration and the global-step view go
back to the saved epoch's start (the *replay boundary*); batches already trained in
that epoch train again. The boundary's global step is the one recorded when the saved
epoch began (``epoch_start_step``), never re-derived from the new batching: a cursor
counted in micro-batches of another size or window means nothing to the new loader. That is recovery, not bitwise continuation, and it is
logged and recorded in ``provenance.json``. A checkpoint taken at an epoch end has
nothing to replay, so every row continues exactly at the next epoch's first batch
(up to the changed sample order and RNG streams of a new topology).

The training data is compared by its length (``data_length``: the train split's ``len``; not
recorded for a stream, whose ``__len__`` is per rank) and, when the dataset gives one, its fingerprint (``data_fingerprint``).
A loader cursor is a position in the permutation of the data it was saved for: applied to
data of another length it would skip samples, or run past the end. So when either differs
(both sides known) the cursor is never applied: the saved epoch restarts from its start,
over the new data, with a warning. Checkpoints that did not record a length (older ones)
and datasets without a fingerprint are compared by what is known, and resume as before.

Under tensor parallel (``parallel.tp = T``) the ``T`` ranks of one group read the same
batches, so every row above compares *data-parallel* ranks (world size / ``T``): "world
size changes" means the number of data-parallel ranks changed (the LR horizon follows the
new steps per epoch, as for any world-size change). A change of ``T`` that keeps them (tp 2
on 2 ranks -> 1 rank; FSDP 2 x TP 2 on 4 ranks -> FSDP on 2) is the ``layout`` row: the state
is resharded by DCP and each data-parallel rank continues from its saved cursor and RNG
(read from the first rank of its saved group); not promised bitwise (the layers' sums are
reduced another way). A manifest without ``tp`` was written at ``tp = 1``.

Torch-free: ``--dry-run``, ``pimm checkpoints diff`` and the console use it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..data.global_order import window_of

ROWS = {
    "same": "same world size, strategy, per-rank micro-batch, accumulation window and per-rank workers: restore cursor; continue from the saved iteration",
    "global_order": "global data order, world size (or window, workers, strategy) changes: keep the cursor (samples consumed), derive the window, continue from the saved iteration; nothing replayed; the same trajectory up to the order of floating-point additions",
    "order": "data order (data.order or train.global_batch) changes: discard loader cursor, restart the saved epoch",
    "strategy": "strategy changes at the same world size (ddp <-> fsdp): reshard model, optimizer and EMA state exactly (DCP); keep loader cursor and per-rank RNG; continue from the saved iteration",
    "layout": "parallel layout changes (parallel.tp, with the strategy or world size) at the same number of data-parallel ranks: reshard model, optimizer and EMA state exactly (DCP); keep each data-parallel rank's loader cursor and RNG; continue from the saved iteration",
    "world_size": "world size changes: reshard compatible state, discard loader cursor, restart the saved epoch",
    "batch_size": "per-rank micro-batch size changes: discard loader cursor, restart the saved epoch",
    "grad_accum": "accumulation window changes: discard loader cursor, restart the saved epoch",
    "workers": "per-rank worker count changes: discard loader cursor, restart the saved epoch",
    "data": "the training data changed (its length or fingerprint): discard loader cursor, restart the saved epoch",
    "no_loader_state": "checkpoint has no loader state: restart the saved epoch",
    "non_strict": "resume_strict_state=False: best-effort state restore; loader cursor skipped",
    "optimizer": "the optimizer's structure changes (its class, its parameter groups, or the parameters in a group): refused in one line before anything is loaded or written; with resume_strict_state=false (the row above) the optimizer starts fresh instead",
    "legacy": "legacy mid-epoch checkpoint: no structured cursor; replay from an epoch boundary",
}


@dataclass
class ResumePlan:
    """The decision for one resume.

    Attributes:
        row: key of :data:`ROWS` that applies.
        restore_cursor: apply each rank's saved loader cursor.
        restore_rng: apply each rank's saved RNG state (same ranks only).
        exact: bitwise continuation is expected.
        step, epoch, iter: where training continues (after any replay reset).
        replay_boundary: ``{"epoch", "step", "from_iter"}`` when completed batches will
            train again, else None.
        restored, discarded: human lists of state parts.
        warnings: lines for the log and provenance.
        topology: saved vs. planned world size, strategy (``"ddp"``/``"fsdp"``), per-rank
            workers, per-rank micro-batch size and accumulation window (``saved_<key>`` and ``<key>``).
    """

    row: str
    restore_cursor: bool
    restore_rng: bool
    exact: bool
    step: int
    epoch: int
    iter: int
    replay_boundary: dict[str, int] | None
    restored: list[str]
    discarded: list[str]
    warnings: list[str] = field(default_factory=list)
    topology: dict[str, Any] = field(default_factory=dict)

    @property
    def description(self) -> str:
        return ROWS[self.row]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "description": self.description}


# Topology keys a manifest records, in the order the policy checks them (after world size).
BATCHING_KEYS = ("batch_size", "grad_accum")


def replay_step(manifest: dict[str, Any], grad_accum: int) -> int:
    """Global step at which the checkpoint's epoch began (its replay boundary).

    Read from the manifest's ``epoch_start_step``; checkpoints written before pimm
    recorded it fall back to ``step - iter // saved grad_accum`` (saves happen at
    window ends, so that is exact when the saved window is known).
    """
    if manifest.get("epoch_start_step") is not None:
        return int(manifest["epoch_start_step"])
    step, it = int(manifest.get("step", 0)), int(manifest.get("iter", 0))
    return step - it // int(manifest.get("grad_accum") or grad_accum)


def plan_resume(manifest: dict[str, Any], *, world_size: int, strategy: str, workers_per_rank: int, strict: bool,
                grad_accum: int = 1, batch_size: int | None = None, legacy: bool = False,
                data_length: int | None = None, data_fingerprint: str | None = None,
                order: str = "rank", global_batch: int | None = None, optimizer_changed: bool = False,
                tp: int = 1) -> ResumePlan:
    """Apply the resume policy to a checkpoint's manifest.

    Args:
        manifest: the checkpoint's manifest (``step``, ``epoch``, ``iter``, ``world_size``,
            ``strategy``, ``workers_per_rank``, ``batch_size``, ``grad_accum``,
            ``epoch_start_step``, ``has_loader_state``). Keys an older checkpoint lacks count
            as unchanged, except ``strategy``: a checkpoint written before pimm recorded it
            was trained with DDP (``"ddp"``).
        world_size, workers_per_rank: the planned resume topology.
        strategy: the planned ``train.strategy`` (``"ddp"`` or ``"fsdp"``).
        strict: ``resume_strict_state``.
        grad_accum: planned micro-batches per optimizer step.
        batch_size: planned per-rank micro-batch size (None: not compared).
        legacy: the checkpoint is a legacy single file (no structured cursor).
        data_length, data_fingerprint: the planned train split's length and fingerprint (None:
            not known, not compared), against the manifest's ``data_length`` and
            ``data_fingerprint``.
        optimizer_changed: the planned optimizer's class or parameter groups differ from the saved
            one's (:func:`pimm_core.checkpoint.formats.optim_structure.structure_problem`): the ``optimizer`` row,
            which the load refuses (strict), before anything is loaded.
        order, global_batch: the planned ``data.order`` and ``train.global_batch``, against the
            manifest's ``data_order`` (absent: ``"rank"``) and ``global_batch``; under the global
            order ``grad_accum`` is derived here for ``world_size``.
        tp: the planned ``parallel.tp``, against the manifest's ``tp`` (absent: 1); the data
            decisions compare data-parallel ranks (``world_size // tp``).

    Raises:
        ConfigError: the global order with a ``global_batch`` that ``world_size`` ranks cannot share.
    """
    saved_order = (str(manifest.get("data_order") or "rank"), manifest.get("global_batch"))
    step, epoch, it = int(manifest.get("step", 0)), int(manifest.get("epoch", 0)), int(manifest.get("iter", 0))
    saved_tp = max(1, int(manifest.get("tp") or 1))
    layout_changed = saved_tp != tp
    # Below, "world size" is the number of data-parallel ranks (all ranks without TP); the
    # processes themselves are reported in the topology.
    saved_procs, procs = int(manifest.get("world_size", world_size)), world_size
    saved_ws, world_size = max(1, saved_procs // saved_tp), max(1, world_size // max(1, tp))
    if order == "global":
        grad_accum = window_of(int(global_batch or 0), int(batch_size or manifest.get("batch_size") or 1), world_size)
    saved_strategy = str(manifest.get("strategy") or "ddp")
    strategy_changed = saved_strategy != strategy
    saved_workers = int(manifest.get("workers_per_rank", workers_per_rank))
    has_loader = bool(manifest.get("has_loader_state", it > 0)) and not legacy
    planned = {"batch_size": batch_size, "grad_accum": grad_accum}
    saved = {k: manifest.get(k) if manifest.get(k) is not None else planned[k] for k in BATCHING_KEYS}
    topo = {"saved_world_size": saved_ws, "world_size": world_size, "saved_strategy": saved_strategy, "strategy": strategy,
            "saved_workers_per_rank": saved_workers, "workers_per_rank": workers_per_rank,
            **{f"saved_{k}": saved[k] for k in BATCHING_KEYS}, **planned}
    if tp > 1 or saved_tp > 1:  # processes and tensor-parallel degree (world_size above: data-parallel ranks)
        topo.update(saved_tp=saved_tp, tp=tp, saved_processes=saved_procs, processes=procs)
    data_changes = data_change(manifest, data_length, data_fingerprint)
    if manifest.get("data_length") is not None or data_length is not None:
        topo.update(saved_data_length=manifest.get("data_length"), data_length=data_length)
    changed_batching = [k for k in BATCHING_KEYS if planned[k] is not None and saved[k] != planned[k]]
    order_changed = saved_order != (order, global_batch if order == "global" else saved_order[1])
    if saved_order[0] == "global" or order == "global":
        topo.update(saved_data_order=saved_order[0], data_order=order, saved_global_batch=saved_order[1],
                    global_batch=global_batch)
    elastic = order == "global" and not order_changed and "batch_size" not in changed_batching and not data_changes
    if legacy:
        row = "legacy"
    elif not strict:
        row = "non_strict"
    elif optimizer_changed:
        row = "optimizer"
    elif elastic:
        row = "same" if not (saved_ws != world_size or changed_batching or saved_workers != workers_per_rank
                             or strategy_changed or layout_changed) else "global_order"
    elif order_changed:
        row = "order"
    elif saved_ws != world_size:
        row = "world_size"
    elif changed_batching:
        row = changed_batching[0]
    elif saved_workers != workers_per_rank:
        row = "workers"
    elif data_changes:
        row = "data"
    elif it > 0 and not has_loader:
        row = "no_loader_state"
    elif layout_changed:
        row = "layout"
    elif strategy_changed:
        row = "strategy"
    else:
        row = "same"
    # The sample order and the RNG streams depend on rank and world size, never on the strategy.
    restore_cursor = row in ("same", "strategy", "layout") and it > 0
    # A legacy file carries rank 0's RNG only: usable when rank 0 is the whole run, before and after.
    restore_rng = row in ("same", "strategy", "layout", "workers", "data", "no_loader_state", *BATCHING_KEYS) \
        or (row == "order" and saved_ws == world_size) \
        or (row == "non_strict" and saved_ws == world_size) or (row == "legacy" and saved_ws == world_size == 1)
    restored = ["model weights", "optimizer", "scheduler", "AMP scaler", "epoch/step counters", "best-metric state",
                "EMA (when the run keeps one)"]
    # Sharded state (FSDP on either side, or a strategy change) is laid out anew by DCP.
    resharded = strategy_changed or layout_changed or (saved_ws != world_size and (
        "fsdp" in (saved_strategy, strategy) or max(tp, saved_tp) > 1))
    if resharded:
        restored[0] = "model weights (resharded through DCP)"
        restored[6] = "EMA (when the run keeps one; resharded through DCP)"
    if resharded or saved_ws != world_size:
        restored[1] = "optimizer (resharded through DCP)"
    if row == "non_strict":
        restored = [f"{r} (best effort)" for r in restored]
    if row == "optimizer":  # refused: nothing is restored, nothing replays
        return ResumePlan(row, False, False, False, step, epoch, it, None, [], ["everything: the resume is refused"],
                          [ROWS[row].split(":")[0]], topo)
    discarded = []
    if restore_rng:
        restored.append("per-rank RNG")
    else:
        discarded.append("per-rank RNG (ranks differ)" if saved_ws != world_size else "per-rank RNG")
    if row == "global_order":  # the cursor is the epoch's samples consumed: steps done * global_batch
        restored.append("loader cursor (samples consumed; the window derived for the new ranks)")
    elif restore_cursor:
        restored.append("loader cursor")
    elif it > 0:
        discarded.append("loader cursor")
    replay = None
    warnings = []
    new_step, new_iter = step, it
    if row == "global_order":
        new_iter = it // int(saved["grad_accum"]) * grad_accum  # (saves happen at window ends)
    elif it > 0 and not restore_cursor:
        new_step, new_iter = replay_step(manifest, grad_accum), 0
        replay = {"epoch": epoch, "step": new_step, "from_iter": it}
        per_rank = " per rank" if saved_ws > 1 else ""
        warnings.append(f"loader cursor skipped ({ROWS[row].split(':')[0]}): restarting epoch {epoch} at step "
                        f"{new_step}; the {it} batches{per_rank} already completed in that epoch will replay")
    if saved_ws != world_size and row == "global_order":
        warnings.append(f"world size changed {saved_ws} -> {world_size} under the global data order: the same "
                        f"samples, batching and randomness; window {saved['grad_accum']} -> {grad_accum} micro-batches "
                        "per rank (the same trajectory up to the order of floating-point additions)")
    elif saved_ws != world_size:
        ranks = "world size" if max(tp, saved_tp) == 1 else "data-parallel ranks"
        warnings.append(f"{ranks} changed {saved_ws} -> {world_size}: sample order and per-rank RNG differ "
                        "from the interrupted run (recovery, not bitwise continuation)")
    if layout_changed:
        warnings.append(layout_warning(saved_tp, tp, saved_procs, procs, row))
    if strategy_changed:
        warnings.append(strategy_warning(saved_strategy, strategy, row, saved_ws != world_size))
    if saved_workers != workers_per_rank:
        warnings.append(f"per-rank workers changed {saved_workers} -> {workers_per_rank}")
    if row == "no_loader_state" and manifest.get("loader_state_problem"):
        warnings.append(f"the checkpoint was saved without its loader cursor: the train split's state_dict(): "
                        f"{manifest['loader_state_problem']}")
    if data_changes:
        warnings.append(f"the training data changed since the save ({'; '.join(data_changes)}): the loader cursor "
                        "was saved for the old data and is never applied to the new"
                        + (f"; epoch {epoch} restarts from its start over the new data" if it > 0 else ""))
    if row == "order":
        warnings.append(f"data order changed {saved_order[0]} (global batch {saved_order[1]}) -> {order} "
                        f"(global batch {global_batch}): the cursor means nothing to the new order")
    for k in changed_batching if row != "global_order" else ():
        label = "per-rank micro-batch size" if k == "batch_size" else "accumulation window (train.grad_accum)"
        warnings.append(f"{label} changed {saved[k]} -> {planned[k]}: optimizer steps from here on average over "
                        "different micro-batches than the interrupted run")
    exact = (row == "same" or (row == "legacy" and it == 0 and restore_rng)) and not strategy_changed \
        and not layout_changed
    return ResumePlan(row, restore_cursor, restore_rng, exact, new_step, epoch, new_iter, replay,
                      restored, discarded, warnings, topo)


def data_change(manifest: dict[str, Any], length: int | None, fingerprint: str | None) -> list[str]:
    """How the planned train data differs from what ``manifest`` recorded (``data_length``,
    ``data_fingerprint``): ``["train samples 100 -> 40"]``; empty when the same or unknown."""
    out = []
    saved_len, saved_fp = manifest.get("data_length"), manifest.get("data_fingerprint")
    if saved_len is not None and length is not None and int(saved_len) != int(length):
        out.append(f"train samples {saved_len} -> {length}")
    if saved_fp is not None and fingerprint is not None and str(saved_fp) != str(fingerprint):
        out.append(f"data fingerprint {saved_fp} -> {fingerprint}")
    return out


def layout_warning(saved_tp: int, tp: int, saved_procs: int, procs: int, row: str) -> str:
    """The warning line of a tensor-parallel layout change (``parallel.tp`` ``saved_tp`` -> ``tp``)."""
    head = (f"parallel layout changed: tp {saved_tp} x dp {saved_procs // saved_tp} -> tp {tp} x dp {procs // tp}; "
            "model weights, optimizer state and EMA are resharded exactly "
            "through DCP")
    if row == "layout":
        return (head + "; the data-parallel ranks are the same, so each keeps its loader cursor and RNG (the same "
                "data in the same order; not promised bitwise: the layers' sums are reduced another way)")
    return head + f"; {ROWS[row].split(':')[0]} decides the loader cursor and RNG"


def strategy_warning(saved: str, planned: str, row: str, world_size_changed: bool) -> str:
    """The warning line of a strategy change ``saved`` -> ``planned`` under policy ``row``."""
    head = (f"strategy changed {saved} -> {planned}: model weights, optimizer state, schedule, counters and "
            "EMA are kept, resharded exactly through DCP")
    if world_size_changed:
        return head + "; the world size changed too, and its rules decide the loader cursor and per-rank RNG"
    if row == "strategy":
        return (head + "; the sample order and per-rank RNG do not depend on the strategy, so at the same world "
                "size the loader cursor and RNG are kept (the same data in the same order; not promised bitwise: "
                "gradients are reduced another way)")
    return (head + f"; the sample order and per-rank RNG do not depend on the strategy ({ROWS[row].split(':')[0]} "
            "decides the loader cursor and RNG)")


def config_diff(saved: dict[str, Any], now: dict[str, Any],
                ignore: tuple[str, ...] = ("run.", "train.resume", "train.weight")) -> list[str]:
    """Lines ``key: saved -> now`` for every differing flattened config key.

    The saved config is first filled with the current schema's defaults, so keys added
    to pimm after the run was written do not show up as differences.
    """
    from ..config import config_from_dict, flatten
    from ..errors import ConfigError

    try:
        saved = config_from_dict(saved).to_dict()
    except (ConfigError, TypeError):
        pass  # a config the current schema rejects: compare it as written
    a, b = flatten(saved), flatten(now)
    if b.get("data.order") == "global":  # the window is derived from the world size (the topology shows it)
        ignore = (*ignore, "train.grad_accum")
    lines = []
    for key in sorted(set(a) | set(b)):
        if any(key == p or (p.endswith(".") and key.startswith(p)) for p in ignore):
            continue
        if a.get(key) != b.get(key):
            why = not_applied(key, b)
            lines.append(f"{key}: {a.get(key, '<unset>')!r} -> {b.get(key, '<unset>')!r}"
                         + (f" (not applied on resume: {why})" if why else ""))
    return lines


def not_applied(key: str, now: dict[str, Any]) -> str | None:
    """Why a change of flattened config ``key`` cannot take effect on a resume (``now``: the new
    config, flattened), or None when it does: a ``[scheduler] target``'s settings are its own
    ``state_dict()``, which the resume restores."""
    if now.get("scheduler.target") and (key == "scheduler.target" or key.startswith("scheduler.args.")):
        return ("a [scheduler] target's schedule is restored from its saved state_dict(); change it in a new run "
                "(warm-started from this one) or in the scheduler's load_state_dict()")
    return None


def is_finished(position: dict[str, Any], *, epochs: int, max_steps: int | None,
                run_state: str | None = "finished") -> bool:
    """The run has nothing left to do: its checkpoint at ``position`` (``step``, ``epoch``)
    reached the end ``epochs``/``max_steps`` set, and the run recorded that it finished.

    ``run_state`` is ``status.json``'s state (None when the run has none, e.g. a Python
    run without a run directory). A run at its end that stopped or failed before its end
    steps completed (the final evaluation, ``model_best.pth``, the ``final`` pointer) is
    not finished: resuming it runs those steps, and trains nothing.
    """
    at_end = int(position.get("epoch") or 0) >= epochs or bool(max_steps) and int(position.get("step") or 0) >= max_steps
    return at_end and run_state in ("finished", None)


def _binding(step: int, epoch: int, train: Any) -> list[tuple[str, int]]:
    """The limits the position has reached: ``[("train.epochs", 30), ("train.max_steps", 500)]``."""
    out = []
    if epoch >= train.epochs:
        out.append(("train.epochs", train.epochs))
    if train.max_steps and step >= train.max_steps:
        out.append(("train.max_steps", train.max_steps))
    return out


def finished_message(step: int, epoch: int, train: Any) -> str:
    """What a resume of a finished run says: where it ended and which keys to raise to continue."""
    keys = _binding(step, epoch, train) or [("train.epochs", train.epochs)]
    now = ", ".join(f"{k} = {v}" for k, v in keys)
    return (f"the run finished at step {step} (epoch {epoch}; {now}); nothing to train. To continue, raise "
            + " and ".join(k for k, _ in keys))


def continue_override(step: int, epoch: int, train: Any) -> str:
    """The overrides that continue a finished run: every limit it reached, raised (``train.epochs=45``)."""
    raised = {"train.epochs": f"train.epochs={max(train.epochs, epoch) + max(1, train.epochs // 2)}",
              "train.max_steps": f"train.max_steps={max(train.max_steps or 0, step) * 2}"}
    keys = _binding(step, epoch, train) or [("train.epochs", train.epochs)]
    return " ".join(raised[k] for k, _ in keys)
