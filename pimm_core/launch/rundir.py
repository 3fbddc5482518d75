"""The run directory before a launch: its name, claiming it, and the checks that refuse
what the launch would refuse later (a file in the way, checkpoints a fresh start would
overwrite, a resume with nothing to resume, a finished run); ``--train.auto-resume`` and
``pimm resume``'s config and recorded launch."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from ..checkpoint.select.resume_path import resolve_resume_path
from ..checkpoint.select.selection import explain, list_candidates, select_resume
from ..config import Config
from ..errors import CheckpointError, ConfigError, UsageError
from ..process.lock import check_not_in_use
from ..process.shell import resume_command
from ..run import (CONFIG, METRICS, SUPERSEDED, MODEL, STATUS, RunDirClaim, append_provenance, claim_run_dir,
                   free_run_dir, now_iso, read_run_status, run_dir_for, run_name)
from ..run.entries import check_run_entries, ensure_dir
from ..run.layout import NAME_SUFFIX_MAX, name_problem
from ..run.topology import continue_override, finished_message, is_finished


def resolve_run_dir(cfg: Config, config_path: Path | None, *, when: float | None = None) -> Path:
    """``<run.root>/<run.group>/<name>[-timestamp]`` where name defaults to the config file's stem.

    A timestamped name that exists already (a launch in the same second) becomes
    ``<name>-<stamp>-2``, ``-3``... (the first free one; :func:`claim_run_dir` takes it),
    except in a rank of an external launcher, whose ranks must all compute the same name.
    """
    base = cfg.run.name or (config_path.stem if config_path else "run")
    problem = name_problem(base, suffix=0 if cfg.run.no_timestamp else NAME_SUFFIX_MAX)
    if problem:  # a name given is checked with the config; this is the config file's stem
        raise UsageError(f"the run name {base!r} (the config file's name) {problem}; pass --run.name NAME")
    run_dir = run_dir_for(cfg.run.root, cfg.run.group, run_name(base, timestamp=not cfg.run.no_timestamp, when=when))
    return free_run_dir(run_dir) if _numbered_names(cfg) else run_dir


def _numbered_names(cfg: Config) -> bool:
    """This process chooses a timestamped run name alone (not a rank of an external torchrun/srun)."""
    from ..process.dist import under_launcher

    return not cfg.run.no_timestamp and not under_launcher()


def claim(cfg: Config, run_dir: Path, *, single_node: bool = True) -> RunDirClaim:
    """Create the run directory before the launch writes anything (see :func:`pimm_core.run.claim_run_dir`)."""
    return claim_run_dir(run_dir, numbered_names=_numbered_names(cfg) and single_node)


def check_before_launch(cfg: Config, run_dir: Path, *, leftovers_ok: bool = False, warm_start: bool = True,
                        config_path: Path | None = None) -> None:
    """Refuse, before the run directory is created and before any rank starts, what the
    launch would refuse later or what would lose work or silently start over.

    Args:
        warm_start: also resolve ``train.weight`` (downloading ``hf://``) and refuse a
            source that is missing or not a PyTorch checkpoint (``--dry-run`` checks it
            its own way, without downloading).
        config_path: the config file (its directory is searched for user code).

    Raises:
        UsageError: the run root is a file; a fresh run would start in a directory that
            already has checkpoints; a resume was asked for but the run has none.
        RunEntryError: a file pimm writes in the run directory is a link or the wrong kind of entry.
        ConfigError: a config value the trainer would refuse, a wrong target or ``args``
            (:func:`check_config`).
        CheckpointError: the warm-start source does not resolve or is not a checkpoint.
    """
    for parent in [run_dir, *run_dir.parents]:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"{parent} is a file, not a directory; choose another --run.root or --run.name")
    if run_dir.is_dir():
        check_run_entries(run_dir)  # a link or a wrong kind of entry where pimm writes: refused before anything
    check_config(cfg, config_path)
    if cfg.train.resume:
        return
    if warm_start and cfg.train.weight:
        from ..checkpoint.weights.sources import check_weight_source

        from ..checkpoint.remote.source import options_for

        check_weight_source(cfg.train.weight, storage_options=options_for(
            cfg.train.weight, cfg.checkpoint.remote, cfg.checkpoint.remote_options))
    # Even a leftover of an interrupted save belongs to an earlier run of this name: never
    # start over on top of it (the new run would delete it) without the user's say-so.
    found = list_candidates(run_dir / MODEL)
    if not found:
        return
    names = ", ".join(c.name for c in found[:4])
    if any(c.complete and c.resumable for c in found):
        check_not_in_use(run_dir)  # (a live run: `pimm resume` would be refused too; stopping it is the way)
        raise UsageError(f"{run_dir} already has checkpoints ({names}); continue it with: {resume_command(run_dir)} "
                         "(or add --train.resume), or choose another --run.name")
    # Nothing resumable (e.g. killed during its first save): neither a fresh start nor a resume
    # can proceed, so say how to get out instead of pointing at --train.resume.
    if leftovers_ok:
        return  # --train.auto-resume: rank 0 moves them aside (auto_resume)
    raise UsageError(f"{run_dir} has checkpoint files ({names}) but none can be resumed; move or remove "
                     f"{run_dir / MODEL} to start this run over (--train.auto-resume moves it aside for you), "
                     "or choose another --run.name")


def check_config(cfg: Config, config_path: Path | None = None) -> None:
    """Refuse the config values that only building the run would otherwise reject: an
    unknown ``data.name`` or ``model.name``, a wrong target or ``args`` table
    (:func:`pimm_core.train.plugins.check_targets`: user modules are imported, nothing is built),
    ``train.device = "cuda"`` without CUDA, ``train.amp = "fp16"`` without CUDA, DataLoader workers
    under a ``$TMPDIR`` too deep for their sockets.

    Raises:
        ConfigError: names the key and the values that work.
        Exception: whatever a user module raises while it is imported, unchanged.
    """
    import torch

    from ..train.plugins import check_targets

    check_targets(cfg, config_path)
    if cfg.data.num_workers > 0:
        from ..data.workers import check_socket_dir

        check_socket_dir()  # ($TMPDIR too deep for the workers' sockets: refused here, not at the first batch)
    from ..train.sinks import check_available

    check_available(cfg)  # the packages of log.tensorboard, [log.mlflow] and [log.wandb]
    cuda = torch.cuda.is_available()
    if cfg.train.device == "cuda" and not cuda:
        raise ConfigError("train.device = 'cuda' but CUDA is not available here; use 'auto' or 'cpu'")
    if cfg.train.amp == "fp16" and not (cuda and cfg.train.device != "cpu"):
        raise ConfigError("train.amp = 'fp16' needs CUDA; use 'bf16' or 'none' on CPU")


def resume_config(run_dir: Path, overrides: list[str]) -> Config:
    """The run's own resolved ``config.toml`` plus explicit ``overrides``, pointed at ``run_dir``.

    Raises:
        UsageError: ``run_dir`` is not a run directory written by pimm (no ``config.toml``).
        ConfigError: the saved config or an override is invalid.
    """
    from ..config import load_config

    if run_dir.is_file():
        raise UsageError(f"{run_dir} is a file; pass the run directory that holds it (exp/<group>/<run>)")
    if not (run_dir / CONFIG).is_file():
        what = "does not exist" if not run_dir.exists() else "has no config.toml"
        raise UsageError(f"{run_dir} {what}; pass a run directory written by pimm launch (exp/<group>/<run>)")
    for text in overrides:  # where the run is and what it loads are the directory's, not deltas
        key = text.split("=", 1)[0].strip()
        if key.startswith("run.") or key in ("train.resume", "train.weight", "train.weight_set"):
            raise UsageError(f"{key} cannot change on pimm resume: it resumes {run_dir} where it is, from its own "
                             "checkpoints (move the directory to move the run; warm-start a new run with pimm "
                             "launch --train.weight)")
    where = Path(os.path.abspath(run_dir))  # `pimm resume .` inside the run: its own name, not ''
    extra = {"run.root": str(where.parent.parent), "run.group": where.parent.name, "run.name": where.name,
             "run.no_timestamp": True, "train.resume": True}
    return load_config(run_dir / CONFIG, overrides, extra)


def auto_resume(cfg: Config, run_dir: Path, *, is_main: bool = True) -> Config:
    """``--train.auto-resume``: resume when the run has an intact checkpoint, else start it fresh.

    The command a cluster job script repeats on every (re)start. Leftovers of saves that
    never completed (nothing resumable in ``model/``) do not block it and are not deleted:
    rank 0 moves the whole ``model/`` directory to ``<run>/abandoned/<time>/`` and says so.
    """
    chosen, cands = select_resume(run_dir / MODEL)
    if chosen is not None or any(c.complete and c.resumable for c in cands):
        # an intact checkpoint resumes; a complete one that fails verification is refused by the
        # resume ("no intact checkpoint", exit 1) rather than thrown away with the run's progress;
        # a newer complete one on the remote replaces an older local one (remote_choice)
        if is_main and chosen is not None:
            restore_from_remote(cfg, run_dir)
        return replace(cfg, train=replace(cfg.train, resume=True))
    if cands and is_main:
        try:
            moved = set_aside(run_dir / MODEL, run_dir / "abandoned")
        except FileNotFoundError:
            # another node's agent of this multi-node launch moved it first (each agent decides
            # alone, before the rendezvous; one rename wins), and said so
            return replace(cfg, train=replace(cfg.train, resume=False))
        for name in (METRICS, SUPERSEDED, STATUS):  # the abandoned attempt's log goes with its leftovers
            if (run_dir / name).exists():
                os.replace(run_dir / name, moved / name)
        append_provenance(run_dir, {}, {"time": now_iso(), "kind": "abandoned", "moved_to": str(moved),
                                        "found": explain(cands, None)})
        logging.getLogger("pimm").warning(
            "warning: %s held no resumable checkpoint (%s); moved it, with that attempt's metrics.jsonl and "
            "status.json, to %s and starting the run fresh (nothing was deleted; remove it when you no longer "
            "need it)", run_dir / MODEL, "; ".join(explain(cands, None)), moved)
    if is_main and restore_from_remote(cfg, run_dir):
        return replace(cfg, train=replace(cfg.train, resume=True))
    return replace(cfg, train=replace(cfg.train, resume=False))


def restore_from_remote(cfg: Config, run_dir: Path) -> bool:
    """``checkpoint.remote`` set and the remote's newest complete checkpoint newer than the one
    ``<run>/model/`` would resume from (or ``model/`` holds none: :func:`~pimm_core.checkpoint.remote.choice.resume_choice`):
    download it as ``model/last`` (checked against its manifest; an older local ``last`` is moved to
    ``<run>/abandoned/``), then the remote's weights files ``model/`` lacks (``model_best.pth``,
    ``best_<step>.pth``, ``iter_<step>.pth``; ``model_best.pth`` replaced when the remote's differs).
    Says in one log line which one the resume takes and why. True when a checkpoint was downloaded.

    Rank 0's node only (one node, or ``model/`` on a file system every node shares). A store
    that cannot be read is a warning: the run then resumes (or starts) as it would without a remote.
    """
    if not cfg.checkpoint.remote:
        return False
    with _in_train_log(run_dir):  # the trainer's train.log is not open yet: these lines belong there too
        return _restore_from_remote(cfg, run_dir)


@contextlib.contextmanager
def _in_train_log(run_dir: Path) -> Iterator[None]:
    """The ``pimm`` log goes to ``run_dir/train.log`` too while inside (nothing when it cannot be
    opened: the trainer reports a train.log it cannot write). Where no console handler is set up
    yet, warnings still reach the terminal (stderr, as Python's last-resort handler shows them
    when a logger has none: adding the file's handler would silence it)."""
    import sys

    from ..run.log import log_handler

    log = logging.getLogger("pimm")
    added: list[logging.Handler] = []
    if not log.hasHandlers():
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        added.append(console)
    try:
        added.append(log_handler(run_dir))
    except (OSError, UsageError):
        pass
    for handler in added:
        log.addHandler(handler)
    try:
        yield
    finally:
        for handler in added:
            log.removeHandler(handler)
            handler.close()


def _restore_from_remote(cfg: Config, run_dir: Path) -> bool:
    from ..checkpoint.remote.choice import newest_complete, resume_choice
    from ..checkpoint.remote.store import RemoteError, download_newest, download_weights_files, open_store, remote_candidates, run_prefix
    from ..fsio import remove_tree

    c = cfg.checkpoint
    model = run_dir / MODEL
    log = logging.getLogger("pimm")
    local = select_resume(model)[0]
    dest = model / "last.tmp"  # a save's temporary name: removed if a download is cut short
    try:
        fs, _ = open_store(c.remote, c.remote_options)
        prefix = run_prefix(c.remote, run_dir)
        choice = resume_choice(local, newest_complete(remote_candidates(fs, fs._strip_protocol(prefix))))
        if choice.remote is None:
            if local is not None:
                log.info("%s", choice.reason)
            return False
        remove_tree(dest)
        got = download_newest(fs, fs._strip_protocol(prefix), dest)
    except RemoteError as e:
        remove_tree(dest)
        log.warning("warning: no checkpoint taken from the remote: %s", e)
        return False
    if got is None:
        return False
    # the run's other checkpoints too, so its retention continues from the set it had
    # (remote_store); before `last` is in place, so a restore cut short here is done again whole
    restored, failed = download_weights_files(fs, fs._strip_protocol(prefix), model, newer=local is not None)
    aside = set_aside(model / "last", run_dir / "abandoned") if os.path.lexists(model / "last") else None
    os.rename(dest, model / "last")
    log.warning("%s (downloaded %s/%s as %s%s)", choice.reason, prefix, got.name, model / "last",
                f"; the older local one moved to {aside}" if aside is not None else "")
    if restored:
        log.warning("downloaded from the remote into %s: %s", model, ", ".join(restored))
    if failed:
        log.warning("warning: not downloaded from the remote (left there; the run goes on without them): %s",
                    "; ".join(failed))
    return True


def set_aside(path: Path, under: Path) -> Path:
    """Move ``path`` (one rename, nothing copied or deleted) to ``under/<YYYYmmdd-HHMMSS>[-N]``."""
    ensure_dir(under)  # never a link: the leftovers stay inside the run
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
    return finished_at(cfg, resolve_resume_path(source).manifest or {}, run_dir)


def finished_at(cfg: Config, m: dict, run_dir: Path) -> str | None:
    """:func:`finished` for the checkpoint whose manifest is ``m`` (a remote one, too)."""
    state = read_run_status(run_dir).state  # None: no status.json (or a damaged one)
    if m.get("step") is None or not is_finished(m, epochs=cfg.train.epochs, max_steps=cfg.train.max_steps,
                                                run_state=state):
        return None
    step = int(m["step"])
    return (f"{finished_message(step, int(m.get('epoch') or 0), cfg.train)}, e.g.: "
            f"{resume_command(run_dir)} -- "
            f"{continue_override(step, int(m.get('epoch') or 0), cfg.train)}")


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
