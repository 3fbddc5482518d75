"""Recovery of sharded state (FSDP2, tensor parallel) from the memory tier at another world size.

Each old rank's copy holds its own ``DTensor`` shards (:mod:`~..checkpoint.tensors.local_shards`), so
a new rank needs every old rank's copy: it reads those on its node (an owner's own, or the one its
buddy kept) and receives the others from the rank the plan names (``memory_recovery.read_copies``, the
plan's order on every rank). :func:`merge_owners` then builds each tensor whole from the shards and
cuts this rank's shard of the live layout from it: exact (the values are copied, nothing is reduced),
and every rank holds one copy of the whole state in CPU memory while it recovers. :func:`too_big` checks
first that the node's free memory holds that for each of its ranks; where it does not, every rank takes
the disk ``last`` instead, said in one line, rather than the node running out of memory.
"""

from __future__ import annotations

from typing import Any

from ..checkpoint.tensors.local_shards import from_owners
from ..checkpoint.tensors.state import unwrap

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


def describe_reshard(read: dict[int, dict[int, int]], saved_world: int, world: int) -> tuple[dict[int, int], str]:
    """What a resharded recovery read: ``(from_buddy, clause)``, ``from_buddy`` old rank -> the buddy rank
    whose directory held the copy read (where it was not the owner's own), ``read`` new rank -> its reads."""
    from_buddy = {o: b for r in sorted(read) for o, b in sorted(read[r].items()) if b != o}
    kept = "; ".join(f"rank {o}'s held by its buddy rank {b}" for o, b in sorted(from_buddy.items()))
    return from_buddy, (f"world size {saved_world} -> {world}: sharded state resharded from every rank's copy"
                        f"{f' ({kept})' if kept else ''}")
