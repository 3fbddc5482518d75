"""Shared pieces of the multi-rank benchmarks (``fsdp_memory.py``, ``sharded_checkpoint.py``,
``gpu_check.sh``): the model, the pimm set-up of a rank, per-rank memory figures, torchrun.

Not a benchmark itself. Each benchmark's parent process launches its ranks with torchrun
(``python -m torch.distributed.run --standalone --nproc-per-node N <script> --worker ...``);
every rank writes its figures to ``<out>/rank<r>.json`` and the parent reads them back.

The model is a stack of pre-norm MLP blocks (``Block``: LayerNorm, ``Linear(w, 4w)``,
GELU, ``Linear(4w, w)``, residual), ``8 w^2`` parameters per block, so ``train.blocks =
["Block"]`` gives FSDP one unit per block as a transformer would. Everything a rank
builds goes through pimm: :func:`pimm_core.config.load_config` (``train.strategy``,
``train.blocks``...), :func:`pimm_core.process.dist.init`, :func:`pimm_core.train.parallel.parallelize`
and :func:`pimm_core.optim.build_optimizer` (AdamW by default), in the trainer's order.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pimm_core.process import dist  # noqa: E402
from pimm_core.checkpoint.tensors.state import unwrap  # noqa: E402
from pimm_core.config import Config, load_config  # noqa: E402
from pimm_core.process.dist import DistInfo  # noqa: E402
from pimm_core.optim import build_optimizer  # noqa: E402
from pimm_core.train.parallel import parallelize  # noqa: E402

MiB = 1 << 20


class Block(nn.Module):
    """Pre-norm MLP block: ``x + down(gelu(up(norm(x))))``; input and output ``(B, width)``."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """``depth`` blocks then a final LayerNorm; ``(B, width)`` float32 in and out."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def param_count(width: int, depth: int) -> int:
    return depth * (8 * width * width + 7 * width) + 2 * width


def config(strategy: str, device: str, overrides: list[str] = ()) -> Config:
    """pimm's config for one of these runs: ``train.strategy``, ``train.blocks = ["Block"]``."""
    return load_config(None, [f'train.strategy="{strategy}"', 'train.blocks=["Block"]', f'train.device="{device}"',
                              *overrides])


def setup_rank(cfg: Config) -> tuple[DistInfo, torch.device]:
    """The rank's layout and device, and the process group, as ``Trainer.__init__`` makes them."""
    info = dist.env_world()
    device = dist.pick_device(cfg.train.device, info)
    dist.init(device, info, always=cfg.train.strategy == "fsdp")
    return info, device


def build(cfg: Config, info: DistInfo, device: torch.device, width: int, depth: int,
          seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model as pimm trains it (same initial weights on every rank) and its optimizer."""
    torch.manual_seed(seed)
    model = parallelize(Net(width, depth).to(device), cfg, info, device)
    return model, build_optimizer(cfg, unwrap(model))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, amp: str = "none",
               zero: bool = True) -> float:
    """One forward/backward/optimizer step on ``x`` (loss: mean square of the output)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    if zero:
        optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of ``t``: ``DTensor.to_local()``, else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (local shards of DTensors, padding included)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None:
            continue
        s = local(t).untyped_storage()
        if s.nbytes():
            seen[(str(s.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (each counted once)."""
    params = list(model.parameters())
    opt = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    out = {"params": held_bytes(params), "grads": held_bytes(p.grad for p in params), "optimizer": held_bytes(opt)}
    out["total"] = sum(out.values())
    return out


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss() -> int:
    """Resident set size of this process now, bytes (``VmRSS``)."""
    return _status("VmRSS")


def peak_rss() -> int:
    """Peak resident set size since the last :func:`reset_peak_rss` (or start), bytes (``VmHWM``)."""
    return _status("VmHWM")


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (``5`` into ``/proc/self/clear_refs``, Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def write_rank(out: Path, info: DistInfo, record: dict[str, Any]) -> None:
    (Path(out) / f"rank{info.rank}.json").write_text(json.dumps(record))


def torchrun(script: Path, nproc: int, args: list[str], out: Path, timeout: float = 600.0,
             env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``script --worker --out out *args`` on ``nproc`` local ranks; the ranks' records in rank order.

    Raises:
        SystemExit: the launch failed or timed out (with the end of its output).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("rank*.json"):
        f.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(script), "--worker", "--out", str(out), *args]
    run_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               **(env or {})}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=run_env, cwd=REPO, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{' '.join(cmd[3:])}: timed out after {timeout:.0f} s") from None
    if p.returncode != 0:
        text = p.stdout + p.stderr
        errors = [ln for ln in text.splitlines() if re.match(r"\[rank\d+\]: \w+(Error|Exception)\b", ln)]
        raise SystemExit(f"{' '.join(cmd[3:])} failed (exit {p.returncode}): "
                         f"{'; '.join(dict.fromkeys(errors)) or text[-3000:]}")
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    for rec in records:
        rec["launch_s"] = round(time.perf_counter() - t0, 2)
    return records
