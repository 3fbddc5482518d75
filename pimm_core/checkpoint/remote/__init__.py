"""A run's checkpoints on a remote store (``checkpoint.remote``, any fsspec URL), torch-free: the
store's layout, listing and download (:mod:`.store`), the background upload (:mod:`.upload`), local or
remote for a resume (:mod:`.choice`), weight sources on a store (:mod:`.source`) and exports written to
one (:mod:`.output`). :mod:`.candidate` holds what the others share (:class:`~.candidate.RemoteCandidate`).

May import: ``checkpoint.records``, ``checkpoint.select`` and the layers below ``checkpoint``; never
torch, nor ``checkpoint.publish`` (a sibling) or the formats above.
"""
