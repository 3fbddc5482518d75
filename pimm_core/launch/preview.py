"""``--dry-run``: what a launch would do, checked as the launch checks it, with nothing written."""

from __future__ import annotations

import logging
from pathlib import Path

from ..checkpoint.select.branch import describe_branch, later_checkpoints
from ..checkpoint.select.resume_path import resolve_resume_path
from ..checkpoint.select.selection import fallback_warnings, select_resume
from ..config import Config
from ..errors import CheckpointError
from ..run import MODEL
from .rundir import check_before_launch, finished_at, resolve_run_dir, resume_source


def dry_run(cfg: Config, config_path: Path | None, resume_from: str | None, world_size: int) -> int:
    """Print what a launch would do (run path, model, warm start or resume candidate,
    restored/discarded, topology, replay) and exit, having checked what the launch checks.

    Nothing is written (no run directory, no lock, no download: an ``hf://`` warm start
    not in the local cache is looked up on the Hub only, a remote ``s3://...`` one on its store). The model is built, a warm start
    is loaded into it and a resume candidate's weights are matched against it, so a
    config or source the launch would refuse fails here the same way.
    """
    import tomllib

    from ..run.topology import config_diff, plan_resume
    from ..train.build import data_length

    from ..train.tensor_parallel import check_layout

    check_layout(cfg, world_size)
    run_dir = resolve_run_dir(cfg, config_path)
    check_before_launch(cfg, run_dir, warm_start=False, config_path=config_path)
    try:
        source = resume_source(cfg, run_dir, resume_from)
    except CheckpointError:
        if not _remote_only(cfg, run_dir):  # nothing complete here: the remote may hold one
            raise
        return 0
    print(f"run: {run_dir}")
    model, data = _dry_model(cfg, config_path)
    if source is None:
        if cfg.train.weight:
            print(f"fresh start (no resume requested); warm start from {cfg.train.weight}: model weights only")
            for line in _dry_warm_start(cfg, model):
                print(line)
        else:
            print("fresh start (no resume requested); nothing will be restored")
        print("dry run: nothing was trained or written")
        return 0
    if Path(source) == run_dir / MODEL:  # the selection, with the candidates it passed over and why
        cand, cands = select_resume(run_dir / MODEL)
        fallbacks = fallback_warnings(cands, cand)
    else:
        cand, fallbacks = resolve_resume_path(source), []
    restored = _restored_from_remote(cfg, run_dir, cand) if Path(source) == run_dir / MODEL else None
    if restored is None:
        _dry_check_resume(cand.path, model)  # (a remote one's weights are matched once restored)
    changed = _dry_optimizer_change(cfg, config_path, cand, model) if restored is None else None
    manifest = restored[2] if restored is not None else (cand.manifest or {})
    plan = plan_resume(manifest, world_size=world_size, strategy=cfg.train.strategy,
                       workers_per_rank=cfg.data.num_workers,
                       strict=cfg.resume_strict_state, grad_accum=cfg.train.grad_accum,
                       batch_size=cfg.data.batch_size, legacy=cand.format == "legacy",
                       data_length=data_length(data.train), data_fingerprint=data.fingerprint,
                       order=cfg.data.order, global_batch=cfg.train.global_batch, optimizer_changed=bool(changed),
                       tp=cfg.parallel.tp)
    if changed and plan.row == "optimizer":  # the resume refuses it before anything is loaded: so does its dry run
        from ..checkpoint.formats.optim_structure import structure_fix

        raise CheckpointError(f"cannot resume from {cand.path}: {changed}; {structure_fix(Path(cand.path) / 'weights.pth')}",
                              exit_code=2)
    t = plan.topology
    if restored is not None:  # the resume downloads it as model/last first: describe that one
        url, reason, _ = restored
        print(f"checkpoint: {url} (step {manifest.get('step')}, epoch {manifest.get('epoch')}, "
              f"iter {manifest.get('iter')}), on the remote: the resume restores it as {run_dir / MODEL / 'last'}")
    else:
        print(f"checkpoint: {cand.path} (step {cand.step}, epoch {cand.epoch}, iter {cand.iter})")
    for w in fallbacks:
        print(f"warning: {w}")
    if cfg.checkpoint.remote and Path(source) == run_dir / MODEL:  # the restore's choice, nothing downloaded
        from ..checkpoint.remote.store import remote_choice

        reason = restored[1] if restored is not None else \
            remote_choice(cfg.checkpoint.remote, cfg.checkpoint.remote_options, run_dir, cand).reason
        print(f"remote: {reason}")
    local_run = restored is None and Path(cand.path).parent.resolve() == (run_dir / MODEL).resolve()
    later = later_checkpoints(cand) if local_run else []
    if later:
        print(f"branch: {describe_branch(cand, later, run_dir / MODEL / 'abandoned-<time>')}")
    message = finished_at(cfg, manifest, run_dir)
    if message is not None:
        print(message)
        print("dry run: nothing was trained or written")
        return 0
    print(f"policy: {plan.description}")
    print(f"topology: world size {t['saved_world_size']} -> {t['world_size']}, "
          f"strategy {t['saved_strategy']} -> {t['strategy']}, "
          f"per-rank workers {t['saved_workers_per_rank']} -> {t['workers_per_rank']}, "
          f"per-rank micro-batch {t['saved_batch_size']} -> {t['batch_size']}, "
          f"grad_accum {t['saved_grad_accum']} -> {t['grad_accum']}")
    if "tp" in t:  # (the world sizes above are then the data-parallel ranks)
        print(f"tensor parallel: tp {t['saved_tp']} x dp {t['saved_processes'] // t['saved_tp']} -> tp {t['tp']} x dp "
              f"{t['processes'] // t['tp']}")
    if "data_length" in t:
        print(f"data: train samples {t['saved_data_length'] if t['saved_data_length'] is not None else 'not recorded'}"
              f" -> {t['data_length']}")
    print(f"restore: {', '.join(plan.restored)}")
    print(f"discard: {', '.join(plan.discarded) or 'nothing'}")
    rb = plan.replay_boundary
    print(f"continue at: step {plan.step}, epoch {plan.epoch}, iter {plan.iter}"
          + (f" (replay boundary: epoch {rb['epoch']} start, step {rb['step']}; {rb['from_iter']} batches replay)" if rb else
             " (exact continuation)" if plan.exact else
             f" (loader cursor restored; not bitwise: the {_what_changed(plan.row)} changed)" if plan.restore_cursor
             else ""))
    saved_cfg = run_dir / "config.toml"
    if saved_cfg.is_file():
        diff = config_diff(tomllib.loads(saved_cfg.read_text()), cfg.to_dict())
        print("config diff: " + ("none" if not diff else "; ".join(diff)))
    warnings = list(plan.warnings)
    if plan.row == "global_order" and t["saved_world_size"] != t["world_size"]:  # as the resume warns
        from ..data.global_order import running_stats_warning

        warnings += running_stats_warning(model)
    horizon = horizon_moves(cfg, run_dir, manifest, plan)
    warnings += [horizon] if horizon is not None else []
    for w in warnings:
        print(f"warning: {w}")
    note = best_starts_over(cfg, run_dir / MODEL)
    if note is not None:
        print(f"warning: {note}")
    print("dry run: nothing was trained or written")
    return 0


