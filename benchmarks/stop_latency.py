"""Stop latency: a scheduler's stop signal to ``last`` published and every rank exited, against one save.

A real ``pimm launch --nproc-per-node N`` (the project's interpreter, ``-m pimm_core.cli``)
on ``configs/digits.toml`` with SIGUSR1 among ``train.stop_signals``; once ``status.json``
says it is training, SIGUSR1 goes to the launcher (what ``sbatch --signal=B:USR1@N`` sends).
The run directory is polled every millisecond:

- ``to_save_start``: the signal to ``model/last.tmp`` appearing (the rest of the accumulation
  window, the stop agreement);
- ``save``: ``last.tmp`` appearing to ``model/last`` published at the stopped step (one save);
- ``to_published``: the signal to ``last`` published;
- ``to_ranks_exited``: the signal to the last rank gone;
- ``to_exit``: the signal to the launcher's exit with every rank gone (what must fit a
  scheduler's grace period: torchrun kills ranks 30 s after SIGTERM by default, pimm gives
  them 600 s; Slurm ``KillWait`` after the time limit).

With ``--via stop`` the stop is asked with ``pimm stop RUN`` instead (a real command process, the
operator's way): ``to_save_start`` etc. count from the command's start, ``command`` is how long the
command itself ran, and ``steps_after`` how many optimizer steps the run took between the command's
start and the step it stopped at (``status.json`` is written at every step here).

Prints one JSON object with the median of ``--repeats`` runs. Usage::

    uv run python benchmarks/stop_latency.py [--repeats 3] [--nproc 2] [--via signal|stop] [-- extra.overrides=...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine, median, r, remove  # noqa: E402

CONFIG = REPO / "configs" / "digits.toml"
OVERRIDES = ["train.epochs=20", "train.log_every_steps=1", 'train.stop_signals=["SIGINT", "SIGTERM", "SIGUSR1"]']


def _status(run: Path) -> dict:
    try:
        return json.loads((run / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _published_step(run: Path) -> int | None:
    try:
        return json.loads((run / "model" / "last" / "manifest.json").read_text()).get("step")
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def one(nproc: int, extra: list[str], via: str = "signal", timeout: float = 600.0) -> dict:
    root = Path(tempfile.mkdtemp(prefix="pimm-stop-latency-"))
    run = root / "digits" / "b"
    cmd = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(CONFIG), "--run.root", str(root),
           "--run.name", "b", "--run.no-timestamp", "--nproc-per-node", str(nproc), "--", *OVERRIDES, *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.perf_counter() + timeout
        while not ((s := _status(run)).get("state") == "running" and s.get("step", 0) >= 3):
            if proc.poll() is not None or time.perf_counter() > deadline:
                raise SystemExit(f"the run ended or stalled before training: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.01)
        pids = s["pids"]
        t0 = time.perf_counter()
        command = None
        if via == "stop":
            step0 = _status(run).get("step", 0)
            subprocess.run([sys.executable, "-m", "pimm_core.cli", "stop", str(run)], cwd=REPO, env=env, check=True,
                           stdout=subprocess.DEVNULL)
            command = time.perf_counter() - t0
        else:
            step0 = s.get("step", 0)
            os.kill(proc.pid, signal.SIGUSR1)
        save_start = published = ranks_gone = None
        while proc.poll() is None or any(_alive(p) for p in pids):
            now = time.perf_counter()
            if ranks_gone is None and not any(_alive(p) for p in pids):
                ranks_gone = now
            if save_start is None and (run / "model" / "last.tmp").exists():
                save_start = now
            if published is None and save_start is not None and not (run / "model" / "last.tmp").exists():
                st = _status(run)
                if st.get("state") == "stopped" or _published_step(run) == st.get("step"):
                    published = now
            if now > deadline:
                raise SystemExit("the run did not exit after the signal")
            time.sleep(0.001)
        t_exit = time.perf_counter()
        final = _status(run)
        if proc.returncode != 0 or final.get("state") != "stopped":
            raise SystemExit(f"not a clean stop: exit {proc.returncode}, {final}")
        published = published or t_exit
        save_start = save_start or published
        return {"to_save_start": save_start - t0, "save": published - save_start, "to_published": published - t0,
                "to_ranks_exited": (ranks_gone or t_exit) - t0, "to_exit": t_exit - t0, "stop_reason": final.get("stop_reason"), "step": final.get("step"),
                "steps_after": final.get("step", 0) - step0, **({"command": command} if command is not None else {})}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        remove(root)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--via", choices=("signal", "stop"), default="signal",
                   help="SIGUSR1 to the launcher, or the `pimm stop RUN` command")
    p.add_argument("extra", nargs="*", help="config overrides (after --)")
    a = p.parse_args()
    load = load_average()
    runs = [one(a.nproc, a.extra, a.via) for _ in range(a.repeats)]
    keys = ("to_save_start", "save", "to_published", "to_ranks_exited", "to_exit") + (("command",) if a.via == "stop" else ())
    out = {"benchmark": "stop_latency", "via": a.via, "signal": "SIGUSR1" if a.via == "signal" else None,
           "world_size": a.nproc, "repeats": a.repeats,
           **{f"{k}_s": r(median([x[k] for x in runs])) for k in keys},
           "steps_after": median([x["steps_after"] for x in runs]),
           "runs": [{k: (r(v) if isinstance(v, float) else v) for k, v in x.items()} for x in runs],
           "machine": machine(load_at_start=load)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
