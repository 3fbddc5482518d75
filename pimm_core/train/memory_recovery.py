"""Recovery after torchrun restarted the ranks (``pimm launch --max-restarts K``): from the tier holding
the newest step, the memory tier (the newest step every rank of the world that took it can reach there)
or the disk ``last`` (the resume path; its step read from its manifest), memory on a tie (it is faster),
said in one line.

The new ranks gather what each node holds in its shared-memory directories (each rank lists every rank
directory of the run on its node: its own, its node's other ranks', and those of ranks a restart no
longer runs), and agree on the newest step at which every rank of the world that took it (the copies
record their world size) can be reached: its own copy or its buddy's. What each new rank loads:

- **the same world size**: rank ``r`` loads rank ``r``'s copy (its RNG and loader cursor with it: the
  run continues bitwise, :func:`~.resume.apply_loaded`'s ``same`` row). Under FSDP2 or tensor parallel
  the copy holds rank ``r``'s own ``DTensor`` shards (:mod:`~..checkpoint.tensors.local_shards`), rebuilt
  on the restarted model's meshes and loaded into rank ``r``'s shards;
- **another world size** (a node lost for good under ``--nnodes MIN:MAX``, or one that joined): every
  rank loads old rank 0's copy. The model and optimizer state is replicated under DDP, and ``meta`` is
  rank 0's as a disk checkpoint's is; the per-rank RNG and cursor follow the resume policy at another
  world size, as the disk ``last``'s do (``global_order``: the samples consumed from the counters;
  ``world_size``: the epoch replays). Sharded state (FSDP, tensor parallel) is resharded: every new
  rank reads every old rank's copy (on its node or sent to it) and cuts its new shards from them
  (:mod:`.memory_reshard`); a copy that cannot be resharded sends every rank to the disk ``last``.

A rank that holds the copy it needs on its node reads it there; the others receive it from the lowest
rank holding it (over the side gloo group); the log and provenance name the copy each rank read. Every
copy's sha256 is checked before it is loaded; one failed check or load on any rank (an all-gather) sends
every rank to the disk tier, nothing applied.
"""

from __future__ import annotations

import hashlib
import io
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..checkpoint.formats.protocol import LoadedState
from ..checkpoint.memory import exchange
from ..checkpoint.tensors.local_shards import from_local, has_local, live_layouts
from ..checkpoint.tensors.state import unpack, unwrap
from ..faults import point, register
from ..process import dist
from ..run.memory_index import remove_rank_indexes_from
from .memory import MemorySnapshots, restart_count
from .memory_reshard import available_bytes, describe_reshard, merge_owners, too_big
from .resume import apply_loaded

if TYPE_CHECKING:
    from .host import TrainerHost

log = logging.getLogger("pimm")
register("memory.recovering")


class NoCommonStep(Exception):
    """The memory tier is not used for this restart (the message says why, in one clause)."""


def newest_tier(memory_step: int | None, disk_step: int | None) -> str | None:
    """The tier a restart recovers from: ``"memory"`` or ``"disk"``, whichever holds the newer step (a
    tie goes to memory: no disk read), None when neither holds one. Steps are global optimizer steps."""
    if memory_step is None:
        return "disk" if disk_step is not None else None
    return "disk" if disk_step is not None and disk_step > memory_step else "memory"


def disk_step(tr: TrainerHost, resume_from: Path | None) -> int | None:
    """The step of the checkpoint a disk recovery of ``resume_from`` would load, from its manifest (rank 0
    reads it, every rank gets it: a collective); None when there is none or it cannot be read.

    The restart already verified this choice in this process (``restart_config``; the hash pass is cached
    per file), so this reads manifests only."""
    step = None
    if tr.info.is_main and resume_from is not None and not str(resume_from).startswith("hf://"):
        from ..checkpoint.select.resume_path import resolve_resume_path

        try:
            step = resolve_resume_path(resume_from).step
        except Exception:  # noqa: BLE001 (the disk resume itself says what is wrong, if it is taken)
            step = None
    return dist.broadcast_object(step)


