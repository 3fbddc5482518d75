"""Which checkpoint (torch-free): the candidates in a ``model/`` directory, the one a resume takes
(:func:`~.selection.select_resume`, the only place that decides), sha256 verification, a path the user
named, and branching back to an earlier one.

May import: ``checkpoint.records`` and the layers below ``checkpoint``; never torch. Inside it,
:mod:`.candidate` (the names and :class:`~.candidate.Candidate`) imports no sibling, so :mod:`.verify`
and :mod:`.selection` both build on it without importing each other back.
"""
