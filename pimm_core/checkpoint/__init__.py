"""Checkpoints: atomic publishing, manifests, selection (torch-free) and formats (torch).

Torch-free modules: :mod:`.manifest`, :mod:`.selection`.
Formats (torch): the protocol (:mod:`.protocol`), :mod:`.standard` and its background
wrapper :mod:`.async_save`, ``legacy``/``single`` (:mod:`.files`), chosen by :mod:`.formats`;
shared by all: :mod:`.publish` (atomic publishing, rotation), :mod:`.weights_file`,
:mod:`.state` (trainer state as tensors).
"""
