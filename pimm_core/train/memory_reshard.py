"""Recovery of sharded state (FSDP2, tensor parallel) from the memory tier at another world size.

Each old rank's copy holds its own ``DTensor`` shards (:mod:`~..checkpoint.tensors.local_shards`), so
a new rank needs every old rank's copy: it reads those on its node (an owner's own, or the one its
buddy kept) and receives the others from the rank the plan names (:func:`read_every_copy`, the
plan's order on every rank). :func:`merge_owners` then builds each tensor whole from the shards and
cuts this rank's shard of the live layout from it: exact (the values are copied, nothing is reduced),
and every rank holds one copy of the whole state in CPU memory while it recovers. :func:`too_big` checks
first that the node's free memory holds that for each of its ranks; where it does not, every rank takes
the disk ``last`` instead, said in one line, rather than the node running out of memory.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from ..checkpoint.memory import exchange
from ..checkpoint.tensors.local_shards import from_owners
from ..checkpoint.tensors.state import unwrap

if TYPE_CHECKING:
    from .memory import MemorySnapshots


#: Bytes a rank holds per byte of the whole state while it reshards: the copies read, then their tensors.
RESHARD_FACTOR = 2


def available_bytes() -> int | None:
    """The node's free memory (``MemAvailable`` of ``/proc/meminfo``, bytes); None where it is not known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def too_big(state_bytes: int, free_per_rank: list[int | None]) -> str | None:
    """Why the ranks cannot reshard ``state_bytes`` (every old rank's copy together) in memory, or None.

    Args:
        state_bytes: the sizes of every old rank's copy of the step, summed (bytes).
        free_per_rank: each rank's share of its node's free memory (:func:`available_bytes` divided by
            the node's ranks; None: not known, not checked), in rank order.
    """
    need = RESHARD_FACTOR * state_bytes
    for rank, free in enumerate(free_per_rank):
        if free is not None and need > free:
            return (f"resharding from memory needs every old rank's copy in each rank's memory, about "
                    f"{need / 2**30:.2f} GiB, more than rank {rank}'s share of its node's free memory "
                    f"({free / 2**30:.2f} GiB)")
    return None


def read_every_copy(mem: MemorySnapshots, plan: Any, held: dict[tuple[int, int, int], tuple[int, Any]]
                    ) -> tuple[dict[int, bytes], str | None, dict[int, int]]:
    """Every old rank's copy of ``plan.step``, checked (sha256); a collective over ``mem.group``.

    Args:
        plan: the recovery plan (:class:`~.memory_recovery.Plan`) with a source for every old rank.
        held: the complete copies on this node, ``(world, owner, step) -> (kept_by, Held)``.

    Returns:
        ``(copies, problem, read_from)``: old rank -> its bytes; the first problem on this rank (None:
        none); old rank -> the rank directory whose copy this rank read.
    """
    copies: dict[int, bytes] = {}
    read_from: dict[int, int] = {}
    problem: str | None = None
    sent: dict[int, bytes] = {}
    for new_rank in range(mem.world):  # every rank walks the same plan in the same order
        for owner in range(plan.saved_world):
            src = plan.sources[owner]
            if new_rank in plan.local[owner]:  # on its node: read there
                if new_rank == mem.rank:
                    kept_by, copy = held.get((plan.saved_world, owner, plan.step), (None, None))
                    data, why = read_copy(mem, copy)
                    read_from[owner] = kept_by
                    problem = problem or (why and f"rank {owner}'s copy of step {plan.step}: {why}")
                    if data is not None:
                        copies[owner] = data
            elif mem.rank == src.holder:
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
    sent.clear()
    return copies, problem, read_from


def merge_owners(tr: Any, objs: list[dict[str, Any]]) -> dict[str, Any]:
    """The old ranks' snapshots (in rank order) as one of this rank's layout: ``model``, ``optimizer``
    (by parameter index, as ``state_dict()`` numbers them) and ``ema`` with this rank's shards of the
    live ``DTensor`` s; the rest old rank 0's.

    Raises:
        ValueError: the copies cannot be assembled (:func:`~..checkpoint.tensors.local_shards.from_owners`).
    """
    plain = unwrap(tr.model)
    live = plain.state_dict()
    params = [p for group in tr.optimizer.param_groups for p in group["params"]]
    state = objs[0]["optimizer"].get("state", {})
    optim_live = {"state": {i: dict.fromkeys(st, params[i] if isinstance(i, int) and i < len(params) else None)
                            for i, st in state.items()}}
    out = dict(objs[0])
    out["model"] = from_owners([o["model"] for o in objs], live)
    out["optimizer"] = from_owners([o["optimizer"] for o in objs], optim_live)
    if objs[0].get("ema") is not None:
        out["ema"] = from_owners([o["ema"] for o in objs], live)
    return out


def read_copy(mem: MemorySnapshots, held: Any) -> tuple[bytes | None, str | None]:
    """The bytes of the copy ``held`` describes (None: not held), or None and why it could not be read."""
    if held is None:
        return None, "copy missing"
    try:
        return mem.store.read(held), None
    except (OSError, ValueError) as e:
        return None, str(e)