def _disk_clause(step: int, disk: int | None) -> str:
    """Why memory was taken, in a few words."""
    if disk is None:
        return "nothing on disk"
    return f"disk at step {disk} too: memory is faster" if disk == step else f"disk at step {disk} is older"


class Source(NamedTuple):
    """Where a new rank finds the copy it loads: the new rank reading it (``holder``), the old rank whose
    directory holds it (``kept_by``: the owner itself, else its buddy) and its sha256."""

    holder: int
    kept_by: int
    sha256: str


class Plan(NamedTuple):
    """The copies of one step every new rank loads (the same on every rank)."""

    step: int
    saved_world: int  # the world size that took the step
    needs: dict[int, int]  # new rank -> the old rank whose copy it loads
    sources: dict[int, Source]  # old rank -> where its copy is read
    local: dict[int, set[int]]  # old rank -> the new ranks holding its copy on their node


def plan_recovery(everyone: list[list[tuple[int, int, int, str, int]]], world: int, *,
                  every_owner: bool = False) -> Plan:
    """The newest step every rank of the world that took it can be reached at, and who reads what.

    Args:
        everyone: per new rank, the complete copies on its node as ``(saved_world, owner, step, sha256,
            kept_by)`` (``kept_by``: the rank directory holding it).
        world: the new world size.
        every_owner: a source for every old rank's copy (sharded state at another world size: every new
            rank reads them all), not only for those in ``needs``.

    Raises:
        NoCommonStep: no such step (the message names the ranks without a copy).
    """
    reach: dict[tuple[int, int], dict[int, dict[int, tuple[int, str]]]] = {}  # (world, step) -> owner -> holder
    for holder, copies in enumerate(everyone):
        for saved_world, owner, step, sha, kept_by in copies:
            if 0 <= owner < saved_world:
                reach.setdefault((saved_world, step), {}).setdefault(owner, {})[holder] = (kept_by, sha)
    whole = [key for key, owners in reach.items() if len(owners) == key[0]]
    if not whole:
        newest = max(reach, key=lambda k: (k[1], len(reach[k])), default=None)
        lost = [r for r in range(newest[0]) if r not in reach[newest]] if newest else []
        why = f"rank {', '.join(map(str, lost))} has no copy" if lost else "no copy on any node"
        if newest and newest[0] != world:
            why += f" of step {newest[1]} at the previous world size {newest[0]}"
        raise NoCommonStep(f"no step every rank can reach in memory ({why})")
    saved_world, step = max(whole, key=lambda k: (k[1], k[0] == world))
    owners = reach[(saved_world, step)]
    needs = {r: r for r in range(world)} if saved_world == world else {r: 0 for r in range(world)}
    sources, local = {}, {}
    for owner in range(saved_world) if every_owner else sorted(set(needs.values())):
        holders = owners[owner]
        # read where it lies when the owner holds it (no transfer), else from the lowest holder
        holder = owner if owner in holders and saved_world == world else min(holders)
        kept_by, sha = holders[holder]
        sources[owner] = Source(holder, kept_by, sha)
        local[owner] = set(holders)
    return Plan(step, saved_world, needs, sources, local)


def describe_reads(plan: Plan, read: dict[int, int], world: int) -> tuple[dict[int, int], str]:
    """Which copy each new rank actually read, for the log and provenance: ``from_buddy`` (old rank ->
    the buddy rank whose directory held the copy of its state that was read) and the log's clause.

    Args:
        read: new rank -> the old rank directory whose copy it read (on its own node that may be
            another directory than the plan's sender's: a node holds an owner's own copy, another
            node its buddy's).
    """
    from_buddy = {plan.needs[r]: b for r, b in sorted(read.items()) if b != plan.needs[r]}
    if plan.saved_world == world:
        return from_buddy, "; ".join(f"rank {o} from its buddy rank {b}" for o, b in sorted(from_buddy.items())) \
            or "every rank from its own copy"
    by_buddy = [r for r, b in sorted(read.items()) if b != 0]
    kept = "its own" if not by_buddy else f"held by its buddy rank {from_buddy[0]}" if len(by_buddy) == len(read) \
        else f"its own; new rank {', '.join(map(str, by_buddy))} read the one held by its buddy rank {from_buddy[0]}"
    return from_buddy, f"world size {plan.saved_world} -> {world}: every rank from rank 0's copy ({kept})"


