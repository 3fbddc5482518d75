"""Scripting latency: ``pimm checkpoints ls --json`` on a run with 200 checkpoints vs ``python -c "import torch"``.

The run directory is fabricated from real pimm files: a standard ``model/last/`` from a
real (tiny) ``save_standard``, and ``--checkpoints`` weights-only snapshots
``iter_<step>.pth``, each a copy of one real ``write_weights_file`` output with its own
sidecar manifest ``iter_<step>.pth.json`` (step, epoch, metrics, size, sha256), plus
``model_best.pth`` and its sidecar. Both commands run as fresh subprocesses with the
project's interpreter, interleaved, one warm-up pair discarded; medians of wall time
from spawn to exit. The listing's output is checked (all snapshots listed, ``last``
selected).

``pimm`` is timed as the installed console script (``.venv/bin/pimm``, what
``uv run pimm`` execs), as ``python -m pimm_core.cli``, and through ``uv run pimm`` as
the README spells it (``uv run`` adds its own start-up: a lock-file check, and no bytecode
compilation, since pimm compiles at install, not per call).

Prints one JSON object; ``ratio = pimm / import torch`` (target <= 0.3), and
``per_snapshot_ms``: (the listing of the run minus the listing of the same run without its
snapshots) / snapshots, what each ``iter_<step>.pth`` adds to ``checkpoints ls --json``. Usage::

    uv run python benchmarks/scripting_latency.py [--checkpoints 200] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine, median, r, remove  # noqa: E402


def fabricate(run_dir: Path, n: int) -> None:
    import torch

    from pimm_core.checkpoint.records.manifest import sha256_file, write_manifest
    from pimm_core.checkpoint.formats.standard import save_standard
    from pimm_core.checkpoint.formats.weights_file import write_weights_file
    from pimm_core.process.dist import DistInfo

    model_dir = run_dir / "model"
    model_dir.mkdir(parents=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    step = 50 * n
    base = {"step": step, "epoch": n, "iter": 0, "world_size": 1, "workers_per_rank": 0,
            "metrics": {"val/acc": 0.97, "val/loss": 0.1}, "created": "2026-11-29T12:00:00+00:00",
            "torch_version": torch.__version__, "code_version": "bench"}
    save_standard(model_dir, model=model, optimizer=opt, meta={"trainer": {"global_step": step}},
                  rank_state={"rng": torch.get_rng_state()}, manifest={"kind": "last", **base}, info=DistInfo())
    best = model_dir / "model_best.pth"
    write_weights_file(best, model, {"kind": "best", **base,  # (as a run's best_files writes it)
                                     "selection_metric": {"name": "val/acc", "value": 0.97, "mode": "max"}})
    template = model_dir / ".iter_template.pth"
    shutil.copyfile(best, template)
    size, digest = template.stat().st_size, sha256_file(template)
    for i in range(1, n + 1):
        path = model_dir / f"iter_{50 * i}.pth"
        shutil.copyfile(template, path)
        write_manifest(path.with_name(path.name + ".json"), {
            "format": "weights", "kind": "iter", **base, "step": 50 * i, "epoch": i,
            "files": {path.name: {"size": size, "sha256": digest}}})
    template.unlink()


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    t = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    return t, p.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=200, help="iter_<step>.pth snapshots in the run")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()

    warnings.filterwarnings("ignore")
    load_start = load_average()
    py = sys.executable
    pimm_script = Path(py).parent / "pimm"
    env = {k: v for k, v in os.environ.items() if k != "UV_COMPILE_BYTECODE"}
    env["PYTHONPATH"] = str(REPO)
    work = Path(tempfile.mkdtemp(prefix="pimm-ls-bench-", dir=args.dir))
    run_dir = work / "exp" / "bench" / "run"
    empty_dir = work / "exp" / "bench" / "run0"  # the same checkpoints without the snapshots
    commands = {
        "pimm_ls_json": [str(pimm_script), "checkpoints", "ls", "--json", str(run_dir)],
        "pimm_ls_json_no_snapshots": [str(pimm_script), "checkpoints", "ls", "--json", str(empty_dir)],
        "pimm_ls_json_python_m": [py, "-m", "pimm_core.cli", "checkpoints", "ls", "--json", str(run_dir)],
        "import_torch": [py, "-c", "import torch"],
        "python_startup": [py, "-c", "pass"],
    }
    uv = shutil.which("uv")
    if uv:
        commands["pimm_ls_json_uv_run"] = [uv, "run", "--project", str(REPO), "pimm", "checkpoints", "ls", "--json",
                                           str(run_dir)]
    if not pimm_script.exists():
        commands.pop("pimm_ls_json")
        commands["pimm_ls_json_no_snapshots"][0:1] = [py, "-m", "pimm_core.cli"]
    times: dict[str, list[float]] = {k: [] for k in commands}
    try:
        fabricate(run_dir, args.checkpoints)
        fabricate(empty_dir, 0)
        for repeat in range(args.repeats + 1):
            for name, cmd in commands.items():
                t, out = timed(cmd, env)
                if name.startswith("pimm"):
                    listing = json.loads(out)
                    iters = [c for c in listing["candidates"] if c["name"].startswith("iter_")]
                    want = 0 if "no_snapshots" in name else args.checkpoints
                    assert len(iters) == want and listing["selected"] == "last", listing["selected"]
                if repeat:
                    times[name].append(t)
    finally:
        remove(work)

    med = {k: median(v) for k, v in times.items()}
    main_key = "pimm_ls_json" if "pimm_ls_json" in med else "pimm_ls_json_python_m"
    print(json.dumps({
        "checkpoints": args.checkpoints,
        "seconds_median": {k: r(v) for k, v in med.items()},
        "ratio": r(med[main_key] / med["import_torch"]),
        "ratio_python_m": r(med["pimm_ls_json_python_m"] / med["import_torch"]),
        "ratio_uv_run": r(med["pimm_ls_json_uv_run"] / med["import_torch"]) if "pimm_ls_json_uv_run" in med else None,
        "target_ratio": 0.3,
        "per_snapshot_ms": r((med[main_key] - med["pimm_ls_json_no_snapshots"]) * 1000 / args.checkpoints),
        "pimm_command": " ".join(Path(c).name if i == 0 else c for i, c in enumerate(commands[main_key][:4])),
        "seconds_all": {k: [r(x) for x in v] for k, v in times.items()},
        "repeats": args.repeats,
        "machine": machine(work.parent, load_start),
    }, indent=2))


if __name__ == "__main__":
    main()
