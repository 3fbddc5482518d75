"""Recovery after torchrun restarted the ranks (``pimm launch --max-restarts K``): from the memory tier
when every rank can reach one step there, else from the disk ``last`` (the resume path), said in one line.

The new ranks gather what each holds in its shared-memory directory (its own copies and the copies of
the rank it is buddy to), agree on the newest step every rank can reach (one all-gather), and each
rank whose own copy of that step is missing (its node lost it) receives it from the rank holding it.
Every copy's sha256 is checked before it is loaded; one failed check or load on any rank (an
all-reduce) sends every rank to the disk tier. The state is applied as a resume applies a disk
checkpoint (:func:`~.resume.apply_loaded`: the same world size restores cursor and RNG, so the run
continues on the trajectory it was on). A restart at another world size falls back to disk.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint.formats.protocol import LoadedState
from ..checkpoint.memory import exchange
from ..checkpoint.tensors.state import unpack, unwrap
from ..faults import point, register
from ..process import dist
from .memory import MemorySnapshots, restart_count
from .resume import apply_loaded

if TYPE_CHECKING:
    from .host import TrainerHost

log = logging.getLogger("pimm")
register("memory.recovering")


class NoCommonStep(Exception):
    """The memory tier cannot be used for this restart (the message says why, in one clause)."""


def recover_from_memory(tr: TrainerHost, mem: MemorySnapshots, checkpoint_dir: Path | None) -> dict[str, Any]:
    """Load the newest step every rank can reach in memory and apply it; the provenance entry.

    Raises:
        NoCommonStep: no such step, a checksum or load failed on some rank, or the world size changed
            (every rank raises it, before any state is applied).
    """
    point("memory.recovering")
    held = {(h.copy.rank, h.copy.step): h for h in mem.store.held()}
    mine = sorted((owner, step, h.copy.sha256) for (owner, step), h in held.items())
    everyone = dist.all_gather_object(mine)
    reach: dict[int, dict[int, tuple[int, str]]] = {r: {} for r in range(mem.world)}  # owner -> step -> (holder, sha)
    for holder, copies in enumerate(everyone):
        for owner, step, sha in copies:
            if owner in reach and (step not in reach[owner] or holder == owner):
                reach[owner][step] = (holder, sha)
    common = set.intersection(*(set(steps) for steps in reach.values()))
    if not common:
        lost = sorted(r for r, steps in reach.items() if not steps)
        why = f"rank {', '.join(map(str, lost))} has no copy" if lost else "the ranks hold different steps"
        raise NoCommonStep(f"no step every rank can reach in memory ({why})")
    step = max(common)
    sources = {owner: reach[owner][step] for owner in range(mem.world)}
    data, problem = None, None
    for owner, (holder, sha) in sorted(sources.items()):  # every rank walks the same plan
        if holder == owner == mem.rank:
            data, problem = _read(mem, held.get((owner, step)))
        elif holder != owner and mem.rank == holder:
            got, why = _read(mem, held.get((owner, step)))
            exchange.send_bytes(mem.group, got if got is not None else b"", owner)
        elif holder != owner and mem.rank == owner:
            data = exchange.recv_bytes(mem.group, holder)
            problem = None if data else f"rank {holder} could not read its copy of rank {owner}"
            if data and _sha(data) != sha:
                problem = f"the copy of rank {owner} at step {step} from rank {holder} failed its sha256 check"
    parsed = None
    if problem is None:
        try:
            parsed = _parse(bytes(data), mem.world)
        except Exception as e:  # a copy that does not load: every rank goes to disk together, nothing applied
            problem = f"rank {mem.rank}'s copy of step {step} did not load ({type(e).__name__}: {e})"
    problems = [p for p in dist.all_gather_object(problem) if p]
    if problems:
        raise NoCommonStep(problems[0])
    obj, loaded, manifest = parsed
    unwrap(tr.model).load_state_dict(obj["model"])
    tr.optimizer.load_state_dict(obj["optimizer"])
    entry = apply_loaded(tr, loaded, manifest, f"memory step {step}", "memory", checkpoint_dir)
    from_buddies = [f"rank {o} from its buddy rank {h}" for o, (h, _) in sorted(sources.items()) if h != o]
    restart = restart_count()
    line = f"recovered from memory at step {step} (restart {restart}" + \
        (f"; {', '.join(from_buddies)})" if from_buddies else "; every rank from its own copy)")
    if tr.info.is_main:
        log.info("%s", line)
    return {**entry, "kind": "recovery", "tier": "memory", "restart": restart, "checkpoint_step": step,
            "from_buddy": {str(o): h for o, (h, _) in sources.items() if h != o}, "message": line}


def _sha(data: Any) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _read(mem: MemorySnapshots, held: Any) -> tuple[Any, str | None]:
    if held is None:
        return None, "copy missing"
    try:
        return mem.store.read(held), None
    except (OSError, ValueError) as e:
        return None, str(e)


def _parse(data: bytes, world: int) -> tuple[dict[str, Any], LoadedState, dict[str, Any]]:
    """One snapshot read back (``weights_only``): its tensors, its trainer state and its manifest.

    Raises:
        ValueError: taken at another world size. pickle.UnpicklingError and others: not a snapshot.
    """
    obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    meta, rank_state, manifest = unpack(obj["meta"]), unpack(obj["rank_state"]), unpack(obj["manifest"])
    if meta.get("world_size") != world:
        raise ValueError(f"taken at world size {meta.get('world_size')}, this restart runs {world} ranks")
    return obj, LoadedState(meta=meta, rank_state=rank_state, ema_state_dict=obj.get("ema"),
                            saved_ranks=list(range(world)), skipped=[]), manifest


def start_memory_and_resume(tr: Any, entry: dict[str, Any], resume_from: Path | None,
                            checkpoint_dir: Path | None) -> dict[str, Any]:
    """At a ``train()`` start: open the memory tier (``checkpoint.memory_every_steps``; a collective) as
    ``tr.checkpointer.memory``; after a torchrun restart recover (:func:`recover`), else resume ``resume_from`` if
    given. Returns the provenance entry (``entry`` itself for a fresh start)."""
    from .resume import resume

    every = tr.config.checkpoint.memory_every_steps
    mem = tr.checkpointer.memory = MemorySnapshots(tr, every) if every and tr.run_dir is not None else None
    if mem is not None:
        mem.open()
        tr.recorder.status_extra = mem.status
    if restart_count():
        entry = recover(tr, mem, resume_from, checkpoint_dir) or entry
        if entry.get("kind") == "recovery":
            tr.recorder.status_extra["recovery"] = {k: entry[k] for k in ("tier", "step", "restart")}
        return entry
    return resume(tr, resume_from, checkpoint_dir) if resume_from is not None else entry


def recover(tr: TrainerHost, mem: MemorySnapshots | None, resume_from: Path | None,
            checkpoint_dir: Path | None) -> dict[str, Any] | None:
    """A restart's recovery: memory first, then disk ``resume_from``; the provenance entry, None when
    there is nothing to recover from (the run starts over, said in one line)."""
    from .resume import resume

    restart = restart_count()
    why = "the memory tier is off (checkpoint.memory_every_steps = 0)"
    if mem is not None:
        try:
            return recover_from_memory(tr, mem, checkpoint_dir)
        except NoCommonStep as e:
            why = str(e)
    if resume_from is None:
        if tr.info.is_main:
            log.warning("warning: restart %d: %s and no checkpoint on disk: training starts over from step 0",
                        restart, why)
        return None
    entry = resume(tr, resume_from, checkpoint_dir)
    line = f"recovered from disk at step {entry['step']} (restart {restart}; {why})"
    if tr.info.is_main:
        log.info("%s", line)
    return {**entry, "kind": "recovery", "tier": "disk", "restart": restart, "message": line}
