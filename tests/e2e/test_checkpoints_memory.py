"""``pimm checkpoints ls`` lists the memory tier of a live run from what its ranks publish
(``memory/<rank>.json``, written here by hand as the ranks write them): a line per step with the
ranks holding it (own / a buddy's copy), its age and bytes; the same under ``--json``; nothing when
the run has no ``memory/``; torch never imported (one subprocess for all of it)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from _helpers import REPO, clean_env, describe, hang_s
from tui_support import fake_run, write_generation

# Both commands, on both runs, in one process: their outputs and whether torch was imported.
SCRIPT = """
import contextlib, io, json, sys
from pimm_core.cli import main
out = {}
for name, args in json.loads(sys.argv[1]).items():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(args)
    out[name] = [rc, buf.getvalue()]
out["torch"] = "torch" in sys.modules
print(json.dumps(out))
"""


def _copy(step: int, seconds_ago: float, **head) -> dict:
    return {**head, "step": step, "time": time.time() - seconds_ago, "bytes": 1536, "sha256": "ab" * 32}


def test_ls_lists_the_memory_tier_by_step_with_who_holds_each_copy(tmp_path: Path) -> None:
    host = socket.gethostname()
    rd = fake_run(tmp_path, state="running", step=125, world_size=2)
    (rd / "model").mkdir()
    write_generation(rd / "model" / "last", 100, b"w" * 64)
    (rd / "memory").mkdir()
    # rank 1 was killed while taking its own snapshot of step 120: it reaches 120 through the copy rank 0
    # holds; step 110 is only rank 1's own (rank 0 replaced its own with 120)
    (rd / "memory" / "0.json").write_text(json.dumps(
        {"rank": 0, "host": host, "pid": os.getpid(), "shm": "/dev/shm/pimm-x/0",
         "own": _copy(120, 5, epoch=2), "buddy": _copy(120, 4, rank=1)}))
    (rd / "memory" / "1.json").write_text(json.dumps(
        {"rank": 1, "host": "node-b\x1b[2J[bold]", "pid": os.getpid(), "shm": "/dev/shm/pimm-x/1",
         "own": _copy(110, 65, epoch=2), "buddy": _copy(120, 4, rank=0)}))
    plain = fake_run(tmp_path, "plain", state="running", step=3)

    commands = {"json": ["checkpoints", "ls", str(rd), "--json"], "text": ["checkpoints", "ls", str(rd)],
                "plain_json": ["checkpoints", "ls", str(plain), "--json"],
                "plain_text": ["checkpoints", "ls", str(plain)]}
    result = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(commands)], cwd=REPO,
                            env={**clean_env(), "COLUMNS": "120"}, capture_output=True, text=True,
                            timeout=hang_s(60))
    assert result.returncode == 0, describe(result)
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["torch"] is False
    assert all(out[k][0] == 0 for k in commands), out

    memory = json.loads(out["json"][1])["memory"]
    assert (memory["step"], memory["live"]) == (120, True)
    assert [r["rank"] for r in memory["ranks"]] == [0, 1]
    s120, s110 = memory["steps"]
    assert (s120["step"], s120["reachable"], s120["missing"], s120["bytes"]) == (120, True, [], 3 * 1536)
    assert [(c["rank"], c["holder"], c["kind"]) for c in s120["copies"]] == [(0, 0, "own"), (0, 1, "buddy"),
                                                                             (1, 0, "buddy")]
    assert (s110["step"], s110["reachable"], s110["missing"]) == (110, False, [0])
    assert 64 <= s110["age_s"] < 64 + hang_s(60) and s120["age_s"] < s110["age_s"]

    lines = out["text"][1].splitlines()
    at = lines.index("memory tier (2 ranks, live): every rank reaches step 120")
    assert lines[at + 1].startswith("  step 120  ") and lines[at + 1].endswith(
        f"4.5 KiB  rank 0: own on {host}, copy on rank 1 · rank 1: copy on rank 0"), lines
    # a host name is what a rank wrote: shown, never run as terminal control or markup
    assert lines[at + 2].startswith("  step 110  1 min ") and lines[at + 2].endswith(
        "1.5 KiB  rank 1: own on node-b\\x1b[2J[bold] · missing: rank 0"), lines
    assert "resume would select: last" in lines

    assert "memory" not in json.loads(out["plain_json"][1])
    assert "memory tier" not in out["plain_text"][1]
