"""Export: a portable model directory from a saved checkpoint (:mod:`.model_dir`), the files it writes
(:mod:`.files`), the config as it may leave the machine (:mod:`.config`), and library models written the
way their library does (:mod:`.library_model`).

May import: every other ``checkpoint`` subpackage (export sits on top; nothing in ``checkpoint`` imports it)
and the layers below ``checkpoint``.

The names of :mod:`.model_dir` are re-exported lazily (importing :mod:`.library_model` does not load the
export), so ``from pimm_core.checkpoint.export import export_weights`` works as before the regroup.
"""

from __future__ import annotations

from typing import Any

#: The public names of :mod:`.model_dir`, importable from ``pimm_core.checkpoint.export``.
MODEL_DIR = ("CONFIG_JSON", "EXPORT_JSON", "EXPORT_VERSION", "FORMATS", "export", "export_weights", "load_exported")


def __getattr__(name: str) -> Any:
    if name in MODEL_DIR:
        from . import model_dir

        return getattr(model_dir, name)
    raise AttributeError(f"module 'pimm_core.checkpoint.export' has no attribute {name!r}")
