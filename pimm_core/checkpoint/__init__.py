"""Checkpoints: atomic publishing, manifests, selection (torch-free) and formats (torch).

Torch-free modules: :mod:`.manifest`, :mod:`.selection`.
Modules that import torch: :mod:`.standard`, :mod:`.state`.
"""
