"""Save throughput: pimm's standard checkpoint vs plain ``torch.save`` vs the disk's raw sequential write.

The state (``benchmarks/_common.py``) is a stack of ``Linear(4096, 4096)`` layers and
AdamW after one step: about 1/3 parameters, 2/3 optimizer state, >= ``--gib`` GiB.
Each writer checkpoints periodically, as a run does: ``--repeats`` saves in a row (plus
one warm-up, dropped), each after ``--pause`` seconds that stand for the training
between two checkpoints (an ``os.sync()`` then a sleep). The writers' blocks rotate
order across ``--rounds`` rounds; medians over every measured save of a writer.

- ``pimm``: ``save_standard`` into a model directory that already holds a ``last/``:
  ``trainer.dcp/`` (DCP, fsynced), ``weights.pth``, fsync of the tree,
  ``manifest.json`` with the sha256 of every file, ``.complete``, the rotation
  ``last -> last.prev``, ``last.tmp -> last``, ``last.prev`` removed.
- ``raw``: ``os.write`` of a 64 MiB buffer into a new file until as many bytes as pimm's
  checkpoint holds, ``fsync``, the previous file removed; before writing, the previous
  file's page cache is released (``posix_fadvise(DONTNEED)``) as pimm does, so the new
  write reuses those pages: the fastest sequential write this machine's page cache and
  disk allow for a checkpoint that keeps its predecessor until it is durable.
- ``raw_cold``: the same without releasing the previous file's pages first: what a naive
  writer gets. On a VM with free page reporting (this project's Firecracker machines:
  ``page_reporting.page_reporting_order=11`` on the kernel command line) pages freed
  more than about a second earlier are back with the host and fault in again at
  ~2.3 s/GiB; see ``benchmarks/README.md``.
- ``torch_save``: ``torch.save({"model": ..., "optimizer": ...}, path)`` to a new file,
  ``fsync``, then the previous file removed (``torch_save_no_fsync``: the call alone).

Throughput is bytes written / wall time (GB = 1e9 bytes). pimm's time is also split
into phases (DCP write + its fsync, weights.pth, fsync of the tree, manifest = sha256
of every file, rotation; ``other``: optimizer state dict, packing, directory set-up).
Phases are summed wall time of each step; if a step runs on a second thread they
overlap and ``other`` is clamped at 0.

Prints one JSON object. Usage::

    uv run python benchmarks/save_throughput.py [--gib 1.0] [--repeats 4] [--rounds 2] [--pause 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import GiB, build_state, time_calls, load_average, machine, median, r, remove, settle, state_bytes, tree_bytes  # noqa: E402
from pimm_core.checkpoint.publish import rotation as publish
from pimm_core.checkpoint.formats import standard  # noqa: E402
from pimm_core.fsio import release_cached_pages  # noqa: E402
from pimm_core.process.dist import DistInfo  # noqa: E402

CHUNK = 64 << 20


def phase_timer(phases: dict[str, float]):
    """Time the phases of ``save_standard`` by wrapping the functions it calls (restored on exit)."""
    import torch.distributed.checkpoint as dcp

    return time_calls({"dcp": (dcp, "save"), "weights": (publish, "save_torch_file"), "fsync_tree": (publish, "fsync_tree"),
                       "manifest_sha256": (publish, "describe_files"), "rotate": (publish, "rotate_into_place")}, phases)


def save_pimm(model_dir: Path, model, opt, phases: dict[str, float] | None = None) -> float:
    ctx = phase_timer(phases) if phases is not None else contextlib.nullcontext()
    with ctx:
        t0 = time.perf_counter()
        standard.save_standard(model_dir, model=model, optimizer=opt,
                               meta={"trainer": {"global_step": 1}}, rank_state={"rng": torch.get_rng_state()},
                               manifest={"kind": "last", "step": 1, "epoch": 0, "iter": 0}, info=DistInfo())
        return time.perf_counter() - t0


def save_torch(path: Path, model, opt, previous: Path | None) -> tuple[float, float]:
    """Returns (seconds with fsync and removal of ``previous``, seconds of torch.save alone)."""
    t0 = time.perf_counter()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    t1 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if previous is not None and previous != path:
        previous.unlink(missing_ok=True)
    return time.perf_counter() - t0, t1 - t0


def write_raw(path: Path, nbytes: int, buf: memoryview, previous: Path | None, release: bool) -> float:
    t0 = time.perf_counter()
    if release and previous is not None:
        release_cached_pages(previous)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            n = os.write(fd, buf[:min(left, len(buf))])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    if previous is not None and previous != path:
        previous.unlink(missing_ok=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="minimum state size in GiB (params + AdamW state)")
    ap.add_argument("--width", type=int, default=4096, help="Linear layer width")
    ap.add_argument("--repeats", type=int, default=4, help="measured saves in a row per writer and round (plus one warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of all writers' blocks (order rotates)")
    ap.add_argument("--pause", type=float, default=3.0, help="seconds before each save (the training in between)")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to write (a scratch dir is made inside)")
    args = ap.parse_args()

    warnings.filterwarnings("ignore")
    logging.getLogger("pimm").setLevel(logging.WARNING)
    load_start = load_average()
    model, opt = build_state(int(args.gib * GiB), args.width)
    sizes = state_bytes(model, opt)
    work = Path(tempfile.mkdtemp(prefix="pimm-save-bench-", dir=args.dir))
    model_dir = work / "model"
    model_dir.mkdir()
    buf = memoryview(os.urandom(CHUNK))
    methods = ["pimm", "raw", "raw_cold", "torch_save"]
    times: dict[str, list[float]] = {m: [] for m in methods + ["torch_save_no_fsync"]}
    last_file: dict[str, Path] = {}
    phases: list[dict[str, float]] = []
    pimm_bytes = 0
    n = 0
    try:
        for round_ in range(args.rounds):
            k = round_ % len(methods)
            for which in methods[k:] + methods[:k]:
                for repeat in range(args.repeats + 1):
                    settle()
                    time.sleep(args.pause)
                    n += 1
                    path = work / f"{which}-{n}.bin"
                    if which == "pimm":
                        ph: dict[str, float] = {}
                        t = save_pimm(model_dir, model, opt, ph)
                        pimm_bytes = tree_bytes(model_dir / "last")
                        if repeat:
                            ph["other"] = max(0.0, t - sum(ph.values()))
                            phases.append(ph)
                    elif which == "torch_save":
                        t, t_nofsync = save_torch(path, model, opt, last_file.get(which))
                        if repeat:
                            times["torch_save_no_fsync"].append(t_nofsync)
                    else:
                        t = write_raw(path, pimm_bytes or sizes["total"], buf, last_file.get(which),
                                      release=which == "raw")
                    if which != "pimm":
                        last_file[which] = path
                    if repeat:
                        times[which].append(t)
        nbytes = {"pimm": pimm_bytes, **{m: last_file[m].stat().st_size for m in methods[1:]}}
    finally:
        remove(work)

    med = {k: median(v) for k, v in times.items()}
    gbps = {m: nbytes[m] / med[m] / 1e9 for m in methods}
    phase_med = {k: r(median([p.get(k, 0.0) for p in phases])) for k in phases[0]} if phases else {}
    print(json.dumps({
        "state_bytes": sizes,
        "state_gib": r(sizes["total"] / GiB, 3),
        "layers": sum(1 for m in model if isinstance(m, torch.nn.Linear)), "width": args.width,
        "bytes_on_disk": nbytes,
        "seconds_median": {k: r(v) for k, v in med.items()},
        "gb_per_s": {k: r(v, 3) for k, v in gbps.items()},
        "ratio_pimm_to_raw": r(gbps["pimm"] / gbps["raw"]),
        "ratio_pimm_to_raw_cold": r(gbps["pimm"] / gbps["raw_cold"]),
        "ratio_pimm_to_torch_save": r(gbps["pimm"] / gbps["torch_save"]),
        "target_pimm_to_raw": 0.8,
        "pimm_phases_s_median": phase_med,
        "seconds_all": {k: [r(x) for x in v] for k, v in times.items()},
        "repeats": args.repeats, "rounds": args.rounds, "pause_s": args.pause,
        "machine": machine(work.parent, load_start),
    }, indent=2))


if __name__ == "__main__":
    main()
