"""Page cache probe: how fast a write fills page-cache pages freed just before vs. a while before.

On VMs with free page reporting (this project's Firecracker machines boot with
``page_reporting.page_reporting_order=11``) the guest hands memory that has been free for
about a second back to the host, and faulting it in again is slow. A checkpoint write
that reuses pages freed just before (pimm releases the previous checkpoint's page cache
right before writing the next, ``pimm_core.fsio.release_cached_pages``)
runs at memory speed; one that takes pages freed earlier pays the host faults.

For each pause in ``--pauses``: write ``--mib`` MiB to a file, remove it, sleep the pause,
write the same amount to a new file (64 MiB ``os.write`` calls, then ``fsync``). Reports
the ``write()`` time and the ``fsync`` time separately, medians of ``--repeats``.

Prints one JSON object. Usage::

    uv run python benchmarks/page_cache_probe.py [--mib 512] [--pauses 0 0.5 1 2 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine, median, r  # noqa: E402

CHUNK = 64 << 20


def write(path: Path, nbytes: int, buf: memoryview) -> tuple[float, float]:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[:min(left, len(buf))])
        t1 = time.perf_counter()
        os.fsync(fd)
    finally:
        os.close(fd)
    return t1 - t0, time.perf_counter() - t1


def kernel_page_reporting() -> str | None:
    try:
        words = Path("/proc/cmdline").read_text().split()
    except OSError:
        return None
    return next((w for w in words if w.startswith("page_reporting.")), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--pauses", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    load_start = load_average()
    nbytes = args.mib << 20
    buf = memoryview(os.urandom(CHUNK))
    work = Path(tempfile.mkdtemp(prefix="pimm-page-cache-", dir=args.dir))
    results: dict[str, dict[str, list[float]]] = {}
    try:
        path = work / "a.bin"
        write(path, nbytes, buf)
        for _ in range(args.repeats):
            for pause in args.pauses:
                path.unlink()
                time.sleep(pause)
                w, s = write(path, nbytes, buf)
                results.setdefault(str(pause), {"write_s": [], "fsync_s": []})
                results[str(pause)]["write_s"].append(w)
                results[str(pause)]["fsync_s"].append(s)
    finally:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
    print(json.dumps({
        "mib": args.mib,
        "kernel_page_reporting": kernel_page_reporting(),
        "by_pause_s": {p: {"write_s": r(median(v["write_s"])), "fsync_s": r(median(v["fsync_s"])),
                           "write_gb_per_s": r(nbytes / median(v["write_s"]) / 1e9, 3)} for p, v in results.items()},
        "repeats": args.repeats,
        "machine": machine(args.dir, load_start),
    }, indent=2))


if __name__ == "__main__":
    main()
