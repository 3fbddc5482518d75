"""Moving memory-tier copies between ranks over a gloo process group of their own.

The copies travel on a separate gloo group (:func:`side_group`), so a background thread can send a
snapshot to its buddy while the training thread's collectives run on the default group (NCCL on
GPUs, gloo on CPUs): two groups never share a communicator, and gloo runs over TCP between hosts
(host memory to host memory, no GPU involved).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist


def buddy_of(rank: int, world_size: int, local_world_size: int) -> int | None:
    """The rank that holds a copy of ``rank``'s state: ``(rank + L) % W`` with ``L`` the ranks per node
    (the same local rank on the next node), so a node's loss loses no state; on one node (``W == L``)
    the next local rank, ``(rank + 1) % W``; None alone (nothing to copy to)."""
    if world_size < 2:
        return None
    step = local_world_size if world_size > local_world_size else 1
    return (rank + step) % world_size


def held_by_me(rank: int, world_size: int, local_world_size: int) -> int | None:
    """The rank whose copy ``rank`` holds (the inverse of :func:`buddy_of`)."""
    if world_size < 2:
        return None
    step = local_world_size if world_size > local_world_size else 1
    return (rank - step) % world_size


def side_group() -> Any:
    """A new gloo group of every rank (a collective: every rank calls it, in the same order)."""
    return tdist.new_group(backend="gloo")


def swap(group: Any, data: memoryview | bytes, send_to: int, recv_from: int) -> bytearray:
    """Send ``data`` to rank ``send_to`` and receive the bytes rank ``recv_from`` sends (each rank
    of the ring calls it once at the same round): sizes first, then the bytes.

    Raises:
        RuntimeError: a peer died (gloo's connection error).
    """
    size = torch.tensor([len(data)], dtype=torch.int64)
    other = torch.zeros(1, dtype=torch.int64)
    _both(group, size, other, send_to, recv_from)
    out = bytearray(int(other.item()))
    payload = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    incoming = torch.frombuffer(out, dtype=torch.uint8) if out else torch.empty(0, dtype=torch.uint8)
    _both(group, payload, incoming, send_to, recv_from)
    return out


def _both(group: Any, send: torch.Tensor, recv: torch.Tensor, send_to: int, recv_from: int) -> None:
    works = [tdist.isend(send, send_to, group=group), tdist.irecv(recv, recv_from, group=group)]
    for w in works:
        w.wait()


def send_bytes(group: Any, data: memoryview | bytes, dst: int) -> None:
    """Send ``data`` to ``dst`` (its :func:`recv_bytes` takes it)."""
    tdist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=group)
    if len(data):  # (nothing follows an empty copy: the receiver treats it as missing)
        tdist.send(torch.frombuffer(data, dtype=torch.uint8), dst, group=group)


def recv_bytes(group: Any, src: int) -> bytearray:
    size = torch.zeros(1, dtype=torch.int64)
    tdist.recv(size, src, group=group)
    out = bytearray(int(size.item()))
    if out:
        tdist.recv(torch.frombuffer(out, dtype=torch.uint8), src, group=group)
    return out


def all_complete(group: Any, ok: bool) -> bool:
    """Every rank says ``ok`` (an all-reduce MIN on ``group``)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    tdist.all_reduce(flag, op=tdist.ReduceOp.MIN, group=group)
    return bool(flag.item())