def _restored_from_remote(cfg: Config, run_dir: Path, local) -> tuple[str, str, dict] | None:
    """``(its URL, the choice's reason, its manifest)`` of the remote checkpoint the resume restores
    over ``local`` (``checkpoint.remote`` newer than ``model/``'s), or None: the resume takes ``local``.
    Only the manifest is read from the store."""
    if not cfg.checkpoint.remote:
        return None
    from ..checkpoint.remote.store import remote_choice, remote_manifest, run_prefix

    c = cfg.checkpoint
    choice = remote_choice(c.remote, c.remote_options, run_dir, local)
    if choice.remote is None:
        return None
    manifest = remote_manifest(c.remote, c.remote_options, run_dir, choice.remote.name)
    if manifest is None:
        return None
    return f"{run_prefix(c.remote, run_dir)}/{choice.remote.name}", choice.reason, manifest


def horizon_moves(cfg: Config, run_dir: Path, manifest: dict, plan) -> str | None:
    """The warning the resume gives when its end differs from the horizon the run's LR schedule had
    (:func:`pimm_core.train.resume.retarget_schedule`: more ``train.epochs`` on a finished run, a
    new ``train.max_steps``), or None. The old horizon is ``status.json``'s ``total_steps``; the new
    end is counted with its ``steps_per_epoch`` when the batching is the checkpoint's (else the line
    says the horizon moves to where the resume ends)."""
    from ..run import read_run_status
    from ..train.state import TrainState, end_step

    status = read_run_status(run_dir)
    before, spe = status.total_steps, status.steps_per_epoch
    t = cfg.train
    if before is None or plan.step is None:
        return None
    same_batching = all(plan.topology.get(f"saved_{k}") == plan.topology.get(k)
                        for k in ("world_size", "batch_size", "grad_accum"))
    if spe and same_batching and not plan.iter:
        state = TrainState(global_step=plan.step, epoch=plan.epoch, iter=0)
        end = end_step(state, t, micro_batches=spe * t.grad_accum, steps_per_epoch=spe)
        if end == before:
            return None
        where = f"step {end} (where this resume ends)"
    elif t.epochs != status.epochs or (t.max_steps and t.max_steps != before):
        # (the batching changes: the steps an epoch takes are known once the resume's loaders are built)
        where = "the step this resume ends at"
    else:
        return None
    then = "stays constant" if t.scheduler == "constant" else f"decays to train.min_lr {t.min_lr:g} there"
    return (f"the LR schedule's horizon moves from step {before} to {where}: the LR at step {plan.step} is kept "
            f"and {then}")


