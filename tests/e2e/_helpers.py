"""Shared helpers for the test suite: run the CLI in a real subprocess (or in this process), read run files."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "digits.toml"
#: ``python -m torch.distributed.run``, with the ranks forked from a server that imported torch once (_torchrun.py)
TORCHRUN = [sys.executable, str(Path(__file__).with_name("_torchrun.py"))]

# Time limits in these tests only catch hangs. Each is written as a bound for an idle machine and
# stretched by hang_s(): under other load this 2-core machine is 3-5x slower (``import torch``
# alone takes ~20 s instead of ~3 s at load 10), and the suite must still pass there (issue #25).
# A passing test never waits for a limit, so a generous one costs nothing.
SLOWER = float(os.environ.get("PIMM_TEST_SLOWER", "5"))


def hang_s(seconds: float) -> float:
    """The limit to wait for something that takes at most ``seconds`` on an idle machine (s)."""
    return seconds * SLOWER


# Variables a surrounding torchrun/Slurm job would set; a child must not think it is a rank.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def clean_env(*, one_thread: bool = True) -> dict[str, str]:
    """This process's environment without a surrounding launcher's variables.

    ``one_thread``: ``OMP_NUM_THREADS=1`` (unless already set), one intra-op thread per
    process as torchrun gives each rank: the digits MLP's ops are too small to gain from a
    second thread, and on a busy 2-core machine the extra threads spin. ``False`` leaves
    it unset, so pimm's own default for the ranks it spawns is what runs.
    """
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    if one_thread:
        env.setdefault("OMP_NUM_THREADS", "1")
    else:
        env.pop("OMP_NUM_THREADS", None)
    return env


def pimm(*args: str, timeout: float = 180, cwd: Path = REPO,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m pimm_core.cli ARGS`` in a subprocess (text output captured; ``env`` default: clean_env()).

    ``timeout``: the idle-machine bound in seconds, stretched by :func:`hang_s`."""
    return subprocess.run([sys.executable, "-m", "pimm_core.cli", *map(str, args)], cwd=cwd,
                          env=clean_env() if env is None else env, capture_output=True, text=True,
                          timeout=hang_s(timeout))


def pimm_here(*args: str, cwd: Path = REPO, timeout: float | None = None, env: dict[str, str] | None = None,
              fresh: str | None = None, failpoint: str = "") -> subprocess.CompletedProcess[str]:
    """``pimm ARGS`` run in this process through ``pimm_core.cli.main``, captured like :func:`pimm`.

    For outcomes that do not depend on being a fresh process (refusals, dry runs, short
    single-process trainings): it saves the seconds a subprocess spends importing torch.
    Keep real processes for signals, kills, fail points (read at import), torchrun, and at
    least one run of each guarantee through the console script. The ``pimm`` logger is reset
    for the call as in a fresh process (the CLI configures it once per process) and restored
    after; the working directory is ``cwd`` meanwhile. ``timeout`` is accepted (as :func:`pimm` takes it) and unused.

    ``env``: variables set for the call only. ``fresh``: a user package (``"userpkg"``) the call imports anew, as a
    fresh process would, and that is forgotten after it; ``sys.path`` (where a launch puts the config's directory)
    is as before after the call.

    ``failpoint``: ``PIMM_FAILPOINT`` for the call only (pimm_core.faults reads the variable once, at import, so
    it is set there, with the hit counts from zero as in a fresh process). Only the actions that raise (``enospc``,
    ``eio``): a kill, a signal or a pause needs a process of its own.
    """
    from pimm_core import faults
    from pimm_core.cli import main

    for spec in filter(None, failpoint.split(",")):
        assert spec.rpartition("=")[2] in ("enospc", "eio"), f"{spec}: a fail point that raises, in this process"

    argv = [str(a) for a in args]
    logger = logging.getLogger("pimm")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    for h in handlers:
        logger.removeHandler(h)
    logger.setLevel(logging.NOTSET)
    # A fresh process's root logger has no handlers, so a warning logged before the CLI sets up
    # the logger reaches stderr through logging.lastResort; here the root holds pytest's handlers.
    logger.propagate = False
    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    path, environ = list(sys.path), {k: os.environ.get(k) for k in env or {}}

    def forget() -> dict[str, Any]:
        return {m: sys.modules.pop(m) for m in list(sys.modules)
                if fresh and (m == fresh or m.startswith(fresh + "."))}

    modules = forget()
    spec, hits = faults._SPEC, dict(faults._hits)
    try:
        faults._SPEC = failpoint
        faults._hits.clear()
        os.environ.update(env or {})
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        faults._SPEC = spec
        faults._hits.clear()
        faults._hits.update(hits)
        os.chdir(here)
        sys.path[:] = path
        forget()
        sys.modules.update(modules)
        for k, v in environ.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for h in list(logger.handlers):
            logger.removeHandler(h)
            h.close()
        for h in handlers:
            logger.addHandler(h)
        logger.setLevel(level)
        logger.propagate = propagate
    return subprocess.CompletedProcess(["pimm", *argv], code, out.getvalue(), err.getvalue())


