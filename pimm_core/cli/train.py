"""``pimm launch``, ``pimm resume`` and ``pimm stop``: start, continue and stop a run.

The work is in :mod:`pimm_core.launch` (imported when a command runs: it needs torch);
these commands turn flags into its calls.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from ..errors import PimmError, UsageError
from ..process.shell import command
from ._common import ARGV, Command

app = typer.Typer()


@app.command(cls=Command, context_settings={"allow_interspersed_args": False})
def launch(
    config: Optional[Path] = typer.Option(None, "--train.config", help="TOML config file (required)."),
    name: Optional[str] = typer.Option(None, "--run.name", help="Run name (default: the config file's stem)."),
    no_timestamp: bool = typer.Option(False, "--run.no-timestamp", help="Do not add -YYYYmmdd-HHMMSS to the name."),
    root: Optional[str] = typer.Option(None, "--run.root", help="Root of run directories (default: exp)."),
    resume: bool = typer.Option(False, "--train.resume", help="Resume this run from its newest complete checkpoint."),
    auto_resume: bool = typer.Option(False, "--train.auto-resume",
                                     help="Resume if the run has an intact checkpoint, else start it fresh "
                                          "(the command a cluster job repeats on every requeue)."),
    resume_from: Optional[str] = typer.Option(None, "--train.resume-from",
                                              help="Resume from this checkpoint directory (implies --train.resume)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what a (resumed) launch would do, then exit."),
    weight: Optional[str] = typer.Option(None, "--train.weight",
                                         help="Warm start: load model weights (only) from this path or hf://org/repo."),
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", help="Ranks on this node (torchrun)."),
    nnodes: Optional[str] = typer.Option(None, "--nnodes", help="Nodes, or MIN:MAX (torchrun)."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="This node's rank (torchrun)."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous (torchrun)."),
    rdzv_backend: Optional[str] = typer.Option(None, "--rdzv-backend", help="Rendezvous backend, e.g. c10d (torchrun)."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Rank-0 host for static rendezvous (torchrun)."),
    master_port: Optional[int] = typer.Option(None, "--master-port", help="Rank-0 port for static rendezvous (torchrun)."),
    max_restarts: Optional[int] = typer.Option(None, "--max-restarts",
                                               help="Restart the ranks this often when one fails (torchrun's "
                                                    "elastic agent; with checkpoint.memory_every_steps they "
                                                    "recover from memory). Default 0."),
    rdzv_conf: Optional[str] = typer.Option(None, "--rdzv-conf",
                                            help="Rendezvous settings KEY=VALUE,... (torchrun), e.g. "
                                                 "last_call_timeout=5,keep_alive_interval=1: how soon a restart "
                                                 "after a lost node goes on without it."),
    overrides: Optional[list[str]] = typer.Argument(None, help="Config overrides after --, e.g. -- train.epochs=3"),
) -> None:
    """Train a model from a config (one process, or many through torchrun)."""
    from ..config import load_config
    from ..launch import LaunchOptions, auto_resume as auto_resume_cfg, dry_run as plan_only, resolve_run_dir, spawn
    from ..launch import strip_launcher_flags, train_here

    if config is None:
        raise UsageError("pimm launch needs --train.config FILE (e.g. --train.config configs/digits.toml); "
                         "to continue a run, use pimm resume RUN_DIR")
    extra: dict[str, object] = {}
    if name is not None:
        extra["run.name"] = name
    if no_timestamp:
        extra["run.no_timestamp"] = True
    if root is not None:
        extra["run.root"] = root
    if resume or resume_from:
        extra["train.resume"] = True
    if weight is not None:
        extra["train.weight"] = weight
    cfg = load_config(config, overrides or [], extra)
    opts = LaunchOptions(nproc_per_node, nnodes, node_rank, rdzv_endpoint, rdzv_backend, master_addr, master_port,
                         max_restarts, rdzv_conf)
    opts.check()
    if not opts.single_node() and not cfg.run.no_timestamp:
        # each node's agent names the run on its own: a timestamp could differ between them
        raise UsageError("a multi-node launch needs a run name every node agrees on: pass the same --run.name NAME "
                         "--run.no-timestamp on every node")
    from ..process.dist import under_launcher

    if not under_launcher():  # (a rank gets no launcher flags)
        opts.check_rdzv_conf_applies()

    is_rank0 = not under_launcher() or os.environ.get("RANK", "0") == "0"
    if auto_resume or resume or resume_from:
        from ..launch.requeue import restart_resumes

        restart_resumes()  # the job's command resumes: train.requeue unset may requeue it (Slurm)
    if auto_resume and not (resume or resume_from):
        cfg = auto_resume_cfg(cfg, resolve_run_dir(cfg, config), is_main=is_rank0 and not dry_run)
    if dry_run:
        raise typer.Exit(plan_only(cfg, config, resume_from, opts.world_size()))
    if opts.wants_spawn() and not under_launcher():
        argv = strip_launcher_flags(ARGV[ARGV.index("launch") + 1:] if "launch" in ARGV else [])
        if overrides and "--" not in argv and argv[-len(overrides):] == overrides:
            # overrides written without `--` (the first positional ends the options): the ranks' flags
            # (--run.name, --train.resume) are added before them, so mark where they start
            argv = [*argv[:-len(overrides)], "--", *overrides]
        if auto_resume:  # decided here, once, for every rank of this node
            argv = [a for a in argv if a != "--train.auto-resume"]
            if cfg.train.resume:
                argv.insert(argv.index("--") if "--" in argv else len(argv), "--train.resume")
        raise typer.Exit(spawn(cfg, config, argv, opts, leftovers_ok=auto_resume))
    raise typer.Exit(train_here(cfg, config, resume_from, leftovers_ok=auto_resume))


@app.command(cls=Command, context_settings={"allow_interspersed_args": True})
def resume(
    run_dir: Path = typer.Argument(..., help="The run directory (exp/<group>/<run>)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what the resume would do, then exit."),
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node",
                                                 help="Ranks on this node (default: as the run was launched)."),
    nnodes: Optional[str] = typer.Option(None, "--nnodes", help="Nodes, or MIN:MAX (default: as recorded)."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="This node's rank (torchrun)."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous."),
    rdzv_backend: Optional[str] = typer.Option(None, "--rdzv-backend", help="Rendezvous backend, e.g. c10d."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Rank-0 host for static rendezvous."),
    master_port: Optional[int] = typer.Option(None, "--master-port", help="Rank-0 port for static rendezvous."),
    max_restarts: Optional[int] = typer.Option(None, "--max-restarts",
                                               help="Restart the ranks this often when one fails (default: as recorded, else 0)."),
    rdzv_conf: Optional[str] = typer.Option(None, "--rdzv-conf",
                                            help="Rendezvous settings KEY=VALUE,... (torchrun; default: as recorded)."),
    overrides: Optional[list[str]] = typer.Argument(None, help="Config changes after --, e.g. -- train.epochs=40"),
) -> None:
    """Resume a run from its own directory: its config.toml and recorded launch, plus explicit overrides."""
    from ..process.dist import under_launcher
    from ..launch import LaunchOptions, dry_run as plan_only, resume_config, spawn, train_here
    from ..run import recorded_launch

    from ..run.provenance import recorded_search_path
    from ..targets import add_search_dirs, mark_run_record

    # The record is data: code is looked for in the recorded directories only for a config
    # target found nowhere else, and never in (or under) the run directory (targets.py).
    from ..launch.requeue import restart_resumes

    restart_resumes()  # (train.requeue unset may requeue a Slurm job that runs this command)
    mark_run_record(run_dir)
    add_search_dirs(recorded_search_path(run_dir))
    cfg = resume_config(run_dir, overrides or [])
    config_path = run_dir / "config.toml"
    if under_launcher():  # a rank (of our own spawn below, or of the user's torchrun/srun)
        raise typer.Exit(train_here(cfg, config_path))
    given = LaunchOptions(nproc_per_node, nnodes, node_rank, rdzv_endpoint, rdzv_backend, master_addr, master_port,
                          max_restarts, rdzv_conf)
    given.check()
    record = recorded_launch(run_dir)
    if record.get("launcher") == "external" and nproc_per_node is None:
        raise UsageError(f"{run_dir} was launched by an external launcher (torchrun/srun, world size "
                         f"{record.get('world_size')}); run `{command('resume', run_dir)}` under that launcher again, "
                         "or pass --nproc-per-node N to start the ranks here")
    opts = LaunchOptions.recorded(record, given)
    if rdzv_conf is not None:
        opts.check_rdzv_conf_applies()
    if rdzv_conf is None and opts.rdzv_conf is not None:
        opts.check()  # the recorded --rdzv-conf (a hand-edited provenance.json) is checked as a given one
    if not dry_run:
        from ..launch.rundir import restore_from_remote

        restore_from_remote(cfg, run_dir)  # a wiped model/: the newest complete remote checkpoint
    if dry_run:
        print(f"launch: {opts.describe()}")
        raise typer.Exit(plan_only(cfg, config_path, None, opts.world_size()))
    if opts.wants_spawn():
        worker_args = ["resume", str(run_dir), *(["--"] + list(overrides) if overrides else [])]
        raise typer.Exit(spawn(cfg, config_path, [], opts, worker_args=worker_args))
    raise typer.Exit(train_here(cfg, config_path))


@app.command(cls=Command)
def stop(
    run_dir: Path = typer.Argument(..., help="The run directory (exp/<group>/<run>)."),
    reason: str = typer.Option("operator", "--reason", help="Recorded as the run's stop_reason."),
) -> None:
    """Ask a live run to stop cleanly: it saves `last` at the next accumulation window and exits 0."""
    from ..process.lock import claimed_since
    from ..process.stop import write_stop_file
    from ..run.layout import was_started
    from ..watch.status import liveness

    if not was_started(run_dir):
        if claimed_since(run_dir) is not None:  # a live launch has claimed it and not written its files yet
            path = write_stop_file(run_dir, reason)
            print(f"stop requested ({reason}): wrote {path}; the run is starting: it stops before its first step "
                  "(nothing trained or saved)")
            return
        if not run_dir.exists():
            raise UsageError(f"{run_dir} does not exist; pass exp/<group>/<run>")
        raise UsageError(f"{run_dir} is not a run directory (no status.json or config.toml); pass exp/<group>/<run>")
    view = liveness(run_dir)  # the console's verdict: a live state, a fresh heartbeat, a process not gone
    if not view.live:
        why = view.note or (f"state {view.state}" if view.state else view.problem or "no status.json")
        raise PimmError(f"{run_dir} is not live ({why}); nothing to stop")
    path = write_stop_file(run_dir, reason)
    print(f"stop requested ({reason}): wrote {path}; the run saves last and exits at its next step")
