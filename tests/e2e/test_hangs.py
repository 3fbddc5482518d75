"""Ranks that hang: at 2 ranks (real torchrun, gloo) a user callback stalls rank 1 past
``dist.timeout``. The run fails instead of waiting forever: one ``error:`` line naming rank 1 and
its phase, a non-zero exit, ``status.json`` failed, ``last`` intact, and ``--train.auto-resume``
completes the run. Every rank's heartbeat file says where it was.

``dist.timeout`` stays 0.5 min: besides the collective the stalled rank is missed in, it bounds
process-group set-up (the two ranks' start-ups, ~20 s of imports each on a loaded 2-core machine,
may drift apart by seconds) and every checkpoint barrier, and a healthy run failing there on a busy
machine would fail this test. The stalled rank wakes as soon as rank 0 has ended (not after a fixed
margin past the timeout), so the test waits the timeout once and no longer."""

from __future__ import annotations

import json
import re
from pathlib import Path

from _helpers import DIGITS, describe, pimm, read_json
from test_user_code import _launch

_STALL = """
[[callbacks]]
target = "stall_rank:StallRank"
[callbacks.args]
rank = 1
at_step = {at_step}
seconds = {seconds}
flag = "{flag}"
"""

# The callback, beside the config (found through its directory): one rank stops making progress
# inside a callback moment, as a user's logging call to a server that never answers would.
_STALL_MODULE = """\
import json
import os
import time
from pathlib import Path


def _ended(beat_file):
    \"\"\"The rank of this heartbeat file has ended: the file says so and its process is gone.\"\"\"
    try:
        beat = json.loads(beat_file.read_text())
    except (OSError, ValueError):
        return False
    if beat.get("phase") != "end":
        return False
    try:
        state = Path(f"/proc/{beat['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True  # (reaped)
    return state in ("Z", "X")


class StallRank:
    \"\"\"At the end of optimizer step ``at_step``, rank ``rank`` stops (sleeps) while the file ``flag``
    exists, until every other rank has ended (its heartbeat says ``end`` and its process is gone),
    at most ``seconds``.\"\"\"

    def __init__(self, rank, at_step, seconds, flag):
        self.rank, self.at_step, self.seconds, self.flag = rank, at_step, seconds, Path(flag)

    def on_step_end(self, trainer):
        if trainer.info.rank != self.rank or trainer.state.global_step != self.at_step or not self.flag.exists():
            return
        (self.flag.parent / f"stalled-{os.getpid()}").write_text(str(time.time()))
        others = [trainer.run_dir / "ranks" / f"{r}.json" for r in range(trainer.info.world_size) if r != self.rank]
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline and not all(_ended(f) for f in others):
            time.sleep(0.2)
"""

TIMEOUT_MIN = 0.5  # 30 s: far above a healthy collective on a loaded machine (see the module docstring)
AT_STEP = 5
COMMON = ("train.epochs=1", "train.max_steps=8", "checkpoint.every_steps=2", "eval.every_epochs=0",
          f"dist.timeout={TIMEOUT_MIN}")


def test_a_rank_stuck_in_a_callback_fails_the_run_naming_it_and_auto_resume_completes(tmp_path: Path):
    (tmp_path / "stall_rank.py").write_text(_STALL_MODULE)  # beside the config: found through its directory
    flag = tmp_path / "stall-while-this-exists"
    flag.write_text("")
    config = tmp_path / "stall.toml"
    # rank 1 stalls until rank 0 has timed out and ended (at most 10 s past the timeout), then finds it gone
    # and ends too
    config.write_text(DIGITS.read_text() + _STALL.format(at_step=AT_STEP, seconds=TIMEOUT_MIN * 60 + 10, flag=flag))
    root, run = tmp_path / "exp", tmp_path / "exp" / "digits" / "hang"

    first = _launch(config, root, "hang", nproc=2, overrides=COMMON)
    assert first.returncode == 1, describe(first)
    assert list(tmp_path.glob("stalled-*")), "the callback never stalled rank 1"
    errors = [ln for ln in first.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, describe(first)
    line = errors[0]
    assert "rank 1 made no progress" in line and "phase callback (on_step_end of StallRank)" in line, line
    assert f"step {AT_STEP}" in line and "dist.timeout (0.5 min)" in line and "pimm resume" in line, line
    assert "Traceback" not in first.stderr, describe(first)
    # every rank's stack, and the frame each waits in: rank 1 in the user's callback, rank 0 in the collective
    stall = re.escape(str(tmp_path / "stall_rank.py"))
    assert re.search(rf"rank 1 made no progress [^;]*, waiting in {stall}:\d+ in (on_step_end|_ended);", line), line
    assert re.search(r"rank 0 waited for it in \S+/pimm_core/\S+\.py:\d+ in \w+ past dist.timeout", line), line
    assert f"every rank's stack: {run}/ranks/<rank>.stack" in line, line
    stacks = {r: (run / "ranks" / f"{r}.stack").read_text() for r in (0, 1)}
    assert "in on_step_end" in stacks[1] and "StallRank" not in stacks[0], stacks
    assert all(s.startswith(f"# rank {r} pid ") for r, s in stacks.items()), stacks

    status = read_json(run / "status.json")
    assert status["state"] == "failed" and "rank 1 made no progress" in status["error"], status
    beats = {int(p.stem): json.loads(p.read_text()) for p in (run / "ranks").glob("*.json")}
    assert set(beats) == {0, 1}, beats
    # both ended (rank 1 once it woke and found rank 0 gone), at the step rank 1 stalled in
    assert [(b["phase"], b["step"]) for b in beats.values()] == [("end", AT_STEP)] * 2, beats

    # the last checkpoint (step 4) is whole, and the run goes on from it once rank 1 no longer stalls
    assert read_json(run / "model" / "last" / "manifest.json")["step"] == AT_STEP - 1
    verify = pimm("checkpoints", "verify", run / "model" / "last")
    assert verify.returncode == 0, describe(verify)
    flag.unlink()
    second = _launch(config, root, "hang", "--train.auto-resume", nproc=2, overrides=COMMON)
    assert second.returncode == 0, describe(second)
    assert "done:" in second.stdout, describe(second)
    assert read_json(run / "status.json")["state"] == "finished"
    assert read_json(run / "model" / "last" / "manifest.json")["step"] == 8
    starts = [e for e in read_json(run / "provenance.json")["starts"] if e.get("kind") != "stop"]
    assert starts[-1]["kind"] == "resume" and starts[-1]["checkpoint_step"] == AT_STEP - 1, starts[-1]
