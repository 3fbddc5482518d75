"""Checkpoints (layer **checkpoint**): one subpackage per job, bottom to top.

1. :mod:`.records` (torch-free): what pimm writes and recognizes on disk: ``manifest.json``
   (:mod:`~.records.manifest`), a generation read whole while a live run replaces it
   (:mod:`~.records.generation`), files pimm did not write (:mod:`~.records.foreign`), outputs the
   user names (:mod:`~.records.outputs`), pimm's scratch directories (:mod:`~.records.scratch`).
2. :mod:`.select` (torch-free): which checkpoint: the candidates of a ``model/`` directory and their
   names (:mod:`~.select.candidate`), :func:`~.select.selection.select_resume`, verification against
   the manifest (:mod:`~.select.verify`), a path the user named (:mod:`~.select.resume_path`), going
   back to an earlier one (:mod:`~.select.branch`).
   :mod:`.tensors` (torch, beside ``select``): trainer state as tensors (:mod:`~.tensors.state`), tied
   tensors (:mod:`~.tensors.ties`), parsing checkpoint bytes without running code (:mod:`~.tensors.safe_read`).
3. :mod:`.publish.rotation`: atomic files, the ``<name>.tmp`` -> ``<name>`` rotation and the failure contract
   (:mod:`~.publish.rotation`), sha256 while writing (:mod:`~.publish.follow`).
   :mod:`.remote` (torch-free, beside ``publish``): a run's checkpoints on ``checkpoint.remote``: the
   store (:mod:`~.remote.store`), the background upload (:mod:`~.remote.upload`), local or remote for a
   resume (:mod:`~.remote.choice`), remote weight sources (:mod:`~.remote.source`) and exports
   (:mod:`~.remote.output`).
4. :mod:`.formats.choose` (torch): the format protocol and ``standard`` (with its background wrapper),
   ``legacy``/``single``, the sharded weights, the ``weights.pth`` payload, and choosing one by name
   (:mod:`~.formats.choose`).
5. :mod:`.weights.read`: weight sets from any source: resolving a source (:mod:`~.weights.sources`,
   ``hf://`` in :mod:`~.weights.hub`), reading it (:mod:`~.weights.read`), strict load, warm start, key rules.
6. :mod:`.export.model_dir`: a portable model directory from a checkpoint (:mod:`~.export.model_dir`).

A subpackage imports only those below it (a sibling on the same step never imports the other), the
layers below ``checkpoint`` (``errors``, ``fsio``, ``faults``, ``run``, ``process``, ``config``) and never
``train``, ``watch``, ``launch`` or ``cli``; ``tests/unit/test_layers.py`` checks this. The
torch-free ones (``records``, ``select``, ``remote``, and ``weights.sources``/``hub``) are what the
scripting commands (``pimm checkpoints``) import. No ``__init__`` here imports anything at import time.
"""
