"""Process-group setup from the launcher's environment, and rank helpers.

pimm never spawns ranks itself: ``pimm launch --nproc-per-node N`` hands over to
PyTorch's ``torch.distributed.run`` (torchrun/elastic), which sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. Under
Slurm's ``srun`` the ``SLURM_*`` variables are mapped onto the same names
(``MASTER_ADDR``/``MASTER_PORT`` must be exported by the job script).

Backend: NCCL when the device is CUDA, gloo otherwise.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tp: int = 1  # ranks that share each layer (parallel.tp); they read the same batches

    @property
    def data_ranks(self) -> int:
        """Ranks that read distinct batches: ``world_size // tp``."""
        return max(1, self.world_size // self.tp)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_world() -> DistInfo:
    """Rank layout from torchrun's (or Slurm's) environment; a single process otherwise."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1 and "MASTER_ADDR" in env:
        info = DistInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)))
        env.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank))
        env.setdefault("MASTER_PORT", "29500")
        return info
    return DistInfo()


def under_launcher() -> bool:
    """True inside a process started by torchrun/elastic or srun with several tasks."""
    return env_world().distributed or "TORCHELASTIC_RUN_ID" in os.environ


def pick_device(requested: str, info: DistInfo) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` when CUDA is available, else ``cpu``."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(info.local_rank)
        return torch.device("cuda", info.local_rank)
    return torch.device("cpu")


#: How long a collective waits for its peers (``dist.timeout``), for the groups pimm creates.
_timeout = timedelta(minutes=30)


def init(device: torch.device, info: DistInfo, *, always: bool = False, timeout_min: float | None = None) -> None:
    """Create the default process group when there is more than one rank, or with ``always``
    (FSDP shards over a device mesh even at one rank) a one-rank group on an in-memory store.

    Args:
        timeout_min: ``dist.timeout``, minutes a collective (and the store) waits for the other ranks
            before it raises (gloo) or aborts (NCCL's watchdog); None: 30.
    """
    global _timeout
    if dist.is_initialized() or not (info.distributed or always):
        return
    if timeout_min is not None:
        _timeout = timedelta(minutes=timeout_min)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = None if info.distributed or "MASTER_ADDR" in os.environ else dist.HashStore()
    if info.distributed:  # (DCP before the group, as when it was imported at start-up: a finished rank's
        import torch.distributed.checkpoint  # noqa: F401  exit leaves no gloo thread; test_fsdp_exit)
        store = _restart_store() or store  # (a torchrun restart: keys of its own attempt)
    dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world_size, store=store,
                            device_id=device if device.type == "cuda" else None, timeout=_timeout)


def _restart_store() -> Any:
    """After torchrun restarted the ranks (``--max-restarts``), the agent's store with a prefix of this
    attempt, else None (the default rendezvous).

    The agent keeps one store across attempts: the gloo addresses the previous attempt's ranks published
    are still there, and a new rank that read one before its peer replaced it connected to a dead
    process (``connectFullMesh ... Connection refused``, then the restart failed). A prefix per attempt
    gives each attempt keys of its own."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    env = os.environ
    if attempt in ("", "0") or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in env:
        return None
    tcp = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                        timeout=_timeout)
    return dist.PrefixStore(f"/pimm/attempt_{attempt}", tcp)


def timeout() -> timedelta:
    """The collectives' timeout of this process (``dist.timeout``), for a group created besides the default."""
    return _timeout


def shutdown() -> None:
    """Destroy the process groups, and let their threads end now, while the interpreter is whole.

    Under FSDP ``destroy_process_group()`` alone left the group alive: the DeviceMesh outlives the
    model (DTensor's sharding caches keep it) and holds the group in its registry, so gloo's threads
    (``gloo_tcp_loop``, ``pt_gloo_runloop``) ran on into the interpreter's exit, and a finished 2-rank
    FSDP run now and then ended with ``terminate called without an active exception`` (SIGABRT,
    exit 1) after printing ``done:``. Dropping the meshes' references once the groups are destroyed
    lets the group's destructor join its threads here. The caller drops its trainer first.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()  # the trainer's reference cycles (model, optimizer, parts) go first
    dist.destroy_process_group()
    _release_meshes()
    gc.collect()


def _release_meshes() -> None:
    """Clear the group registry of every DeviceMesh still alive (their groups are destroyed)."""
    if "torch.distributed.device_mesh" not in sys.modules:
        return  # no mesh was ever made (DDP, one process)
    from torch.distributed.device_mesh import DeviceMesh

    with warnings.catch_warnings():
        # isinstance() on every live object reaches torch.distributed's deprecated `reduce_op`,
        # whose check warns (FutureWarning) on each rank at every exit: not the user's concern
        warnings.simplefilter("ignore", FutureWarning)
        meshes = [obj for obj in gc.get_objects() if isinstance(obj, DeviceMesh)]
    for obj in meshes:
        registry = getattr(obj, "_pg_registry", None)  # (torch 2.9+: group name -> ProcessGroup)
        if isinstance(registry, dict):
            registry.clear()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