def recover_from_memory(tr: TrainerHost, mem: MemorySnapshots, checkpoint_dir: Path | None,
                        disk: int | None = None) -> dict[str, Any]:
    """Load the newest step every rank can reach in memory and apply it; the provenance entry.

    Args:
        disk: the step a disk recovery would load (:func:`disk_step`, the same on every rank).

    Raises:
        NoCommonStep: no such step, the disk's step is newer (:func:`newest_tier`), or a checksum or load
            failed on some rank (every rank raises it, before any state is applied).
    """
    point("memory.recovering")
    held: dict[tuple[int, int, int], tuple[int, Any]] = {}  # (world, owner, step) -> (kept_by, Held)
    for kept_by, copies in mem.store.held_on_node().items():
        for h in copies:
            key = (h.copy.world or mem.world, h.copy.rank, h.copy.step)
            if key not in held or kept_by == h.copy.rank:  # (the owner's own copy first)
                held[key] = (kept_by, h)
    mine = sorted((w, o, s, h.copy.sha256, kept_by) for (w, o, s), (kept_by, h) in held.items())
    layouts = live_layouts(tr.model)  # (the same on every rank: one config)
    plan = plan_recovery(dist.all_gather_object(mine), mem.world, every_owner=bool(layouts))
    step, saved_world = plan.step, plan.saved_world
    if newest_tier(step, disk) == "disk":  # decided from values every rank has: no copy is read
        raise NoCommonStep(f"newer than the newest step every rank can reach in memory, {step}")
    if layouts and saved_world != mem.world:  # sharded state at another world size: every copy, resharded
        sizes = {o: h.copy.bytes for (w, o, s), (_, h) in held.items() if w == saved_world and s == step}
        free = available_bytes()
        gathered = dist.all_gather_object((sizes, None if free is None else free // mem.local))
        everyone = {o: n for node_sizes, _ in gathered for o, n in node_sizes.items()}
        why = too_big(sum(everyone.values()), [f for _, f in gathered])  # (the same on every rank)
        if why:
            raise NoCommonStep(why)
        return _apply(tr, mem, plan, *_resharded(tr, mem, plan, held), checkpoint_dir, disk)
    want = plan.needs[mem.rank]
    copies, problem, read = read_copies(mem, plan, held, sorted(plan.needs.items()))
    data, read_from = copies.get(want), read.get(want)  # (read_from: the rank directory whose copy it read)
    parsed = None
    if problem is None:
        try:
            parsed = _parse(bytes(data), saved_world, layouts, own_rank_state=want == mem.rank)
        except Exception as e:  # a copy that does not load: every rank goes to disk together, nothing applied
            problem = f"rank {mem.rank}'s copy of step {step} did not load ({type(e).__name__}: {e})"
    return _apply(tr, mem, plan, parsed, problem, read_from, checkpoint_dir, disk)


def _resharded(tr: TrainerHost, mem: MemorySnapshots, plan: Plan, held: dict) -> tuple[Any, str | None, Any]:
    """Every old rank's copy read, checked and merged into this rank's shards (:mod:`.memory_reshard`):
    ``(parsed, problem, read_from)`` as :func:`_apply` takes them."""
    every = [(r, o) for r in range(mem.world) for o in range(plan.saved_world)]  # (each new rank: every copy)
    copies, problem, read_from = read_copies(mem, plan, held, every)
    parsed = None
    if problem is None:
        try:
            objs = [_parse(copies.pop(o), plan.saved_world, reshard=True, own_rank_state=o == 0 and mem.rank == 0)
                    for o in range(plan.saved_world)]
            obj, (_, loaded, manifest) = merge_owners(tr, [o[0] for o in objs]), objs[0]
            loaded.ema_state_dict = obj.get("ema")  # (merged into this rank's shards)
            parsed = obj, loaded, manifest
        except Exception as e:  # every rank goes to disk together, nothing applied
            problem = f"the copies of step {plan.step} did not reshard ({type(e).__name__}: {e})"
    return parsed, problem, read_from


def _apply(tr: TrainerHost, mem: MemorySnapshots, plan: Plan, parsed: Any, problem: str | None, read_from: Any,
           checkpoint_dir: Path | None, disk: int | None) -> dict[str, Any]:
    """Every rank's outcome gathered; on no problem anywhere, the state applied and the line said."""
    step, saved_world = plan.step, plan.saved_world
    gathered = dist.all_gather_object((problem, read_from))
    problems = [p for p, _ in gathered if p]
    if problems:
        raise NoCommonStep(problems[0])
    obj, loaded, manifest = parsed
    unwrap(tr.model).load_state_dict(obj["model"])
    tr.optimizer.load_state_dict(obj["optimizer"])
    entry = apply_loaded(tr, loaded, manifest, f"memory step {step}", "memory", checkpoint_dir)
    read = {r: kept_by for r, (_, kept_by) in enumerate(gathered)}
    if isinstance(read_from, dict):  # resharded: every old rank's copy, each from a rank directory
        from_buddy, how = describe_reshard(read, saved_world, mem.world)
    else:
        from_buddy, how = describe_reads(plan, read, mem.world)
    restart = restart_count()
    line = f"recovered from memory at step {step} (restart {restart}; {how}; {_disk_clause(step, disk)})"
    if tr.info.is_main:
        log.info("%s", line)
        if saved_world > mem.world:  # the index files of ranks this world no longer runs
            remove_rank_indexes_from(tr.run_dir, mem.world)
    return {**entry, "kind": "recovery", "tier": "memory", "restart": restart, "checkpoint_step": step,
            "from_buddy": {str(o): b for o, b in from_buddy.items()}, "read_from": {str(r): b for r, b in read.items()},
            "disk_step": disk, "saved_world_size": saved_world, "world_size": mem.world, "message": line}


def read_copies(mem: MemorySnapshots, plan: Plan, held: dict[tuple[int, int, int], tuple[int, Any]],
                pairs: list[tuple[int, int]]) -> tuple[dict[int, bytes], str | None, dict[int, int]]:
    """The copies of ``plan.step`` each new rank needs, checked (sha256); a collective over ``mem.group``.

    Args:
        held: the complete copies on this node, ``(world, owner, step) -> (kept_by, Held)``.
        pairs: ``(new rank, old rank whose copy it needs)``, the same list in the same order on every rank.

    Returns:
        ``(copies, problem, read_from)`` for this rank: old rank -> its copy's bytes; the first problem (None:
        none); old rank -> the rank directory whose copy this rank read.
    """
    copies: dict[int, bytes] = {}
    read_from: dict[int, int] = {}
    problem: str | None = None
    sent: dict[int, bytes] = {}
    for new_rank, owner in pairs:
        src = plan.sources[owner]
        if new_rank in plan.local[owner]:  # on its node: read there
            if new_rank == mem.rank:
                read_from[owner], copy = held.get((plan.saved_world, owner, plan.step), (None, None))
                data, why = read_copy(mem, copy)
                problem = problem or (why and f"rank {owner}'s copy of step {plan.step}: {why}")
                if data is not None:
                    copies[owner] = data
        elif mem.rank == src.holder:  # another node's rank needs it: send the copy here (read once)
            if owner not in sent:
                sent[owner] = read_copy(mem, held.get((plan.saved_world, owner, plan.step), (None, None))[1])[0] or b""
            exchange.send_bytes(mem.group, sent[owner], new_rank)
        elif mem.rank == new_rank:
            data = bytes(exchange.recv_bytes(mem.group, src.holder))
            read_from[owner] = src.kept_by
            if not data:
                problem = problem or f"rank {src.holder} could not read its copy of rank {owner}"
            elif hashlib.sha256(data).hexdigest() != src.sha256:
                problem = problem or (f"the copy of rank {owner} at step {plan.step} from rank {src.holder} "
                                      "failed its sha256 check")
            else:
                copies[owner] = data
    return copies, problem, read_from


def read_copy(mem: MemorySnapshots, held: Any) -> tuple[bytes | None, str | None]:
    """The bytes of the copy ``held`` describes (None: not held), or None and why it could not be read."""
    if held is None:
        return None, "copy missing"
    try:
        return mem.store.read(held), None
    except (OSError, ValueError) as e:
        return None, str(e)


def _parse(data: bytes, world: int, layouts: dict[tuple, Any] | None = None, *, own_rank_state: bool = True,
           reshard: bool = False) -> tuple[dict[str, Any], LoadedState, dict[str, Any]]:
    """One snapshot read back (``weights_only``): its tensors, its trainer state and its manifest.

    Args:
        world: the world size its sidecar says took it.
        layouts: the live model's ``DTensor`` layouts (:func:`~..checkpoint.tensors.local_shards.live_layouts`;
            empty or None: the model is not sharded): a sharded copy's local shards become ``DTensor`` s on them.
        reshard: a sharded copy left as its local shards (:func:`~.memory_reshard.merge_owners` merges them).
        own_rank_state: the copy is this rank's own (its RNG and cursor apply); else another rank's,
            whose per-rank state is left out (as a disk checkpoint has no entry for a rank it did not have).

    Raises:
        ValueError: taken at another world size, or sharded otherwise than the model is now.
            pickle.UnpicklingError and others: not a snapshot.
    """
    obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    if not reshard and bool(layouts) != has_local(obj["model"]):
        raise ValueError(f"a copy of {'sharded' if has_local(obj['model']) else 'unsharded'} state; the model is "
                         f"{'sharded' if layouts else 'unsharded'} now")
    if layouts:  # (each rank's own shards: the same world size and layout, checked entry by entry)
        obj.update({k: from_local(obj.get(k), layouts) for k in ("model", "optimizer", "ema")})
    meta, rank_state, manifest = unpack(obj["meta"]), unpack(obj["rank_state"]), unpack(obj["manifest"])
    if meta.get("world_size") != world:
        raise ValueError(f"taken at world size {meta.get('world_size')}, its sidecar says {world}")
    return obj, LoadedState(meta=meta, rank_state=rank_state if own_rank_state else None,
                            ema_state_dict=obj.get("ema"), saved_ranks=list(range(world)), skipped=[]), manifest


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
            topology = entry.get("topology") or {}
            tr.recorder.status_extra["recovery"] = {k: entry[k] for k in ("tier", "step", "restart", "message")} | {
                "saved_world_size": topology.get("saved_world_size"), "world_size": tr.info.world_size}
        return entry
    return resume(tr, resume_from, checkpoint_dir) if resume_from is not None else entry


def recover(tr: TrainerHost, mem: MemorySnapshots | None, resume_from: Path | None,
            checkpoint_dir: Path | None) -> dict[str, Any] | None:
    """A restart's recovery from the tier holding the newest step (:func:`newest_tier`): memory, or disk
    ``resume_from``; the provenance entry, None when there is nothing to recover from (the run starts over,
    said in one line)."""
    from .resume import resume

    restart = restart_count()
    why = "the memory tier is off (checkpoint.memory_every_steps = 0)"
    if mem is not None:
        try:
            return recover_from_memory(tr, mem, checkpoint_dir, disk_step(tr, resume_from))
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
