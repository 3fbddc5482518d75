"""The memory tier (``checkpoint.memory_every_steps``): each rank's trainer state in node-local shared
memory (:mod:`.store`) and a copy on its buddy rank, moved over a gloo group of its own (:mod:`.exchange`).
What goes in a copy and when is the trainer's (:mod:`pimm_core.train.memory`); the index the ranks
publish for readers is :mod:`pimm_core.run.memory_index`. See docs/memory-tier.md.

May import: ``errors``, ``fsio``, ``faults``, ``run``, ``process``; inside ``checkpoint`` the lower steps
(``records``, ``tensors``). No import at import time.
"""