def launch(root: Path, name: str, *overrides: str, nproc: int | None = None, config: Path = DIGITS,
           timeout: float = 240, here: bool = False, env: dict[str, str] | None = None,
           ) -> subprocess.CompletedProcess[str]:
    """Train ``config`` into ``<root>/<group>/<name>`` (no timestamp) with ``-- overrides``.

    ``here``: in this process (:func:`pimm_here`, one rank only) instead of a subprocess."""
    args = ["launch", "--train.config", str(config), "--run.root", str(root), "--run.name", name, "--run.no-timestamp"]
    if nproc is not None:
        args += ["--nproc-per-node", str(nproc)]
    if overrides:
        args += ["--", *overrides]
    if here:
        assert nproc is None, "torchrun runs in subprocesses"
        return pimm_here(*args)
    return pimm(*args, timeout=timeout, env=env)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def newest_train_step(path: Path) -> int | None:
    """The step of the newest train record in ``metrics.jsonl``, or None. Every logged step is a line there at
    once (``status.json`` follows logged steps at most 4 times a second): what a test waits on to
    see a run training past a step."""
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # (a line being written)
        if record.get("split") == "train":
            return record["step"]
    return None


def training_past(run_dir: Path, min_step: int) -> dict[str, Any] | None:
    """``status.json`` (whose ``pids`` a test signals) once it says ``running`` and ``metrics.jsonl`` has a
    train record at ``min_step`` or later, with ``step`` that newest logged step; else None."""
    try:
        status = json.loads((Path(run_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return None
    step = newest_train_step(Path(run_dir) / "metrics.jsonl")
    if status.get("state") == "running" and step is not None and step >= min_step:
        return {**status, "step": step}
    return None


def resumed_records(path: Path, resumed_at: int) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` past global step ``resumed_at``: what a session resumed there
    wrote (a resume moves the interrupted run's later records to ``metrics.superseded.jsonl``, so
    the file holds each step once)."""
    return [r for r in read_jsonl(path) if r["step"] > resumed_at]


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
    from pimm_core.data.loaders import build_datasets
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


@contextlib.contextmanager
def undeletable(tree: Path):
    """Make the tree ``tree`` impossible to remove for this process while inside, as a file kept busy or
    immutable (an uploader on NFS) does: as root, ``chattr +i`` on ``tree/weights.pth`` (permission bits do
    not stop root); otherwise ``tree/trainer.dcp`` without write permission. Skips the test where
    neither can be done. Yields the path whose removal fails."""
    import pytest

    if os.geteuid() == 0:
        target = tree / "weights.pth"
        r = subprocess.run(["chattr", "+i", str(target)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot make a file immutable here (chattr: {r.stderr.strip()})")
        undo = ["chattr", "-i", str(target)]
    else:
        target = tree / "trainer.dcp"
        target.chmod(0o555)
        undo = ["chmod", "755", str(target)]
    try:
        yield target
    finally:
        subprocess.run(undo, check=False)


def release(path: Path) -> None:
    """Undo :func:`undeletable` on a tree that was moved (whatever was made undeletable in it)."""
    subprocess.run(["chattr", "-R", "-i", str(path)] if os.geteuid() == 0 else ["chmod", "-R", "u+w", str(path)],
                   check=False, capture_output=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous, a server, a Slurm daemon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_index(run: Path, rank: int) -> dict[str, Any]:
    """What rank ``rank`` publishes of its memory tier (``<run>/memory/<rank>.json``); {} while absent or partial."""
    try:
        return json.loads((run / "memory" / f"{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def memory_holds_only(run: Path, shm_root: Path, name: str, step: int, patterns: tuple[str, ...]) -> bool:
    """Both ranks' memory indexes name their own and their buddy copy of ``step``, and each glob of
    ``patterns`` under the run's shared memory (``<shm_root>/pimm-<name>-*``) matches ``step``'s copy and
    its sidecar only: a rank indexes a new copy once written, and removes the older ones (``keep_only``)
    only once every rank's round of ``step`` is complete."""
    shm = next(shm_root.glob(f"pimm-{name}-*"), None)
    return shm is not None and all(
        (memory_index(run, r).get("own") or {}).get("step") == step and
        (memory_index(run, r).get("buddy") or {}).get("step") == step for r in (0, 1)) and all(
        sorted(p.parent.name for p in shm.glob(pattern)) == [f"step_{step}"] * 2 for pattern in patterns)


def wait_while_running(check, what: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until ``check()`` is true, failing at once (with the launch's output) if ``proc`` (started with
    ``stdout=PIPE, stderr=STDOUT, text=True``) ends first; ``timeout`` (scaled by :func:`hang_s`) catches hangs."""
    import time

    deadline = time.monotonic() + hang_s(timeout)
    while not check():
        assert proc.poll() is None, f"the launch ended while waiting for {what}: {proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
