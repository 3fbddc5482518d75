"""Watching a run from outside: what the console and ``pimm checkpoints diff`` read (torch-free).

Everything here reads the files of a run directory (:mod:`pimm_core.run`) and never
imports torch or Textual, so both the CLI and the console (``pimm_tui``) use it. One job
per module; import from the module (this package imports none of them, so a command
that needs one pays for no other):

- :mod:`.status`: ``status.json`` with heartbeat age, pid liveness, a pending stop
  request, and the verdict "is this run live" (:class:`~.status.StatusView`).
- :mod:`.metrics`: :class:`~.metrics.MetricsTail`, ``metrics.jsonl`` read incrementally;
  :mod:`.series`: its plot series and non-finite records.
- :mod:`.snapshot`: :class:`~.snapshot.RunReader`, all of a run polled into one
  immutable :class:`~.snapshot.RunSnapshot` (for a worker thread).
- :mod:`.candidates`: checkpoint candidates' age, generation and verification.
- :mod:`.resume_diff`: what a checkpoint recorded vs. a planned resume, and the policy row.
- :mod:`.tiers`: the newest checkpoint of each tier (memory, disk, remote), the memory tier's
  copies by step, and the latest recovery.
- :mod:`.fmt`: sizes, durations, ages and logged values as text.

``train.log`` is read by :class:`pimm_core.run.log.LogTail`, next to its writer.

May import: ``run``, ``config``, ``process``, the torch-free ``checkpoint`` subpackages (``records``,
``select``, ``remote``) and the bottom layer; never ``train``/``trainer`` (a sibling), ``launch`` or ``cli``.
"""
