"""``pimm launch``: resolve the run directory, then train here or hand over to torchrun.

- No ``--nproc-per-node``/``--nnodes`` (or already inside torchrun/srun): this process
  is a rank and trains.
- Otherwise ``torch.distributed.run`` (torchrun/elastic) starts the ranks, each running
  ``python -m pimm_core.cli launch`` with the same arguments and the resolved run name
  (so every rank agrees on the directory even with a timestamp suffix).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .checkpoint.selection import explain, fallback_warnings, list_candidates, resolve_resume_path, select_resume
from .config import Config
from .console_log import setup_logging
from .errors import RANK_ERRORS_ENV, CheckpointError, ConfigError, TrainingError, UsageError, rank_errors
from .run import (CONFIG, LAUNCH_ENV, MODEL, PROVENANCE, STATUS, RunDirClaim, claim_run_dir, free_run_dir, read_json,
                  run_dir_for, run_name)
from .lock import LauncherLock, follow_launcher, hold_run
from .shell import PROGRAM_ENV, program, resume_command
from .stop import StopRequest
from .topology import continue_override, finished_message, is_finished


@dataclass
class LaunchOptions:
    """Launcher flags passed through to torchrun (names as torchrun spells them)."""

    nproc_per_node: int | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    master_addr: str | None = None
    master_port: int | None = None

    @classmethod
    def recorded(cls, record: dict | None, given: "LaunchOptions") -> "LaunchOptions":
        """``given`` flags, with the ones not given taken from a recorded launch
        (:func:`pimm_core.dist.launch_record`; ``node_rank`` is never recorded: it differs per node)."""
        record = record or {}
        values = {}
        for name in cls.__dataclass_fields__:
            value = getattr(given, name)
            values[name] = value if value is not None or name == "node_rank" else record.get(name)
        return cls(**values)

    def record(self) -> dict:
        """What ``pimm resume`` needs to start the same ranks again (None fields left out)."""
        return {"launcher": "pimm", **{k: v for k, v in self.__dict__.items() if v is not None and k != "node_rank"}}

    def check(self) -> None:
        """Raises UsageError for flag values torchrun would misread (e.g. ``--nproc-per-node 0``)."""
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be at least 1 (got {self.nproc_per_node})")
        if self.nnodes is not None:
            parts = str(self.nnodes).split(":")
            if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
                raise UsageError(f"--nnodes must be N or MIN:MAX with N >= 1 (got {self.nnodes!r})")

    def world_size(self) -> int:
        """Ranks in all (the largest node count for ``MIN:MAX``)."""
        return (self.nproc_per_node or 1) * int(str(self.nnodes or "1").split(":")[-1])

    def describe(self) -> str:
        flags = [f"--{k.replace('_', '-')} {v}" for k, v in self.__dict__.items() if v is not None]
        return f"world size {self.world_size()}" + (f" ({' '.join(flags)})" if flags else "")

    def wants_spawn(self) -> bool:
        return (self.nproc_per_node or 1) > 1 or (self.nnodes not in (None, "1", "1:1"))

    def torchrun_args(self) -> list[str]:
        args = ["--nproc-per-node", str(self.nproc_per_node or 1), "--max-restarts", "0"]
        # After forwarding a stop signal torchrun waits this long before SIGKILLing the ranks:
        # leave time to finish the accumulation window and save `last` (torchrun's default is 30 s).
        args += ["--shutdown-timeout", os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")]
        for flag, value in (("--nnodes", self.nnodes), ("--node-rank", self.node_rank),
                            ("--rdzv-endpoint", self.rdzv_endpoint), ("--rdzv-backend", self.rdzv_backend),
                            ("--master-addr", self.master_addr), ("--master-port", self.master_port)):
            if value is not None:
                args += [flag, str(value)]
        if not any(v is not None for v in (self.rdzv_endpoint, self.master_addr, self.nnodes)):
            args.append("--standalone")  # single node: torchrun picks a free port
        return args


def resolve_run_dir(cfg: Config, config_path: Path | None, *, when: float | None = None) -> Path:
    """``<run.root>/<run.group>/<name>[-timestamp]`` where name defaults to the config file's stem.

    A timestamped name that exists already (a launch in the same second) becomes
    ``<name>-<stamp>-2``, ``-3``... (the first free one; :func:`claim_run_dir` takes it),
    except in a rank of an external launcher, whose ranks must all compute the same name.
    """
    base = cfg.run.name or (config_path.stem if config_path else "run")
    run_dir = run_dir_for(cfg.run.root, cfg.run.group, run_name(base, timestamp=not cfg.run.no_timestamp, when=when))
    return free_run_dir(run_dir) if _numbered_names(cfg) else run_dir


def _numbered_names(cfg: Config) -> bool:
    """This process chooses a timestamped run name alone (not a rank of an external torchrun/srun)."""
    from .dist import under_launcher

    return not cfg.run.no_timestamp and not under_launcher()


def claim(cfg: Config, run_dir: Path, *, single_node: bool = True) -> RunDirClaim:
    """Create the run directory before the launch writes anything (see :func:`pimm_core.run.claim_run_dir`)."""
    return claim_run_dir(run_dir, numbered_names=_numbered_names(cfg) and single_node)


def check_run_dir(cfg: Config, run_dir: Path, *, leftovers_ok: bool = False, warm_start: bool = True) -> None:
    """Refuse, before the run directory is created and before any rank starts, what the
    launch would refuse later or what would lose work or silently start over.

    Args:
        warm_start: also resolve ``train.weight`` (downloading ``hf://``) and refuse a
            source that is missing or not a PyTorch checkpoint (``--dry-run`` checks it
            its own way, without downloading).

    Raises:
        UsageError: the run root is a file; a fresh run would start in a directory that
            already has checkpoints; a resume was asked for but the run has none.
        ConfigError: a config value the trainer would refuse (:func:`check_config`).
        CheckpointError: the warm-start source does not resolve or is not a checkpoint.
    """
    for parent in [run_dir, *run_dir.parents]:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"{parent} is a file, not a directory; choose another --run.root or --run.name")
    check_config(cfg)
    if cfg.train.resume:
        return
    if warm_start and cfg.train.weight:
        from .checkpoint.sources import check_weight_source

        check_weight_source(cfg.train.weight)
    # Even a leftover of an interrupted save belongs to an earlier run of this name: never
    # start over on top of it (the new run would delete it) without the user's say-so.
    found = list_candidates(run_dir / MODEL)
    if not found:
        return
    names = ", ".join(c.name for c in found[:4])
    if any(c.complete and c.resumable for c in found):
        raise UsageError(f"{run_dir} already has checkpoints ({names}); continue it with: {resume_command(run_dir)} "
                         "(or add --train.resume), or choose another --run.name")
    # Nothing resumable (e.g. killed during its first save): neither a fresh start nor a resume
    # can proceed, so say how to get out instead of pointing at --train.resume.
    if leftovers_ok:
        return  # --train.auto-resume: rank 0 moves them aside (auto_resume)
    raise UsageError(f"{run_dir} has checkpoint files ({names}) but none can be resumed; move or remove "
                     f"{run_dir / MODEL} to start this run over (--train.auto-resume moves it aside for you), "
                     "or choose another --run.name")


def check_config(cfg: Config) -> None:
    """Refuse the config values that only building the run would otherwise reject: an
    unknown ``data.name`` or ``model.name``, ``train.device = "cuda"`` without CUDA,
    ``train.amp = "fp16"`` without CUDA (cheap: nothing is built).

    Raises:
        ConfigError: names the key and the values that work.
    """
    import torch

    from .data import DATASETS
    from .models import MODELS

    if cfg.data.name not in DATASETS:
        raise ConfigError(f"data.name = {cfg.data.name!r} is not a known dataset; use one of {sorted(DATASETS)}")
    if cfg.model.name not in MODELS:
        raise ConfigError(f"model.name = {cfg.model.name!r} is not a known model; use one of {sorted(MODELS)}")
    cuda = torch.cuda.is_available()
    if cfg.train.device == "cuda" and not cuda:
        raise ConfigError("train.device = 'cuda' but CUDA is not available here; use 'auto' or 'cpu'")
    if cfg.train.amp == "fp16" and not (cuda and cfg.train.device != "cpu"):
        raise ConfigError("train.amp = 'fp16' needs CUDA; use 'bf16' or 'none' on CPU")


def recorded_launch(run_dir: Path) -> dict:
    """The launch of the run's latest start (``provenance.json``): ``launcher`` (``pimm`` or
    ``external``), ``nproc_per_node`` and the multi-node flags ``pimm launch`` was given."""
    prov = read_json(run_dir / PROVENANCE) or {}
    for entry in reversed(prov.get("starts") or []):
        if isinstance(entry, dict) and isinstance(entry.get("launch"), dict):
            return entry["launch"]
    # runs written before pimm recorded the launch: one node with the recorded world size
    return {"launcher": "pimm", "nproc_per_node": int(prov.get("world_size") or 1)}


def resume_config(run_dir: Path, overrides: list[str]) -> Config:
    """The run's own resolved ``config.toml`` plus explicit ``overrides``, pointed at ``run_dir``.

    Raises:
        UsageError: ``run_dir`` is not a run directory written by pimm (no ``config.toml``).
        ConfigError: the saved config or an override is invalid.
    """
    from .config import load_config

    if not (run_dir / CONFIG).is_file():
        what = "does not exist" if not run_dir.exists() else "has no config.toml"
        raise UsageError(f"{run_dir} {what}; pass a run directory written by pimm launch (exp/<group>/<run>)")
    extra = {"run.root": str(run_dir.parent.parent), "run.group": run_dir.parent.name, "run.name": run_dir.name,
             "run.no_timestamp": True, "train.resume": True}
    return load_config(run_dir / CONFIG, overrides, extra)


def auto_resume(cfg: Config, run_dir: Path, *, is_main: bool = True) -> Config:
    """``--train.auto-resume``: resume when the run has an intact checkpoint, else start it fresh.

    The command a cluster job script repeats on every (re)start. Leftovers of saves that
    never completed (nothing resumable in ``model/``) do not block it and are not deleted:
    rank 0 moves the whole ``model/`` directory to ``<run>/abandoned/<time>/`` and says so.
    """
    chosen, cands = select_resume(run_dir / MODEL)
    if chosen is not None:
        return replace(cfg, train=replace(cfg.train, resume=True))
    if cands and is_main:
        moved = set_aside(run_dir / MODEL, run_dir / "abandoned")
        logging.getLogger("pimm").warning(
            "warning: %s held no resumable checkpoint (%s); moved it to %s and starting the run fresh "
            "(nothing was deleted; remove it when you no longer need it)",
            run_dir / MODEL, "; ".join(explain(cands, None)), moved)
    return replace(cfg, train=replace(cfg.train, resume=False))


def set_aside(path: Path, under: Path) -> Path:
    """Move ``path`` (one rename, nothing copied or deleted) to ``under/<YYYYmmdd-HHMMSS>[-N]``."""
    under.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = under / stamp, 1
    while dest.exists():
        dest, n = under / f"{stamp}-{n}", n + 1
    os.replace(path, dest)
    return dest


def finished(cfg: Config, source: str | None, run_dir: Path) -> str | None:
    """The finished-run message when the checkpoint a resume would load is already at
    the end this config sets (all epochs, or ``train.max_steps``); else None."""
    if source is None:
        return None
    cand = resolve_resume_path(source)
    m = cand.manifest or {}
    state = (read_json(run_dir / STATUS) or {}).get("state") if (run_dir / STATUS).exists() else None
    if m.get("step") is None or not is_finished(m, epochs=cfg.train.epochs, max_steps=cfg.train.max_steps,
                                                run_state=state):
        return None
    step = int(m["step"])
    return (f"{finished_message(step, int(m.get('epoch') or 0), cfg.train)}, e.g.: "
            f"{resume_command(run_dir)} -- "
            f"{continue_override(step, cfg.train)}")


def resume_source(cfg: Config, run_dir: Path, resume_from: str | None) -> str | None:
    """The checkpoint a resume loads: ``resume_from`` as given, else the run's newest complete one.

    Raises:
        CheckpointError: ``--train.resume`` on a run with no complete candidate (lists what was found).
    """
    if resume_from:
        return resume_from
    if not cfg.train.resume:
        return None
    chosen, cands = select_resume(run_dir / MODEL)
    if chosen is None:
        found = "; ".join(explain(cands, None)) if cands else "nothing"
        if not cfg.run.no_timestamp:
            hint = " (to resume a run, pass its --run.name and --run.no-timestamp, or use pimm resume RUN_DIR)"
        elif cands:
            hint = (f"; to start this run over, move or remove {run_dir / MODEL} and launch without --train.resume "
                    "(or launch with --train.auto-resume, which moves it aside for you)")
        else:
            hint = "; launch without --train.resume to start it"
        if any(c.verify_problems for c in cands):  # complete candidates, all damaged: an operation failed
            raise CheckpointError(f"cannot resume {run_dir}: no intact checkpoint; found: {found}", exit_code=1)
        raise CheckpointError(f"cannot resume {run_dir}: no complete checkpoint; found: {found}{hint}", exit_code=2)
    return str(run_dir / MODEL)  # the trainer verifies checksums and falls back past corrupt candidates


def dry_run(cfg: Config, config_path: Path | None, resume_from: str | None, world_size: int) -> int:
    """Print what a launch would do (run path, model, warm start or resume candidate,
    restored/discarded, topology, replay) and exit, having checked what the launch checks.

    Nothing is written (no run directory, no lock, no download: an ``hf://`` warm start
    not in the local cache is looked up on the Hub only). The model is built, a warm start
    is loaded into it and a resume candidate's weights are matched against it, so a
    config or source the launch would refuse fails here the same way.
    """
    import tomllib

    from .topology import config_diff, plan_resume

    run_dir = resolve_run_dir(cfg, config_path)
    check_run_dir(cfg, run_dir, warm_start=False)
    source = resume_source(cfg, run_dir, resume_from)
    print(f"run: {run_dir}")
    model = _dry_model(cfg)
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
    _dry_check_resume(cand.path, model)
    plan = plan_resume(cand.manifest or {}, world_size=world_size, workers_per_rank=cfg.data.num_workers,
                       strict=cfg.resume_strict_state, grad_accum=cfg.train.grad_accum,
                       batch_size=cfg.data.batch_size, legacy=cand.format == "legacy")
    t = plan.topology
    print(f"checkpoint: {cand.path} (step {cand.step}, epoch {cand.epoch}, iter {cand.iter})")
    for w in fallbacks:
        print(f"warning: {w}")
    message = finished(cfg, cand.path, run_dir)
    if message is not None:
        print(message)
        print("dry run: nothing was trained or written")
        return 0
    print(f"policy: {plan.description}")
    print(f"topology: world size {t['saved_world_size']} -> {t['world_size']}, "
          f"per-rank workers {t['saved_workers_per_rank']} -> {t['workers_per_rank']}, "
          f"per-rank micro-batch {t['saved_batch_size']} -> {t['batch_size']}, "
          f"grad_accum {t['saved_grad_accum']} -> {t['grad_accum']}")
    print(f"restore: {', '.join(plan.restored)}")
    print(f"discard: {', '.join(plan.discarded) or 'nothing'}")
    rb = plan.replay_boundary
    print(f"continue at: step {plan.step}, epoch {plan.epoch}, iter {plan.iter}"
          + (f" (replay boundary: epoch {rb['epoch']} start, step {rb['step']}; {rb['from_iter']} batches replay)" if rb else
             " (exact continuation)" if plan.exact else ""))
    saved_cfg = run_dir / "config.toml"
    if saved_cfg.is_file():
        diff = config_diff(tomllib.loads(saved_cfg.read_text()), cfg.to_dict())
        print("config diff: " + ("none" if not diff else "; ".join(diff)))
    for w in plan.warnings:
        print(f"warning: {w}")
    print("dry run: nothing was trained or written")
    return 0


def _dry_model(cfg: Config):
    """Build the data and the model as the trainer would (a bad name or size fails as at launch)."""
    from .data import build_datasets
    from .models import build_model

    data = build_datasets(cfg.data)
    model = build_model(cfg.model, data.in_features, data.in_shape, data.num_classes)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {cfg.model.name} ({params:,} parameters), data: {cfg.data.name} "
          f"({len(data.train)} train / {len(data.val)} val samples)")
    return model


def _dry_warm_start(cfg: Config, model) -> list[str]:
    """Warm-start ``model`` from ``train.weight`` as the trainer would; the report's lines.

    An ``hf://`` file that is not in the local cache is only looked up (name, size).

    Raises:
        as :func:`pimm_core.checkpoint.weights.warm_start` (a missing source, one that is not
        a checkpoint, no matching parameters...).
    """
    from .checkpoint.sources import is_remote, plan_hf
    from .checkpoint.weights import warm_start

    t = cfg.train
    source: str | Path = t.weight
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
    from .checkpoint.sources import resolve_weight_source
    from .checkpoint.standard import check_compatible
    from .checkpoint.weights import read_weight_sets

    weights = resolve_weight_source(path)
    check_compatible(model, read_weight_sets(weights)["raw"], str(weights))


def train_here(cfg: Config, config_path: Path | None, resume_from: str | None = None, *,
               leftovers_ok: bool = False) -> int:
    """Run this process as one rank of the run; returns the exit code.

    ``leftovers_ok`` (``--train.auto-resume``): a model/ directory with nothing resumable
    in it does not stop a fresh start (rank 0 has moved it aside)."""
    follow_launcher()  # a rank of `pimm launch --nproc-per-node` dies with it (lock.py)
    from . import dist

    info = dist.env_world()
    setup_logging(info.is_main)
    run_dir = resolve_run_dir(cfg, config_path)
    check_run_dir(cfg, run_dir, leftovers_ok=leftovers_ok)
    claimed = claim(cfg, run_dir) if info.is_main else None
    run_dir = claimed.path if claimed is not None else run_dir
    try:
        return _train_claimed(cfg, config_path, run_dir, resume_from, info)
    except BaseException:
        if claimed is not None:
            claimed.discard_if_unstarted()  # a launch that failed before the run started leaves nothing behind
        raise


def _train_claimed(cfg: Config, config_path: Path | None, run_dir: Path, resume_from: str | None, info) -> int:
    lock = hold_run(run_dir, info.is_main)  # see lock.py: who holds what
    try:
        source = resume_source(cfg, run_dir, resume_from)
        message = finished(cfg, source, run_dir)
    except BaseException:
        lock.__exit__(None, None, None)
        raise
    if message is not None:  # nothing to train: no metrics, no checkpoint, no status change
        lock.__exit__(None, None, None)
        if info.is_main:
            print(message, flush=True)
        return 0
    start = time.perf_counter()
    stop = StopRequest()
    # SIGINT/SIGTERM (Ctrl-C, a scheduler's pre-emption notice, torchrun forwarding either)
    # become a clean stop: finish the accumulation window, save last, exit 0. Once training
    # has returned, later ones are ignored until this function returns (catch_signals restores
    # what it found: SIG_IGN), so a repeated Ctrl-C cannot turn the clean exit into a traceback;
    # the console script keeps ignoring them while the interpreter exits (cli.run).
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _train_and_report(cfg, config_path, run_dir, source, lock, stop, info, start)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _train_and_report(cfg: Config, config_path: Path | None, run_dir: Path, source: str | None, lock,
                      stop: StopRequest, info, start: float) -> int:
    """Train under the run lock with signals turned into stop requests; print the summary line."""
    from . import dist
    from .trainer import Trainer

    with lock, stop.catch_signals():
        try:
            trainer = Trainer(cfg, run_dir=run_dir, stop=stop)
            state = trainer.train(checkpoint_dir=run_dir / MODEL, resume_from=source)
        finally:
            dist.shutdown()
    if info.is_main:
        best = f"{state.best_metric:.4f}" if state.best_metric is not None else "n/a"
        took = f"{time.perf_counter() - start:.1f} s"
        if state.error is not None:
            raise TrainingError(f"{state.error}; the run's last checkpoint (step {state.global_step}) holds the "
                                "weights from before it. "
                                f"Resume with a lower LR: {resume_command(run_dir)} -- train.lr={cfg.train.lr / 10:g}")
        if state.stop_reason is not None and state.stop_reason.startswith("checkpoint save failed"):
            raise CheckpointError(f"{state.stop_reason}; training stopped at step {state.global_step} | run {run_dir}")
        if state.stop_reason is not None:
            print(f"stopped ({state.stop_reason}): last saved at step {state.global_step} "
                  f"(epoch {state.epoch}, iter {state.iter}) | {took} | run {run_dir}\n"
                  f"resume with: {resume_command(run_dir)}", flush=True)
        else:
            print(f"done: best {cfg.eval.metric} {best} (epoch {state.best_epoch}) | epochs {state.epoch} | "
                  f"steps {state.global_step} | {took} | run {run_dir}", flush=True)
    return 0


def spawn(cfg: Config, config_path: Path | None, argv: list[str], opts: LaunchOptions, *,
          worker_args: list[str] | None = None) -> int:
    """Start the ranks with ``torch.distributed.run`` and wait for them.

    Args:
        argv: the ``launch`` arguments to give each rank (launcher flags removed).
        worker_args: the whole command line of each rank instead (``pimm resume`` passes
            ``resume RUN_DIR -- overrides``).

    Returns:
        0 on success, else the first failed rank's exit code.
    """
    run_dir = resolve_run_dir(cfg, config_path)
    check_run_dir(cfg, run_dir)
    single_node = opts.nnodes in (None, "1", "1:1")
    claimed = claim(cfg, run_dir, single_node=single_node)
    try:
        code = _spawn_claimed(cfg, claimed.path, opts, argv, worker_args, single_node)
    except BaseException:
        claimed.discard_if_unstarted()
        raise
    if code != 0:
        claimed.discard_if_unstarted()  # the ranks failed before the run started: leave nothing behind
    return code


def _spawn_claimed(cfg: Config, run_dir: Path, opts: LaunchOptions, argv: list[str], worker_args: list[str] | None,
                   single_node: bool) -> int:
    # refuse at once if the run is in use; on one node, held until the ranks are gone (lock.py)
    lock = LauncherLock(run_dir, single_node=single_node).acquire()
    if worker_args is None:
        head, sep, tail = _split_at_dashdash(argv)
        worker_args = ["launch", *head, "--run.name", run_dir.name, "--run.no-timestamp", *sep, *tail]
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args([*opts.torchrun_args(), "--module", "pimm_core.cli", *worker_args])
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    # torchrun's agent announces the forwarded stop signal ("Received 15 death signal, shutting
    # down workers"): the ranks' stop summary says it for the user. Its loggers set their own level.
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    # torchrun logs each failed rank at ERROR; pimm prints one line naming the cause instead
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    with lock, tempfile.TemporaryDirectory(prefix="pimm-rank-errors-") as errors_dir:
        os.environ[RANK_ERRORS_ENV] = errors_dir  # the ranks inherit it (see errors.report)
        os.environ[LAUNCH_ENV] = json.dumps(opts.record())  # recorded in provenance for `pimm resume`
        os.environ[PROGRAM_ENV] = json.dumps(program())  # the ranks print commands as the user started pimm
        # torchrun sets OMP_NUM_THREADS=1 for the ranks when it is unset, with a four-line
        # warning on every launch; set the same value here (a user's own value is kept).
        omp_was_set = "OMP_NUM_THREADS" in os.environ
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        try:
            return _run_ranks(run, args, run_dir, errors_dir)
        finally:
            os.environ.pop(RANK_ERRORS_ENV, None)
            os.environ.pop(LAUNCH_ENV, None)
            os.environ.pop(PROGRAM_ENV, None)
            if not omp_was_set:
                os.environ.pop("OMP_NUM_THREADS", None)


def _run_ranks(run, args, run_dir: Path, errors_dir: str) -> int:
    """``torch.distributed.run.run(args)``, turning its outcome into one report and an exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        run(args)
    except SignalException as e:
        # torchrun forwarded the signal to the ranks; they stop cleanly and save `last`. A
        # further signal raises again inside torchrun's wait for the ranks and lands here
        # early: ignore any more and wait for the ranks before reporting.
        _wait_for_children()
        status = read_json(run_dir / STATUS) or {}
        if status.get("state") == "stopped":
            return 0  # rank 0 printed the stop summary and the resume command
        print(f"error: interrupted by signal {e.sigval.name} before the ranks could stop cleanly; "
              f"see {run_dir / 'train.log'}", file=sys.stderr)
        return 1
    except ChildFailedError as e:
        code, line = _failure_report(e.failures, rank_errors(errors_dir), run_dir)
        print(line, file=sys.stderr)
        return code
    return 0


