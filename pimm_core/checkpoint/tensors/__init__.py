"""Tensors of a checkpoint (torch): trainer state as tensors that load with ``weights_only=True``,
tied tensors, and parsing checkpoint bytes without running code.

May import: ``checkpoint.records`` and the layers below ``checkpoint``; not ``checkpoint.select``
(a sibling).
"""
