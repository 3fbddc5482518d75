"""Shared helpers for the test suite: run the CLI in a real subprocess, read run files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "digits.toml"

# Variables a surrounding torchrun/Slurm job would set; a child must not think it is a rank.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def pimm(*args: str, timeout: float = 180, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``python -m pimm_core.cli ARGS`` in a subprocess (text output captured)."""
    return subprocess.run([sys.executable, "-m", "pimm_core.cli", *map(str, args)], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def launch(root: Path, name: str, *overrides: str, nproc: int | None = None, config: Path = DIGITS,
           timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Train ``config`` into ``<root>/<group>/<name>`` (no timestamp) with ``-- overrides``."""
    args = ["launch", "--train.config", str(config), "--run.root", str(root), "--run.name", name, "--run.no-timestamp"]
    if nproc is not None:
        args += ["--nproc-per-node", str(nproc)]
    if overrides:
        args += ["--", *overrides]
    return pimm(*args, timeout=timeout)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def describe(result: subprocess.CompletedProcess[str]) -> str:
    """Failure context for asserts: exit code and the tails of both streams."""
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root``: relative path -> (bytes, mtime_ns)."""
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


def eval_weights(run_dir: Path, weights: Path) -> float:
    """Val accuracy of ``weights`` loaded into a fresh model built from the run's resolved config.

    Uses only public pieces (config_from_dict, build_datasets, build_model) and
    ``torch.load(weights_only=True)``; batches of max(batch_size, 256) like the evaluator.
    """
    import tomllib

    import torch

    from pimm_core.config import config_from_dict
    from pimm_core.data import build_datasets
    from pimm_core.models import build_model

    cfg = config_from_dict(tomllib.loads((run_dir / "config.toml").read_text()))
    data = build_datasets(cfg.data)
    model = build_model(cfg.model, data.in_features, data.in_shape, data.num_classes)
    obj = torch.load(weights, map_location="cpu", weights_only=True)
    model.load_state_dict(obj["state_dict"], strict=True)
    model.eval()
    loader = torch.utils.data.DataLoader(data.val, batch_size=max(cfg.data.batch_size, 256), shuffle=False)
    correct = total = 0
    with torch.no_grad():
        for x, y, _ in loader:
            correct += int((model(x).argmax(1) == y).sum())
            total += len(y)
    return correct / total
