"""The final line of ``gpu_check.sh``: one JSON object summarizing its stages.

Usage: ``python benchmarks/gpu_check_summary.py OUT DEVICE NPROC [STAGE RC SECONDS]...``; reads
``OUT/<stage>.json`` (each stage's benchmark output) and prints
``{"device", "nproc", "ok", "stages": {stage: {"status", "seconds", "figures"}}}``, where
``figures`` are the stage's headline numbers (ratios, medians) and ``status`` is
``passed``, ``timed out`` or ``failed (exit N)``. Exit status 1 unless every stage passed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def headline(stage: str, d: dict) -> dict:
    if stage.startswith("step_"):
        return {s: {k: d[s][k] for k in ("pimm_step_ms", "hand_step_ms", "ratio", "pimm_mean_ms", "hand_mean_ms",
                                         "mean_ratio")} for s in ("ddp", "fsdp") if s in d}
    if stage.startswith("memory"):
        return {"state_ratio": d.get("state_ratio"), "met": d.get("met"), "ratios": d.get("ratios_fsdp_over_ddp"),
                "ddp_max_mib": d["ddp"]["max_over_ranks_mib"], "fsdp_max_mib": d["fsdp"]["max_over_ranks_mib"]}
    if stage == "checkpoint":
        keep = ("save_s", "load_s", "save_no_gather_s", "async_stall_s", "async_background_s", "checkpoint_mib",
                "restored_ok", "error")
        out = {"ratios": d.get("ratios")}
        for k, v in d.items():
            if k in ("ddp", "fsdp") or k.startswith("fsdp_"):
                out[k] = {f: v[f] for f in keep if f in v}
        return out
    return {}


def main(argv: list[str]) -> int:
    out, device, nproc, rest = Path(argv[0]), argv[1], int(argv[2]), argv[3:]
    stages = {}
    for name, rc, secs in zip(rest[0::3], rest[1::3], rest[2::3]):
        rc = int(rc)
        status = "passed" if rc == 0 else "timed out" if rc in (124, 137) else f"failed (exit {rc})"
        entry: dict = {"status": status, "seconds": int(secs)}
        try:
            entry["figures"] = headline(name, json.loads((out / f"{name}.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            if rc == 0:
                entry["status"] = f"failed (its output could not be read: {type(e).__name__})"
        stages[name] = entry
    ok = all(s["status"] == "passed" for s in stages.values())
    print(json.dumps({"device": device, "nproc": nproc, "ok": ok, "output_dir": str(out), "stages": stages}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
