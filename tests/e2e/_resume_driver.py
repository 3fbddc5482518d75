"""Run pimm ``Trainer`` jobs for the resume tests, in-process or as the ranks of a torchrun job.

As a script (one process, or every rank under ``python -m torch.distributed.run``)::

    python tests/e2e/_resume_driver.py JOBS.json

``JOBS.json`` is a list of jobs run one after the other in the same process (group):
``{"run_dir", "overrides", "stop_at", "resume_from", "max_steps", "checkpoint": bool, "dump"}``.

- ``stop_at``: a callback requests a stop after that global step (an interruption: the
  trainer saves ``model/last`` mid-epoch and returns).
- ``max_steps=1`` with ``checkpoint=false`` is "load only": the resume restores
  everything, the loop has nothing left to do, nothing is saved; the restored state
  is then dumped for comparison.
- ``dump``: every rank writes ``<dump>.rank<r>.pt`` with its model state dict,
  optimizer state dict and :class:`TrainState` after ``train()`` returned.
- ``freeze``: ``[module, step]``: a callback freezes that submodule of the model
  (``requires_grad = False``) once the global step reaches ``step``, as a user freezing a layer
  mid-run does; ``freeze_now`` also freezes it before training (a resume past that step).
- ``full_dump``: rank 0 writes ``<full_dump>.pt``: the whole (gathered) model and optimizer
  state by parameter name, the EMA average and the :class:`TrainState`, for any strategy.
- ``stop_first``: a stop is requested before ``train()``: the resume restores everything, then
  the session ends before its first step (nothing trained or saved), whatever step it resumed
  at; for ``full_dump`` right after a resume.
- ``config``: another config file than ``configs/digits.toml`` (then BASE is not added).
- ``env``: ``{name: value}`` set in ``os.environ`` for that job only, restored after it (a name
  unset before is unset again): e.g. a ``USERPKG_SEEN`` of its own for each job of one launch.

A job ``{"script": PATH, "args": [...]}`` instead runs ``main(*args)`` of that script in the same
ranks (e.g. ``_tp_hf_worker.py``): a check that needs ranks of its own without a torchrun of its own.

Only public pieces are used: ``load_config``, ``Trainer(...).train(...)``,
``trainer.callbacks``, ``trainer.stop``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "digits.toml"

# Dropout on, one train record per step: loss and LR traces are comparable step by step.
BASE = ("model.dropout=0.3", "train.log_every_steps=1")


def run_job(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = (), *, stop_at: int | None = None,
            resume_from: str | Path | None = None, max_steps: int | None = None, checkpoint: bool = True,
            dump: str | Path | None = None, full_dump: str | Path | None = None,
            freeze: tuple[str, int] | list | None = None, freeze_now: bool = False,
            config: str | Path | None = None, stop_first: bool = False) -> Any:
    """Build a Trainer for ``configs/digits.toml`` + BASE + ``overrides`` (or ``config`` +
    ``overrides``) and train it; returns the trainer."""
    import torch

    from pimm_core import Trainer, load_config
    from pimm_core.checkpoint.tensors.state import unwrap

    run_dir = Path(run_dir)
    logger = logging.getLogger("pimm")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)  # in-process: train.log gets the INFO lines, as under the CLI
    handlers_before = list(logger.handlers)
    cfg = load_config(DIGITS, [*BASE, *overrides]) if config is None else load_config(Path(config), list(overrides))
    trainer = Trainer(cfg, run_dir=run_dir)
    if stop_at is not None:
        trainer.callbacks.append(lambda tr: tr.stop.request("test") if tr.state.global_step == stop_at else None)
    if stop_first:
        trainer.stop.request("test")
    if freeze is not None:
        layer = unwrap(trainer.model).get_submodule(freeze[0])

        def frozen(tr) -> None:
            if tr.state.global_step >= freeze[1]:
                layer.requires_grad_(False)

        trainer.callbacks.append(frozen)
        if freeze_now:
            layer.requires_grad_(False)
    t = replace(cfg.train, max_steps=max_steps) if max_steps is not None else None
    try:
        trainer.train(t, checkpoint_dir=run_dir / "model" if checkpoint else None,
                      resume_from=resume_from)
    finally:
        for h in list(logger.handlers):  # the trainer's train.log handler must not outlive this run
            if h not in handlers_before:
                logger.removeHandler(h)
                h.close()
    if dump is not None:
        torch.save({"model": unwrap(trainer.model).state_dict(), "optim": trainer.optimizer.state_dict(),
                    "state": asdict(trainer.state)}, f"{dump}.rank{trainer.info.rank}.pt")
    if full_dump is not None:  # any strategy: whole tensors by parameter name, written by rank 0
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        plain = unwrap(trainer.model)
        state = {"model": get_model_state_dict(plain, options=whole),
                 "optim": get_optimizer_state_dict(plain, trainer.optimizer, options=whole),
                 "ema": {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu()
                         for k, v in trainer.ema.shadow.items()} if trainer.ema is not None else None,
                 "state": asdict(trainer.state)}
        if trainer.info.is_main:
            torch.save(state, f"{full_dump}.pt")
    return trainer


def set_env(env: dict[str, str] | None):
    """Set ``env`` in ``os.environ``; returns the function that restores what was there."""
    before = {k: os.environ.get(k) for k in env or {}}
    os.environ.update({k: str(v) for k, v in (env or {}).items()})

    def restore() -> None:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    return restore


def main(argv: list[str]) -> int:
    from pimm_core.process import dist
    from pimm_core.launch import setup_logging

    jobs = json.loads(Path(argv[0]).read_text())
    setup_logging(dist.env_world().is_main)
    try:
        for job in jobs:
            if "script" in job:
                import runpy

                runpy.run_path(job["script"], run_name="__pimm_job__")["main"](*job.get("args", []))
                continue
            restore = set_env(job.get("env"))  # (a failed job ends the process: nothing to restore then)
            run_job(job["run_dir"], job.get("overrides", []), stop_at=job.get("stop_at"),
                    resume_from=job.get("resume_from"), max_steps=job.get("max_steps"),
                    checkpoint=job.get("checkpoint", True), dump=job.get("dump"), full_dump=job.get("full_dump"),
                    freeze=job.get("freeze"), freeze_now=job.get("freeze_now", False), config=job.get("config"),
                    stop_first=job.get("stop_first", False))
            restore()
    finally:
        dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main(sys.argv[1:]))