def _failure_report(failures: dict, reports: dict[int, dict], run_dir: Path) -> tuple[int, str]:
    """One ``error:`` line and the exit code for failed ranks, naming the root cause.

    When one rank fails, torchrun stops the others with SIGTERM and the ranks blocked in a
    collective with it fail too ("secondary" reports): the cause is, in order, the lowest
    rank that reported a primary error, else the lowest rank that died some other way
    (killed by a signal, a crash with its traceback above), else the lowest failed rank.
    """
    primary = {r: v for r, v in reports.items() if not v.get("secondary")}
    if primary:
        rank = min(primary)
        msg = primary[rank]["message"]
        return int(primary[rank]["code"]), (f"error: {msg}" if rank == 0 else f"error: rank {rank}: {msg}")
    died = [r for r, f in failures.items() if r not in reports and f.exitcode != -signal.SIGTERM]
    rank = min(died or failures)
    exitcode = failures[rank].exitcode
    if exitcode is not None and exitcode < 0:
        how = f"was killed by {signal.Signals(-exitcode).name}"
    else:
        how = f"failed with exit code {exitcode} (its output is above)"
    return 1, (f"error: rank {rank} {how}; the run stopped; see {run_dir / 'train.log'} and resume with: "
               f"{resume_command(run_dir)}")


def _wait_for_children(timeout: float = 300.0) -> None:
    """Ignore SIGINT/SIGTERM and reap this process's children (the local ranks) until none is left."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no child left
        if pid == 0:
            time.sleep(0.05)


def strip_launcher_flags(argv: list[str]) -> list[str]:
    """Remove torchrun-level flags (and their values) from ``launch`` arguments."""
    flags = {"--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend",
             "--master-addr", "--master-port"}
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def _split_at_dashdash(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], ["--"], argv[i + 1:]
    return argv, [], []
