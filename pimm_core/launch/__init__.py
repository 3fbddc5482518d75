"""``pimm launch``: resolve the run directory, then train here or hand over to torchrun.

- No ``--nproc-per-node``/``--nnodes`` (or already inside torchrun/srun): this process
  is a rank and trains.
- Otherwise ``torch.distributed.run`` (torchrun/elastic) starts the ranks, each running
  ``python -m pimm_core.cli launch`` with the same arguments and the resolved run name
  (so every rank agrees on the directory even with a timestamp suffix).

The parts, by job: :mod:`.options` (launcher flags), :mod:`.rundir` (the run directory's
name and claim, the pre-launch checks, ``--train.auto-resume``, ``pimm resume``'s config),
:mod:`.preview` (``--dry-run``), :mod:`.local` (training in this process),
:mod:`.torchrun` (spawning the ranks, the failure report) and :mod:`.forward` (a
multi-node agent's stop signals). Their public names are
importable from here.

May import: every layer below (``trainer``, ``train``, ``checkpoint``, ``data``, ``config``, ``process``,
``run``), never ``cli`` or ``pimm_tui``.
"""

from __future__ import annotations

from ..process.console_log import setup_logging
from .local import train_here
from .options import LaunchOptions, strip_launcher_flags
from .preview import dry_run
from .rundir import (auto_resume, check_before_launch, check_config, claim, finished, resolve_run_dir, resume_config,
                     resume_source, set_aside)
from .torchrun import spawn

__all__ = ["LaunchOptions", "auto_resume", "check_before_launch", "check_config", "claim", "dry_run", "finished",
           "resolve_run_dir", "resume_config", "resume_source", "set_aside", "setup_logging",
           "spawn", "strip_launcher_flags", "train_here"]
