"""A callback for the hang tests: one rank stops making progress inside a callback moment, as a
user's logging call to a server that never answers would (``time.sleep``, not a crash)."""

from __future__ import annotations

import os
import time
from pathlib import Path


class StallRank:
    """At the end of optimizer step ``at_step``, rank ``rank`` sleeps ``seconds`` while the file
    ``flag`` exists (the test removes it before the resume, which then trains on)."""

    def __init__(self, rank: int, at_step: int, seconds: float, flag: str):
        self.rank, self.at_step, self.seconds, self.flag = rank, at_step, seconds, Path(flag)

    def on_step_end(self, trainer):
        if trainer.info.rank == self.rank and trainer.state.global_step == self.at_step and self.flag.exists():
            (self.flag.parent / f"stalled-{os.getpid()}").write_text(str(time.time()))
            time.sleep(self.seconds)
