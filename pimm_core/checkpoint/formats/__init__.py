"""Checkpoint formats (torch): the protocol every format implements (:mod:`.protocol`), ``standard``
(:mod:`.standard`, the sharded weights in :mod:`.sharded`, the background wrapper :mod:`.async_save`),
``legacy`` and ``single`` (:mod:`.files`), the ``weights.pth`` payload (:mod:`.weights_file`), and the
choice of one by name (:mod:`.choose`).

May import: ``checkpoint.records``, ``checkpoint.select``, ``checkpoint.tensors``, ``checkpoint.publish``
and the layers below ``checkpoint``; not ``remote``, ``weights`` or ``export`` (above or beside).
"""
