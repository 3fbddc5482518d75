"""Shared pieces of the checkpoint benchmarks: the benchmark state, machine info, timing helpers.

Not a benchmark itself. The state is a stack of ``Linear(width, width)`` layers and an
AdamW optimizer after one step, so ``exp_avg`` and ``exp_avg_sq`` exist: about one
third of the bytes are parameters, two thirds optimizer state (fp32 everywhere).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

MiB = 1 << 20
GiB = 1 << 30


def layer_count(total_bytes: int, width: int) -> int:
    """Layers of ``Linear(width, width)`` so that params + exp_avg + exp_avg_sq >= ``total_bytes``."""
    per_layer = 3 * 4 * (width * width + width)
    return max(1, math.ceil(total_bytes / per_layer))


def build_model(total_bytes: int, width: int = 4096, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    n = layer_count(total_bytes, width)
    layers: list[nn.Module] = []
    for i in range(n):
        layers.append(nn.Linear(width, width))
        if i < n - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def one_adamw_step(model: nn.Module, lr: float = 1e-4) -> torch.optim.AdamW:
    """AdamW after one step on synthetic gradients (materializes exp_avg/exp_avg_sq)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def build_state(total_bytes: int, width: int = 4096, seed: int = 0) -> tuple[nn.Sequential, torch.optim.AdamW]:
    model = build_model(total_bytes, width, seed)
    return model, one_adamw_step(model)


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    optim = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    return {"params": params, "optimizer": optim, "total": params + optim}


def tree_bytes(path: Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum((Path(d) / f).stat().st_size for d, _, fs in os.walk(path) for f in fs)


def remove(path: Path) -> None:
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def settle() -> None:
    """Flush dirty pages left by earlier work (deletions, other files) before a timed section."""
    os.sync()
    time.sleep(0.2)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _filesystem(path: Path) -> dict[str, str]:
    try:
        out = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", "-T", str(path)],
                             capture_output=True, text=True, timeout=5).stdout.split()
        if len(out) >= 2:
            return {"device": out[0], "fstype": out[1], "options": out[2] if len(out) > 2 else ""}
    except (OSError, subprocess.SubprocessError):
        pass
    return {}


def machine(disk_path: Path | None = None, load_at_start: list[float] | None = None) -> dict:
    """CPU, cores, memory, load average (at start and now), torch/python/OS, and the disk written to."""
    info: dict = {"cpu": _cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                  "torch": torch.__version__, "python": platform.python_version(), "os": platform.platform()}
    try:
        mem = {k: v for k, v in (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())}
        info["mem_gib"] = round(int(mem["MemTotal"].split()[0]) / (1 << 20), 1)
    except (OSError, KeyError, ValueError):
        pass
    if load_at_start is not None:
        info["load_average_start"] = load_at_start
    info["load_average_end"] = load_average()
    if disk_path is not None:
        usage = shutil.disk_usage(disk_path)
        info["disk"] = {"path": str(disk_path), **_filesystem(Path(disk_path)),
                        "free_gib": round(usage.free / GiB, 1)}
    return info


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def r(x: float, nd: int = 4) -> float:
    return round(x, nd)


@contextlib.contextmanager
def time_calls(targets: dict[str, tuple[Any, str]], totals: dict[str, float]):
    """Inside ``with``: every call of ``owner.name`` (``targets[label] = (owner, name)``) adds its seconds
    to ``totals[label]``; the originals are put back on exit."""
    undo = []
    for label, (owner, name) in targets.items():
        fn = getattr(owner, name)

        def timed(*a, __fn=fn, __label=label, **k):
            t0 = time.perf_counter()
            try:
                return __fn(*a, **k)
            finally:
                totals[__label] = totals.get(__label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)
        undo.append((owner, name, fn))
    try:
        yield
    finally:
        for owner, name, fn in reversed(undo):
            setattr(owner, name, fn)


def json_dict(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a run's status.json), or {} when it is missing, partial or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def train_records(metrics: Path) -> list[dict[str, Any]]:
    """The ``split == "train"`` records of a run's metrics.jsonl, skipping a partial last line; [] if absent."""
    out = []
    with contextlib.suppress(OSError):
        for line in metrics.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict) and rec.get("split") == "train":
                    out.append(rec)
    return out
