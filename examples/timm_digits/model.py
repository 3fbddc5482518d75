"""A timm image model built by ``timm.create_model`` (random weights, no download).

``pimm export`` writes its state dict under timm's own names, so
``timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=.../model.safetensors,
num_classes=...))`` builds the trained model again.
"""

from __future__ import annotations


def timm_model(name: str = "resnet18", num_classes: int = 10, in_chans: int = 1):
    """``timm.create_model(name, pretrained=False, num_classes=..., in_chans=...)``."""
    import timm

    return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_chans)
