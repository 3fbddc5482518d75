"""The import-layer rule: each module imports only from its own layer or the layers below.

Layers, bottom to top (a module's layer is the longest prefix below that names it):

0. **fsio**: ``errors``, ``faults`` (fault-injection points), ``fsio`` (atomic write,
   directory swap, fsync), ``text`` (user text made safe for a terminal). Standard library only
   (``text`` builds ``rich.text.Text`` objects when asked).
1. **run**: the run directory and the process it runs in: ``run.*`` (layout, status,
   metrics, log, provenance), ``lock``, ``stop``, ``shell``, ``console_log``, ``config``,
   ``config_tables``, ``config_checks``, ``config_help`` (each key's meaning, for the docs), ``targets`` (finding user code a config names), ``topology``, ``global_order`` (the
   world-size-free batching the resume policy reads; torch imported lazily), ``threads`` (the intra-op threads
   of the process: the trainer chooses them, the launcher tells the ranks whose ``OMP_NUM_THREADS`` it is), and ``dist`` (the process group; the checkpoint formats and the
   stop agreement both need it, and it imports nothing of pimm's).
2. **checkpoint**: ``checkpoint.*``. Inside it nothing imports ``checkpoint.export``
   (export sits on top: it reads weight sets (``weights``), renames keys (``key_rules``),
   writes files (``export_formats``) and sanitizes the config (``export_config``); none of
   them, nor the trainer's ``save_model``, needs the export directory itself).
3. **train** (``trainer``, ``train.*``, ``schedule``, ``ema``, ``data``, ``models``,
   ``objectives``, ``optim``, ``data_rng``, ``plugins``)
   and **watch** (``watch.*``: what the console and ``checkpoints diff`` read), two
   independent siblings: neither imports the other.
4. **cli**: ``launch``, ``cli``/``cli.*``, ``cli_export``, ``utils.*``, and the
   ``pimm`` alias package.
5. **console**: ``pimm_tui``. Inside it the views (``pimm_tui.views.*``) never import
   the app (``pimm_tui.app``): they post messages (``views.common``) that the app handles.

Every import counts, including ones inside functions (a lazy import is still a
dependency); :data:`ALLOWED` lists the few upward ones that are the point of their
module, each with its reason. Across all of it, no module imports itself back through
others (:func:`cycles`). ``import pimm_core`` alone (the package's lazy
``__getattr__``) is not a dependency on any layer. The run-time checks that the
scripting commands do not import torch and ``pimm_core`` does not import Textual are
in ``test_checkpoints_cli.py`` and ``test_tui_cli.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pimm_core", "pimm_tui", "pimm")

#: (layer rank, layer name); siblings share a rank but may not import each other.
LAYERS: dict[str, tuple[int, str]] = {
    "pimm_core.errors": (0, "fsio"),
    "pimm_core.faults": (0, "fsio"),
    "pimm_core.fsio": (0, "fsio"),
    "pimm_core.text": (0, "fsio"),
    "pimm_core.run": (1, "run"),
    "pimm_core.lock": (1, "run"),
    "pimm_core.stop": (1, "run"),
    "pimm_core.time_limit": (1, "run"),
    "pimm_core.shell": (1, "run"),
    "pimm_core.console_log": (1, "run"),
    "pimm_core.config": (1, "run"),
    "pimm_core.config_tables": (1, "run"),
    "pimm_core.config_checks": (1, "run"),
    "pimm_core.config_show": (1, "run"),
    "pimm_core.config_help": (1, "run"),
    "pimm_core.targets": (1, "run"),
    "pimm_core.topology": (1, "run"),
    "pimm_core.global_order": (1, "run"),
    "pimm_core.dist": (1, "run"),
    "pimm_core.threads": (1, "run"),
    "pimm_core.checkpoint": (2, "checkpoint"),
    "pimm_core.trainer": (3, "train"),
    "pimm_core.train": (3, "train"),
    "pimm_core.schedule": (3, "train"),
    "pimm_core.ema": (3, "train"),
    "pimm_core.data": (3, "train"),
    "pimm_core.loader_workers": (3, "train"),
    "pimm_core.models": (3, "train"),
    "pimm_core.objectives": (3, "train"),
    "pimm_core.optim": (3, "train"),
    "pimm_core.data_rng": (3, "train"),
    "pimm_core.plugins": (3, "train"),
    "pimm_core.watch": (3, "watch"),
    "pimm_core.launch": (4, "cli"),
    "pimm_core.cli": (4, "cli"),
    "pimm_core.cli_export": (4, "cli"),
    "pimm_core.utils": (4, "cli"),
    "pimm": (4, "cli"),
    "pimm_tui": (5, "console"),
}

#: Upward imports that are the point of their module: (importer prefix, imported prefix) -> why.
ALLOWED: dict[tuple[str, str], str] = {
    ("pimm_core.cli", "pimm_tui"): "`pimm tui` starts the console (imported only when that command runs)",
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def layer_of(module: str) -> tuple[int, str] | None:
    best = None
    for prefix, layer in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, layer)
    return best[1] if best else None


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (never run: annotations only)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports_of(module: str, path: Path, known: dict[str, Path], *, run_time_only: bool = False) -> set[str]:
    """The pimm modules ``module`` imports (anywhere in the file), resolved to known module names.

    With ``run_time_only``, imports under ``if TYPE_CHECKING:`` are left out.
    """
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree) if run_time_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in known else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known and m != module and m not in PACKAGES[:1]}


def violations() -> list[str]:
    known = _modules()
    bad = []
    for module, path in known.items():
        if module in PACKAGES:  # the packages' own __init__: lazy re-exports of the public API
            continue
        mine = layer_of(module)
        if mine is None:
            bad.append(f"{module}: no layer; add it to LAYERS in tests/unit/test_layers.py")
            continue
        for target in sorted(imports_of(module, path, known)):
            theirs = layer_of(target)
            if theirs is None:
                continue  # reported as its own module above
            upward = theirs[0] > mine[0] or (theirs[0] == mine[0] and theirs[1] != mine[1])
            back_to_export = (target == "pimm_core.checkpoint.export" and mine[1] == "checkpoint"
                              and module != target)
            if (upward or back_to_export) and not any(
                    (module == a or module.startswith(a + ".")) and (target == b or target.startswith(b + ".")) for a, b in ALLOWED):
                bad.append(f"{module} ({mine[1]}) imports {target} ({theirs[1]})")
    return bad


def cycles() -> list[list[str]]:
    """Groups of modules that import one another, directly or through others (each sorted).

    Imports inside functions count: a lazy import that closes a loop still makes each
    module's import depend on the other's having finished, and hides the loop until that
    function first runs. Imports under ``if TYPE_CHECKING:`` do not: they never run
    (``from __future__ import annotations`` keeps the annotations unevaluated), and naming
    the class that calls you in an annotation is no dependency (``train.resume`` on
    ``trainer.Trainer``). Importing a package's submodule is an edge to the submodule only
    (Python runs the package's ``__init__`` first, but a package whose ``__init__`` imports
    the submodule back is still seen: that import is an edge of its own).
    """
    known = _modules()
    graph = {m: sorted(imports_of(m, p, known, run_time_only=True)) for m, p in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_module_imports_only_its_layer_or_below() -> None:
    assert violations() == []


def test_no_import_cycles() -> None:
    assert cycles() == []


def test_the_console_views_do_not_import_the_app() -> None:
    """The views talk to the app through messages (``pimm_tui.views.common``), not by calling it."""
    known = _modules()
    views = [m for m in known if m.startswith("pimm_tui.views")]
    assert "pimm_tui.views.checkpoints" in views  # the split this guards is still there
    assert {m: sorted(t for t in imports_of(m, known[m], known) if t == "pimm_tui.app" or t == "pimm_tui")
            for m in views} == {m: [] for m in views}


def test_the_rule_sees_an_upward_import(tmp_path: Path, monkeypatch) -> None:
    """The checker itself: an upward import (run -> trainer) and one back to export are reported."""
    fake = {"pimm_core.run": tmp_path / "run.py", "pimm_core.trainer": tmp_path / "trainer.py",
            "pimm_core.checkpoint.weights": tmp_path / "weights.py",
            "pimm_core.checkpoint.export": tmp_path / "export.py"}
    fake["pimm_core.run"].write_text("def f():\n    from .trainer import Trainer\n")
    fake["pimm_core.trainer"].write_text("from .run import STATUS\n")
    fake["pimm_core.checkpoint.weights"].write_text("from . import export\n")
    fake["pimm_core.checkpoint.export"].write_text("from .weights import x\n")
    monkeypatch.setitem(globals(), "_modules", lambda: fake)
    assert sorted(violations()) == [
        "pimm_core.checkpoint.weights (checkpoint) imports pimm_core.checkpoint.export (checkpoint)",
        "pimm_core.run (run) imports pimm_core.trainer (train)",
    ]


def test_the_cycle_check_sees_a_lazy_loop_and_not_a_type_checking_one(tmp_path: Path, monkeypatch) -> None:
    """The checker itself: a loop closed by an import inside a function is a cycle (also through a
    package's ``from . import name``); one closed only under ``if TYPE_CHECKING:`` is not."""
    names = {"pimm_core.run": "run.py", "pimm_core.trainer": "trainer.py", "pimm_core.lock": "lock.py",
             "pimm_core.stop": "stop.py", "pimm_core.cli": "cli/__init__.py", "pimm_core.cli.train": "cli/train.py"}
    fake = {m: tmp_path / f for m, f in names.items()}
    (tmp_path / "cli").mkdir()
    fake["pimm_core.run"].write_text("from .trainer import Trainer\n")
    fake["pimm_core.trainer"].write_text("def f():\n    from .run import STATUS\n")
    fake["pimm_core.lock"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .stop import S\n")
    fake["pimm_core.stop"].write_text("from .lock import L\n")
    fake["pimm_core.cli"].write_text("from . import train\nARGV = []\n")
    fake["pimm_core.cli.train"].write_text("def launch():\n    from . import ARGV\n")
    monkeypatch.setitem(globals(), "_modules", lambda: fake)
    assert cycles() == [["pimm_core.cli", "pimm_core.cli.train"], ["pimm_core.run", "pimm_core.trainer"]]