def best_starts_over(cfg: Config, model_dir: Path) -> str | None:
    """The warning a resume gives when ``eval.metric`` or ``eval.mode`` is not what the best so far
    was ranked by (:meth:`~pimm_core.train.best.BestTracker.rebase`: the best starts over), or None.

    The resume reads the best from the trainer state; the dry run reads the same record without
    loading it: what ``model_best.pth`` (single format: the checkpoint ``best`` names) was ranked
    by, its value and epoch, from its sidecar, which the evaluation that set the best wrote.
    """
    from ..run import read_json
    from ..train.best import BestTracker

    sidecar = model_dir / "model_best.pth.json"
    if not sidecar.is_file() and (model_dir / "best").is_symlink():
        target = (model_dir / "best").resolve()
        sidecar = target.with_name(target.name + ".json")
    record = read_json(sidecar)
    sel = record.get("selection_metric") if isinstance(record, dict) else None
    value = sel.get("value") if isinstance(sel, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    epoch = sel.get("epoch", record.get("epoch"))
    return BestTracker(cfg.eval.metric, cfg.eval.mode, best=float(value), epoch=epoch).rebase(sel)


def _what_changed(row: str) -> str:
    """What keeps a continuation with the cursor restored from being exact (its policy row)."""
    return "parallel layout" if row == "layout" else "strategy"


def _dry_model(cfg: Config, config_path: Path | None):
    """Build the data and the model as the trainer would, and pick ``train.blocks`` (a bad name,
    target, size or block fails as at launch); returns ``(model, datasets)``."""
    from ..train.build import build_data, build_model
    from ..train.parallel import check_blocks

    data = build_data(cfg, config_path)
    model = build_model(cfg, config_path)
    check_blocks(model, cfg, config_path)
    if cfg.parallel.tp > 1:  # the plan the launch would apply, checked against the model
        from ..train.tensor_parallel import planned_modules, resolve_plan

        planned_modules(model, resolve_plan(model, cfg, config_path), cfg.parallel.tp)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {cfg.model.target or cfg.model.name} ({params:,} parameters), data: "
          f"{cfg.data.target or cfg.data.name} ({_size(data.train)} train / {_size(data.val)} val samples)")
    return model, data


