"""The names that configs, written runs and user code use from before the regroup of issue #33 still
resolve: modules that became packages re-export their names (``pimm_core.config``, ``pimm_core.data``,
``pimm_core.checkpoint.export``), ``pimm_core.data_rng`` is kept as a compatibility module, and config
targets such as ``"pimm_core.data:digits"`` (the spelling of ``data.name`` in a run's ``config.toml``)
still load."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from pimm_core.config import config_from_dict
from pimm_core.targets import TargetSpec, resolve

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("target, module, name", [
    ("pimm_core.data:digits", "pimm_core.data.loaders", "digits"),
    ("pimm_core.data:Datasets", "pimm_core.data.loaders", "Datasets"),
    ("pimm_core.data:stream_shard", "pimm_core.data.loaders", "stream_shard"),
    ("pimm_core.data_rng:EpochSeeded", "pimm_core.data.rng", "EpochSeeded"),
    ("pimm_core.data_rng:sample_generator", "pimm_core.data.rng", "sample_generator"),
    ("pimm_core.config:Config", "pimm_core.config.schema", "Config"),
    ("pimm_core.config:load_config", "pimm_core.config.load", "load_config"),
    ("pimm_core.config:RANGES", "pimm_core.config.checks", "RANGES"),
    ("pimm_core.checkpoint.export:export_weights", "pimm_core.checkpoint.export.model_dir", "export_weights"),
    ("pimm_core.models:mlp", "pimm_core.models", "mlp"),
    ("pimm_core.objectives:language_modeling", "pimm_core.objectives", "language_modeling"),
])
def test_an_old_target_resolves_to_the_moved_object(target: str, module: str, name: str) -> None:
    import importlib

    assert resolve(TargetSpec("data.target", target)) is getattr(importlib.import_module(module), name)


def test_a_written_runs_config_with_old_targets_still_builds() -> None:
    """A ``config.toml`` written before the regroup names the built-in data and model as targets."""
    cfg = config_from_dict({"data": {"target": "pimm_core.data:digits", "args": {"val_fraction": 0.2}},
                            "model": {"target": "pimm_core.models:mlp", "args": {"hidden": 8}}})
    from pimm_core.data.loaders import digits

    assert resolve(TargetSpec("data.target", cfg.data.target)) is digits


def test_the_data_package_re_exports_every_public_name_of_the_loaders() -> None:
    """``pimm_core.data.LOADERS`` (the lazy re-exports) is exactly what ``data/loaders.py`` defines."""
    import pimm_core.data as data

    tree = ast.parse((REPO / "pimm_core" / "data" / "loaders.py").read_text())
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
    assert sorted(data.LOADERS) == sorted(n for n in defined if not n.startswith("_"))
    with pytest.raises(AttributeError):
        data.no_such_name  # noqa: B018


def test_the_torch_free_parts_of_the_new_packages_stay_torch_free() -> None:
    """``data.global_order`` (read by the resume policy) and ``checkpoint.export.config`` import no torch:
    the packages' ``__init__`` re-export lazily."""
    code = ("import sys, pimm_core.data.global_order, pimm_core.checkpoint.export.config, pimm_core.run.topology, "
            "pimm_core.config; print(sorted(m for m in ('torch', 'pimm_core.data.loaders', "
            "'pimm_core.checkpoint.export.model_dir') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"
