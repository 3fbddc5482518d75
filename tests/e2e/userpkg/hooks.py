"""Callbacks for the tests. EventCounter: counts the moments it sees, stops the run at a step, keeps its counts
in checkpoints (``state_dict``), and writes them (rank 0) to ``out`` as JSON after each moment.
StartupProbe: what the process looked like at its first step (threads, imported modules)."""

from __future__ import annotations

import json
import os
from pathlib import Path

#: What this module read from the environment when it was imported (ExitProbe: in each rank, its own rank).
RANK_AT_IMPORT = os.environ.get("RANK")


class EventCounter:
    def __init__(self, out: str, stop_at: int = 0):
        self.out, self.stop_at = Path(out), stop_at
        self.counts = {"step_end": 0, "eval_end": 0, "checkpoint_saved": 0, "stop_requested": 0, "train_end": 0}
        self.saved: list[str] = []
        self.restored = False

    def _note(self, trainer, what):
        self.counts[what] += 1
        if trainer.info.is_main:
            self.out.write_text(json.dumps({"counts": self.counts, "saved": self.saved, "restored": self.restored,
                                            "step": trainer.state.global_step, "pid": os.getpid()}))

    def on_step_end(self, trainer):
        self._note(trainer, "step_end")
        if trainer.state.global_step == self.stop_at:
            trainer.stop.request("callback stop")

    def on_eval_end(self, trainer, metrics):
        assert "val/acc" in metrics
        self._note(trainer, "eval_end")

    def on_checkpoint_saved(self, trainer, path):
        self.saved.append(Path(path).name)
        self._note(trainer, "checkpoint_saved")

    def on_stop_requested(self, trainer, reason):
        assert "callback stop" in reason
        self._note(trainer, "stop_requested")

    def on_train_end(self, trainer):
        self._note(trainer, "train_end")

    def state_dict(self):
        return {"counts": dict(self.counts), "saved": list(self.saved)}

    def load_state_dict(self, state):
        self.counts, self.saved, self.restored = dict(state["counts"]), list(state["saved"]), True


class StartupProbe:
    """Writes ``out`` (JSON) at the first step's end: the process's intra-op threads
    (``torch.get_num_threads()``) and which of ``modules`` were imported by then."""

    def __init__(self, out: str, modules: list[str]):
        self.out, self.modules, self.done = out, modules, False

    def on_step_end(self, trainer):
        import sys

        import torch

        if not self.done:
            self.done = True
            Path(self.out).write_text(json.dumps({"threads": torch.get_num_threads(),
                                                  "imported": [m for m in self.modules if m in sys.modules]}))


class ExitProbe:
    """At the first step's end, writes ``<out>-<rank>.json`` (this process's pid, its parent's, its parent's
    parent, its session, ``$PIMM_LAUNCHER_PID`` and whether pimm's fail points are armed in it), leaves a thread pool with an idle worker thread (which
    only the interpreter's exit stops: ``threading``'s exit functions), and registers an ``atexit`` function
    that writes ``<out>-<rank>.exit``: a process ended as an interpreter does writes it."""

    def __init__(self, out: str):
        self.out, self.done = out, False

    def on_step_end(self, trainer):
        if self.done:
            return
        self.done = True
        import atexit
        from concurrent.futures import ThreadPoolExecutor

        from pimm_core import faults  # (what a pimm module that read the environment at import saw)

        rank = trainer.info.rank
        ppid = os.getppid()
        grandparent = int(Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        launcher = int(os.environ["PIMM_LAUNCHER_PID"])
        Path(f"{self.out}-{rank}.json").write_text(json.dumps({
            "pid": os.getpid(), "ppid": ppid, "grandparent": grandparent, "sid": os.getsid(0),
            "launcher": launcher, "failpoint_armed": bool(faults._SPEC), "rank_at_import": RANK_AT_IMPORT,
            "parent_cmdline": Path(f"/proc/{ppid}/cmdline").read_text(),
            "launcher_cmdline": Path(f"/proc/{launcher}/cmdline").read_text(),
            "pythonpath": os.environ.get("PYTHONPATH", "")}))
        self.pool = ThreadPoolExecutor(1)
        self.pool.submit(int).result()
        atexit.register(Path(f"{self.out}-{rank}.exit").write_text, "exited")
