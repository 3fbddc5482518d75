"""pimm's operator console (Textual): ``pimm tui exp/<group>/<run>``, or ``pimm tui exp`` for every run.

Reads the run only through :mod:`pimm_core`'s torch-free readers
(:mod:`pimm_core.watch`, selection, topology) and acts only through pimm_core
(:func:`pimm_core.process.stop.write_stop_file`, :func:`pimm_core.checkpoint.export.model_dir.export`).
"""

from __future__ import annotations

from .app import PimmConsole, build_app, build_runs_app

__all__ = ["PimmConsole", "build_app", "build_runs_app"]
