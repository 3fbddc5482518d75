"""``pimm launch``: resolve the run directory, then train here or hand over to torchrun.

- No ``--nproc-per-node``/``--nnodes`` (or already inside torchrun/srun): this process
  is a rank and trains.
- Otherwise ``torch.distributed.run`` (torchrun/elastic) starts the ranks, each running
  ``python -m pimm_core.cli launch`` with the same arguments and the resolved run name
  (so every rank agrees on the directory even with a timestamp suffix).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint.selection import list_candidates
from .config import Config
from .errors import UsageError
from .run import MODEL, run_dir_for, run_name


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

    def wants_spawn(self) -> bool:
        return (self.nproc_per_node or 1) > 1 or (self.nnodes not in (None, "1", "1:1"))

    def torchrun_args(self) -> list[str]:
        args = ["--nproc-per-node", str(self.nproc_per_node or 1), "--max-restarts", "0"]
        for flag, value in (("--nnodes", self.nnodes), ("--node-rank", self.node_rank),
                            ("--rdzv-endpoint", self.rdzv_endpoint), ("--rdzv-backend", self.rdzv_backend),
                            ("--master-addr", self.master_addr), ("--master-port", self.master_port)):
            if value is not None:
                args += [flag, str(value)]
        if not any(v is not None for v in (self.rdzv_endpoint, self.master_addr, self.nnodes)):
            args.append("--standalone")  # single node: torchrun picks a free port
        return args


def resolve_run_dir(cfg: Config, config_path: Path | None, *, when: float | None = None) -> Path:
    """``<run.root>/<run.group>/<name>[-timestamp]`` where name defaults to the config file's stem."""
    base = cfg.run.name or (config_path.stem if config_path else "run")
    return run_dir_for(cfg.run.root, cfg.run.group, run_name(base, timestamp=not cfg.run.no_timestamp, when=when))


def check_run_dir(cfg: Config, run_dir: Path) -> None:
    """Refuse what would lose work or silently start over (torch-free, runs before any rank starts).

    Raises:
        UsageError: the run root is a file; a fresh run would start in a directory that
            already has checkpoints; a resume was asked for but the run has none.
    """
    for parent in [run_dir, *run_dir.parents]:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"{parent} is a file, not a directory; choose another --run.root or --run.name")
    found = list_candidates(run_dir / MODEL)
    if cfg.train.resume:
        return  # the trainer selects and explains (see Trainer.train)
    if found:
        names = ", ".join(c.name for c in found[:4])
        raise UsageError(f"{run_dir} already has checkpoints ({names}); add --train.resume to continue it, "
                         "or choose another --run.name")


def setup_logging(is_main: bool) -> None:
    logger = logging.getLogger("pimm")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout if is_main else sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if is_main else logging.WARNING)
    logger.propagate = False


def train_here(cfg: Config, config_path: Path | None) -> int:
    """Run this process as one rank of the run; returns the exit code."""
    from . import dist

    info = dist.env_world()
    setup_logging(info.is_main)
    from .trainer import Trainer

    run_dir = resolve_run_dir(cfg, config_path)
    if info.is_main:
        check_run_dir(cfg, run_dir)
    start = time.perf_counter()
    trainer = Trainer(cfg, run_dir=run_dir)
    try:
        state = trainer.train(checkpoint_dir=run_dir / MODEL)
    finally:
        dist.shutdown()
    if info.is_main:
        best = f"{state.best_metric:.4f}" if state.best_metric is not None else "n/a"
        print(f"done: best {cfg.eval.metric} {best} (epoch {state.best_epoch}) | epochs {state.epoch} | "
              f"steps {state.global_step} | {time.perf_counter() - start:.1f} s | run {run_dir}", flush=True)
    return 0


def spawn(cfg: Config, config_path: Path | None, argv: list[str], opts: LaunchOptions) -> int:
    """Start the ranks with ``torch.distributed.run`` and wait for them.

    Args:
        argv: the ``launch`` arguments to give each rank (launcher flags removed).

    Returns:
        0 on success, else the first failed rank's exit code.
    """
    run_dir = resolve_run_dir(cfg, config_path)
    check_run_dir(cfg, run_dir)
    head, sep, tail = _split_at_dashdash(argv)
    worker_args = ["launch", *head, "--run.name", run_dir.name, "--run.no-timestamp", *sep, *tail]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args([*opts.torchrun_args(), "--module", "pimm_core.cli", *worker_args])
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = min(e.failures.items())
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        if code != 2:  # exit code 2 means the rank already printed a usage error
            print(f"error: rank {rank} failed with exit code {failure.exitcode}; see {run_dir / 'train.log'}",
                  file=sys.stderr)
        return code
    return 0


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
