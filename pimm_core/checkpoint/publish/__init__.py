"""Publishing a checkpoint: atomic files, the ``<name>.tmp`` -> ``<name>`` rotation, the failure
contract every format shares (:mod:`.rotation`), and sha256 computed while files are written (:mod:`.follow`).

May import: ``checkpoint.records``, ``checkpoint.select``, ``checkpoint.tensors`` and the layers below
``checkpoint``; not ``checkpoint.remote`` (a sibling), nor the formats above.
"""