def _size(ds) -> str:
    """A split's sample count: a stream's ``__len__`` is per rank ("?": it has none)."""
    from ..data.loaders import is_stream

    try:
        n = len(ds)
    except TypeError:
        return "?"
    return f"{n} per rank" if is_stream(ds) else str(n)


def _dry_warm_start(cfg: Config, model) -> list[str]:
    """Warm-start ``model`` from ``train.weight`` as the trainer would; the report's lines.

    An ``hf://`` file that is not in the local cache, and a remote ``s3://...`` source, are only
    looked up (what is read, sizes, the record it is checked against, its complete marker).

    Raises:
        as :func:`pimm_core.checkpoint.weights.warm_start.warm_start` (a missing source, one that is not
        a checkpoint, no matching parameters...).
    """
    from ..checkpoint.weights.hub import is_remote, plan_hf
    from ..checkpoint.remote.source import check_remote_source, is_store_url, options_for
    from ..checkpoint.weights.warm_start import warm_start

    t = cfg.train
    source: str | Path = t.weight
    if is_store_url(t.weight):  # looked up, nothing downloaded: the launch downloads and checks it
        plan = check_remote_source(t.weight, options_for(t.weight, cfg.checkpoint.remote,
                                                         cfg.checkpoint.remote_options))
        return [f"  reads {plan.describe()}",
                "  downloaded at launch into a temporary directory (removed after loading) and checked; "
                "its keys are matched against the model then"]
    if is_remote(t.weight):
        hub = plan_hf(t.weight)
        if hub.local is None:
            size = f"{hub.size:,} bytes" if hub.size is not None else "size unknown"
            return [f"  {hub.name} ({size}) is downloaded at launch; its keys are matched against the model then"]
        source = hub.local
    quiet = logging.getLogger("pimm.dry_run")
    quiet.propagate = False
    rules = [tuple(r) for r in t.key_rules] if t.key_rules is not None else None
    report = warm_start(model, source, weight_set=t.weight_set, rules=rules, logger=quiet)
    return [f"  reads {report.resolved}, {report.weight_set} weights", *report.lines()[1:]]


def _dry_check_resume(path: str, model) -> None:
    """Match the resume candidate's weights against the model, as the resume does first.

    Raises:
        CheckpointError: names the missing, unexpected and shape-mismatched tensors.
    """
    from ..checkpoint.weights.sources import resolve_weight_source
    from ..checkpoint.formats.weights_file import check_compatible
    from ..checkpoint.weights.read import read_weight_sets

    weights = resolve_weight_source(path)
    check_compatible(model, read_weight_sets(weights)["raw"], str(weights))


def _dry_optimizer_change(cfg: Config, config_path: Path | None, cand, model) -> str | None:
    """How the optimizer this config builds differs from the one a standard checkpoint was saved
    from (the resume policy's optimizer row), or None (also for the single-file formats, whose
    whole file a dry run does not read)."""
    if cand.format != "standard":
        return None
    from ..checkpoint.formats.optim_structure import planned_change
    from ..checkpoint.formats.standard import read_trainer_meta
    from ..optim import build_optimizer

    return planned_change(read_trainer_meta(Path(cand.path)), model, build_optimizer(cfg, model, config_path))


def _remote_only(cfg: Config, run_dir: Path) -> bool:
    """``model/`` holds nothing intact (the resume was refused) while ``checkpoint.remote`` holds a
    complete checkpoint (a fresh node, a wiped disk): the real resume restores it first, so say that
    (the plan needs the checkpoint's files: nothing is downloaded by a dry run). False otherwise."""
    if not cfg.checkpoint.remote:
        return False
    from ..checkpoint.remote.store import remote_choice

    choice = remote_choice(cfg.checkpoint.remote, cfg.checkpoint.remote_options, run_dir, None)
    if choice.remote is None:
        return False  # nothing complete there either: the refusal stands
    print(f"run: {run_dir}")
    print(f"remote: {choice.reason}")
    print("dry run: nothing was downloaded, trained or written (the resume's plan needs the checkpoint's "
          "files: the resume logs it once they are restored)")
    return True
