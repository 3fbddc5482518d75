"""The run directory: its layout and the small files a run keeps up to date (torch-free).

One module per file kind, each with its writer and its reader side by side:

- :mod:`.layout`: file names, what counts as a run directory, run naming.
- :mod:`.claim`: creating the run directory (numbered names, taking it back unstarted).
- :mod:`.status`: ``status.json`` (:class:`RunStatus`, :func:`write_status`, :class:`StatusWriter`, :func:`read_run_status`).
- :mod:`.metrics`: ``metrics.jsonl`` (:class:`MetricsWriter`, :func:`read_metrics`).
- :mod:`.log`: ``train.log`` (:func:`log_handler`, :class:`LogTail`).
- :mod:`.provenance`: ``provenance.json`` and the recorded launch.
- :mod:`.ranks`, :mod:`.heartbeat`: ``ranks/<rank>.json``, each rank's heartbeat (step, phase, last
  progress), its reader and the rule naming the rank the others wait for; its throttled writer.
- :mod:`.jsonfile`, :mod:`.values`: reading JSON objects and the numbers in them.
- :mod:`.entries`: the entries pimm writes are its own (never links, the right kind), opened
  without following links; a directory it cannot write is one line.

- :mod:`.topology`: what a checkpoint recorded vs. what a resume will run with, and the resume
  policy that follows (not re-exported below: it reads the config).

Everything here is torch-free so readers (CLI, console) stay fast. Only rank 0 writes, except
each rank's own heartbeat file.

May import: the bottom layer (``errors``, ``faults``, ``fsio``, ``text``); :mod:`.topology` also
``config`` and ``data.global_order``. Never ``process``, ``checkpoint`` or anything above.
The names below are re-exported so ``from pimm_core.run import STATUS, write_status``
works without knowing which module holds them.
"""

from .claim import RunDirClaim, claim_run_dir, free_run_dir, numbered
from .jsonfile import read_json, write_json
from .layout import (CONFIG, CONTROL, LOG, METRICS, MODEL, PROVENANCE, RUN_MARKERS, STATUS, SUPERSEDED, check_run_dir, find_run_dir,
                     is_run_dir, model_dir_of, run_dir_for, run_markers, run_name, was_started)
from .log import LogTail, log_handler
from .metrics import MetricsWriter, parse_record, read_metrics, supersede_after
from .provenance import (LAUNCH_ENV, append_provenance, code_version, current_code_version, launch_record,
                         read_provenance, recorded_launch, recorded_world_size, scheduler_record)
from .status import STATES, RunStatus, StatusWriter, now_iso, read_run_status, write_status

__all__ = [
    "CONFIG", "CONTROL", "LAUNCH_ENV", "LOG", "METRICS", "MODEL", "PROVENANCE", "RUN_MARKERS", "STATES", "STATUS", "SUPERSEDED",
    "LogTail", "MetricsWriter", "RunDirClaim", "RunStatus", "StatusWriter", "append_provenance", "check_run_dir", "claim_run_dir",
    "code_version", "current_code_version", "find_run_dir", "free_run_dir", "is_run_dir", "launch_record", "scheduler_record",
    "log_handler", "model_dir_of", "now_iso", "numbered", "parse_record", "read_json", "read_metrics",
    "read_provenance", "read_run_status", "recorded_launch", "recorded_world_size", "run_dir_for", "run_markers",
    "run_name", "supersede_after", "was_started", "write_json", "write_status",
]
