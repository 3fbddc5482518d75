"""Resume time: ``pimm launch --train.resume`` to its first optimizer step vs a fresh start to its first step.

Both are real ``pimm launch`` subprocesses (the project's interpreter, ``-m pimm_core.cli``)
on the same config (``configs/digits.toml`` with ``train.log_every_steps=1`` so every
step is logged to ``metrics.jsonl``, ``data.num_workers=0`` unless overridden):

- template: one launch trains ``--epochs-before`` epochs and ends with ``model/last``
  (made once, not timed);
- ``resume``: a copy of the template run directory, launched with ``--train.resume`` and
  one more epoch; timed from spawn until ``metrics.jsonl`` holds a train record with a
  step past the template's last step (the first optimizer step after the resume);
- ``fresh``: a new run of the same config; timed from spawn until its first train record.

The polled file is read every 5 ms; once the step is seen the child is killed (SIGKILL:
nothing after the first step matters here) and its directory removed. Repeats
alternate fresh / resume; one warm-up pair is discarded.

Prints one JSON object; ``ratio = resume / fresh``. Usage::

    uv run python benchmarks/resume_time.py [--repeats 5] [--epochs-before 1] [-- extra.overrides=...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def launch(root: Path, name: str, overrides: list[str], resume: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(CONFIG), "--run.root", str(root),
           "--run.name", name, "--run.no-timestamp"]
    if resume:
        cmd.append("--train.resume")
    return cmd + ["--", *overrides]


def first_step_after(metrics: Path, after: int, proc: subprocess.Popen, timeout: float = 300.0) -> float | None:
    """Poll ``metrics`` until a train record with step > ``after``; returns the perf_counter time seen."""
    deadline = time.perf_counter() + timeout
    offset, buf = 0, b""
    while time.perf_counter() < deadline:
        if metrics.exists():
            with open(metrics, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("split") == "train" and int(rec.get("step", 0)) > after:
                    return time.perf_counter()
        if proc.poll() is not None:
            return None
        time.sleep(0.005)
    return None


def timed_run(cmd: list[str], run_dir: Path, after: int, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=REPO)
    try:
        seen = first_step_after(run_dir / "metrics.jsonl", after, proc)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    if seen is None:
        raise SystemExit(f"no train step past {after} in {run_dir}/metrics.jsonl: {err.decode()[-800:]}")
    return seen - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--epochs-before", type=int, default=1, help="epochs the template run trains before the resume")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every launch, e.g. model.hidden=1024")
    args = ap.parse_args()

    load_start = load_average()
    work = Path(tempfile.mkdtemp(prefix="pimm-resume-bench-", dir=args.dir))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    base = ["train.log_every_steps=1", "data.num_workers=0", *args.overrides]
    after_epochs = [f"train.epochs={args.epochs_before + 1}"]
    group = work / "digits"
    fresh_s: list[float] = []
    resume_s: list[float] = []
    try:
        tpl = group / "template"
        p = subprocess.run(launch(work, "template", [*base, f"train.epochs={args.epochs_before}"]),
                           capture_output=True, text=True, env=env, cwd=REPO)
        if p.returncode != 0:
            raise SystemExit(f"template run failed: {p.stderr[-800:]}")
        manifest = json.loads((tpl / "model" / "last" / "manifest.json").read_text())
        saved_step = int(manifest["step"])
        ckpt_bytes = sum(f.stat().st_size for f in (tpl / "model" / "last").rglob("*") if f.is_file())
        for repeat in range(args.repeats + 1):
            name = f"fresh{repeat}"
            t_fresh = timed_run(launch(work, name, [*base, *after_epochs]), group / name, 0, env)
            remove(group / name)
            name = f"resume{repeat}"
            shutil.copytree(tpl, group / name, symlinks=True)
            t_resume = timed_run(launch(work, name, [*base, *after_epochs], resume=True), group / name, saved_step, env)
            remove(group / name)
            if repeat:
                fresh_s.append(t_fresh)
                resume_s.append(t_resume)
    finally:
        remove(work)

    print(json.dumps({
        "fresh_to_first_step_s": r(median(fresh_s)),
        "resume_to_first_step_s": r(median(resume_s)),
        "ratio": r(median(resume_s) / median(fresh_s)),
        "resumed_from_step": saved_step,
        "checkpoint_bytes": ckpt_bytes,
        "config": str(CONFIG.relative_to(REPO)), "overrides": base,
        "seconds_all": {"fresh": [r(x) for x in fresh_s], "resume": [r(x) for x in resume_s]},
        "repeats": args.repeats,
        "machine": machine(work.parent, load_start),
    }, indent=2))


if __name__ == "__main__":
    main()
