"""Helpers for the console tests (tests/e2e/test_tui*.py): one real training run per session, Pilot waits."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from _helpers import describe, hang_s, launch

# Two epochs of digits (45 steps each), a training record every 5 steps, `last` and an
# iter_<step>.pth snapshot every 20 steps.
TUI_OVERRIDES = ("train.epochs=2", "checkpoint.every_steps=20", "train.log_every_steps=5")

_RUN: dict[str, Path] = {}


def tui_run(tmp_path_factory: Any) -> Path:
    """The run directory of one tiny real run, trained once per test process (do not modify it);
    ``pimm launch`` in this process (the console reads its files, not its process)."""
    if "run" not in _RUN:
        root = tmp_path_factory.mktemp("tui")
        result = launch(root, "r", *TUI_OVERRIDES, here=True)
        assert result.returncode == 0, describe(result)
        _RUN["run"] = root / "digits" / "r"
    return _RUN["run"]


def copy_run(run_dir: Path, dest_root: Path, name: str = "r") -> Path:
    """A private copy of ``run_dir`` under ``dest_root`` (for tests that damage or extend it)."""
    dest = dest_root / "digits" / name
    shutil.copytree(run_dir, dest, symlinks=True)
    return dest


def make_app(run_dir: Path, refresh_s: float = 0.2) -> Any:
    """The console on ``run_dir`` polling every ``refresh_s``, without animations (faster Pilot presses)."""
    from pimm_tui import build_app

    app = build_app(run_dir, refresh_s=refresh_s)
    app.animation_level = "none"
    return app


def screen_text(app: Any) -> str:
    """The plain text on the app's current screen."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def wait_for(pilot: Any, cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Let the app run until ``cond()`` is truthy; fail with ``what`` and the screen after ``timeout``
    (an idle-machine bound in seconds, stretched by ``hang_s``)."""
    deadline = time.monotonic() + hang_s(timeout)
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; screen:\n{screen_text(pilot.app)}")
        await pilot.pause(0.05)


async def loaded(pilot: Any, polls: int = 1, timeout: float = 10.0) -> None:
    """Wait until the app applied ``polls`` reads of the run."""
    start = pilot.app.polls
    await wait_for(pilot, lambda: pilot.app.polls >= max(polls, start + 1) and pilot.app.snapshot is not None,
                   timeout, f"{polls} poll(s)")
    await pilot.pause(0.05)


def read_status(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "status.json").read_text())


def write_status(run_dir: Path, **fields: Any) -> None:
    data = read_status(run_dir) if (run_dir / "status.json").exists() else {}
    data.update(fields)
    (run_dir / "status.json").write_text(json.dumps(data) + "\n")


async def settle(seconds: float = 0.2) -> None:
    await asyncio.sleep(seconds)


# ------------------------------------------------------------ fake runs (no training)
def fake_run(root: Path, name: str = "r", *, state: str = "finished", records: Any = (), host: str | None = None,
             **status: Any) -> Path:
    """A run directory written by hand: config.toml, status.json and metrics.jsonl (records are
    written with Python's json, so NaN and +-Inf become ``NaN``, ``Infinity``, ``-Infinity``)."""
    import os
    import socket

    rd = root / "digits" / name
    rd.mkdir(parents=True, exist_ok=True)
    (rd / "config.toml").write_text('[eval]\nmetric = "val/acc"\nmode = "max"\n')
    st = {"state": state, "host": host or socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time(),
          "pids": [os.getpid()]}
    st.update(status)
    (rd / "status.json").write_text(json.dumps(st) + "\n")
    with open(rd / "metrics.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    return rd


def train_record(step: int, loss: float, lr: float = 1e-3, **kw: Any) -> dict[str, Any]:
    return {"step": step, "epoch": 0, "iter": step, "split": "train", "loss": loss, "lr": lr,
            "samples_per_s": 500.0, "time": 1000.0 + step, **kw}


def write_generation(path: Path, step: int, payload: bytes, created: str | None = None) -> Path:
    """A complete standard checkpoint directory at ``path`` (no torch: the files are opaque
    bytes) whose manifest records their sizes and sha256."""
    import hashlib

    (path / "trainer.dcp").mkdir(parents=True)
    (path / "weights.pth").write_bytes(payload)
    (path / "trainer.dcp" / "__0_0.distcp").write_bytes(payload[::-1] + b"x")
    (path / "trainer.dcp" / ".metadata").write_bytes(b"meta" + str(step).encode())
    (path / "trainer.dcp" / ".complete").write_bytes(b"")
    files = {}
    for rel in ("trainer.dcp/.complete", "trainer.dcp/.metadata", "trainer.dcp/__0_0.distcp", "weights.pth"):
        data = (path / rel).read_bytes()
        files[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"manifest_version": 1, "format": "standard", "kind": "last", "step": step, "epoch": 0, "iter": step,
                "world_size": 1, "workers_per_rank": 0, "metrics": {"val/acc": 0.5},
                "created": created or f"2026-11-30T12:{step // 60 % 60:02d}:{step % 60:02d}+00:00", "files": files}
    (path / "manifest.json").write_text(json.dumps(manifest))
    (path / ".complete").write_bytes(b"")
    return path


def rotate(model_dir: Path, step: int, payload: bytes) -> None:
    """Publish a new ``last`` the way a save does: write ``last.tmp``, rename ``last`` to
    ``last.prev``, ``last.tmp`` to ``last``, remove ``last.prev``."""
    tmp, last, prev = model_dir / "last.tmp", model_dir / "last", model_dir / "last.prev"
    write_generation(tmp, step, payload)
    if last.exists():
        last.rename(prev)
    tmp.rename(last)
    shutil.rmtree(prev, ignore_errors=True)
