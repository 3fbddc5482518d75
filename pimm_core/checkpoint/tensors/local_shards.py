"""A rank's ``DTensor`` shards as plain tensors and back (the memory tier's sharded state).

FSDP2 (``fully_shard``) and tensor parallel keep parameters, optimizer state and EMA weights as
``DTensor`` s: each rank holds its local shard. The memory tier keeps each rank's *own* shards
(plus its buddy's), serialized with ``torch.save`` and read back with ``torch.load(weights_only=True)``,
which refuses ``DTensor`` and its ``DeviceMesh``. :func:`to_local` replaces each ``DTensor`` of a
state tree by its local shard and what rebuilds it (mesh shape and dimension names, placements,
global shape and stride); :func:`from_local` rebuilds the ``DTensor`` s on the live model's meshes
(the same world size and layout: the mesh and placement objects of a live ``DTensor`` of the same
spec). No collective in either direction; the local shard is used as it is (no copy, no gather).

At another world size, :func:`from_owners` assembles each tensor from every old rank's shard (each
recorded with its global offset, DCP's ``__create_chunk_list__``) and cuts the live layout's local
shard from it (``distribute_tensor(src_data_rank=None)``: no communication): exact, at the cost of one
whole tensor at a time in CPU memory.
"""

from __future__ import annotations

from typing import Any

import torch

from .state import dtensor_type, unwrap

#: The key that marks a rebuilt entry's dict (never a state-dict key of a model or optimizer).
MARK = "__dtensor_local__"


def _spec(t: Any) -> tuple[tuple[int, ...], tuple[str, ...], str]:
    mesh = t.device_mesh
    return tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()), repr(tuple(t.placements))


def to_local(obj: Any) -> Any:
    """``obj`` (tensors in nested dicts, lists, tuples) with each ``DTensor`` replaced by
    ``{MARK: its local shard, "mesh": [sizes], "dims": [names], "placements": repr, "shape": [global],
    "stride": [global]}``; without a ``DTensor`` in it, the same values (no copy)."""
    dtensor = dtensor_type()
    if dtensor is None:
        return obj
    if isinstance(obj, dtensor):
        mesh, dims, placements = _spec(obj)
        return {MARK: obj.to_local(), "mesh": list(mesh), "dims": list(dims), "placements": placements,
                "shape": list(obj.shape), "stride": list(obj.stride()), "offset": _offset(obj)}
    if isinstance(obj, dict):
        return {k: to_local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_local(v) for v in obj)
    return obj


def _offset(t: Any) -> list[int] | None:
    """The global offset of ``t``'s local shard (one chunk per rank, as DCP plans a save), None when
    the layout has none (a partial placement)."""
    try:
        chunks = t.__create_chunk_list__()
    except (RuntimeError, ValueError, AssertionError, NotImplementedError):
        return None
    return [int(o) for o in chunks[0].offsets] if len(chunks) == 1 else None


def has_local(obj: Any) -> bool:
    """True when ``obj`` holds an entry :func:`to_local` made (a sharded state)."""
    if isinstance(obj, dict):
        return MARK in obj or any(has_local(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_local(v) for v in obj)
    return False


def live_layouts(model: torch.nn.Module) -> dict[tuple, tuple[Any, Any]]:
    """The (mesh, placements) of every ``DTensor`` parameter and buffer of the (unwrapped) model, by
    their spec (mesh sizes, dimension names, placements' repr)."""
    dtensor = dtensor_type()
    out: dict[tuple, tuple[Any, Any]] = {}
    if dtensor is None:
        return out
    plain = unwrap(model)
    for t in [*plain.parameters(), *plain.buffers()]:
        if isinstance(t, dtensor):
            out.setdefault(_spec(t), (t.device_mesh, tuple(t.placements)))
    return out


def from_local(obj: Any, layouts: dict[tuple, tuple[Any, Any]]) -> Any:
    """Inverse of :func:`to_local` on the layouts of the live model (:func:`live_layouts`).

    Raises:
        ValueError: an entry's mesh or placements are none of the live model's (another world size,
            ``parallel.tp`` or sharding: the shards do not fit).
    """
    if isinstance(obj, dict):
        if MARK in obj:
            key = (tuple(obj["mesh"]), tuple(obj["dims"]), obj["placements"])
            if key not in layouts:
                raise ValueError(f"a shard of mesh {tuple(obj['mesh'])} with placements {obj['placements']} fits no "
                                 "parameter of the model now (another world size, parallel.tp or sharding)")
            from torch.distributed.tensor import DTensor

            mesh, placements = layouts[key]
            return DTensor.from_local(obj[MARK], mesh, placements, run_check=False, shape=torch.Size(obj["shape"]),
                                      stride=tuple(obj["stride"]))
        return {k: from_local(v, layouts) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_local(v, layouts) for v in obj)
    return obj


def from_owners(trees: list[Any], live: Any) -> Any:
    """Every old rank's tree of :func:`to_local` (one structure: the same model and optimizer, rank order)
    as one tree of the live layout: each entry assembled into its whole tensor from all the shards and,
    where ``live`` (a parallel tree of the live tensors; None where there is none) has a ``DTensor``, cut
    to this rank's shard of it; other values are the first tree's (old rank 0's).

    Raises:
        ValueError: an entry without an offset (a layout DCP cannot describe either), or trees of
            different structures.
    """
    first = trees[0]
    if isinstance(first, dict):
        if MARK in first:
            return _assemble(trees, live)
        if any(not isinstance(t, dict) or t.keys() != first.keys() for t in trees):
            raise ValueError("the old ranks' copies differ in structure")
        return {k: from_owners([t[k] for t in trees], live.get(k) if isinstance(live, dict) else None)
                for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(from_owners([t[i] for t in trees], live[i] if isinstance(live, (list, tuple))
                                       and i < len(live) else None) for i in range(len(first)))
    return first


def _assemble(entries: list[dict[str, Any]], live: Any) -> torch.Tensor:
    if any(e.get("offset") is None for e in entries):
        raise ValueError(f"a shard with placements {entries[0]['placements']} has no offset to reshard it by")
    whole = torch.empty(entries[0]["shape"], dtype=entries[0][MARK].dtype)
    for e in entries:  # (a replicated dimension writes the same values twice)
        local = e[MARK]
        whole[tuple(slice(o, o + n) for o, n in zip(e["offset"], local.shape))] = local
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(live, dtensor):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(whole.to(live.device), live.device_mesh, live.placements, src_data_rank=None)
    return whole
