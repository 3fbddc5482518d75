"""The import-layer rule: each module imports only from its own layer or the layers below.

Layers, bottom to top (a module's layer is the longest prefix below that names it):

0. **fsio**: ``errors``, ``faults`` (fault-injection points), ``fsio`` (atomic write,
   directory swap, fsync), ``text`` (user text made safe for a terminal), ``pools`` (the
   shared thread pools, started afresh in a forked child). Standard library only
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
4. **cli**: ``launch``, ``cli``/``cli.*``, ``utils.*``, and the
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
    "pimm_core.pools": (0, "fsio"),
    "pimm_core.run": (1, "run"),
    "pimm_core.process": (1, "run"),
    "pimm_core.config": (1, "run"),
    "pimm_core.targets": (1, "run"),
    "pimm_core.data.global_order": (1, "run"),
    "pimm_core.checkpoint": (2, "checkpoint"),
    "pimm_core.trainer": (3, "train"),
    "pimm_core.train": (3, "train"),
    "pimm_core.data": (3, "train"),
    "pimm_core.data_rng": (3, "train"),  # the old name of data.rng, kept for user code
    "pimm_core.models": (3, "train"),
    "pimm_core.objectives": (3, "train"),
    "pimm_core.optim": (3, "train"),
    "pimm_core.watch": (3, "watch"),
    "pimm_core.launch": (4, "cli"),
    "pimm_core.cli": (4, "cli"),
    "pimm_core.utils": (4, "cli"),
    "pimm": (4, "cli"),
    "pimm_tui": (5, "console"),
}

#: The steps inside ``checkpoint`` (see each subpackage's ``__init__``): a subpackage imports those on a
#: lower step only; siblings on one step do not import each other.
CHECKPOINT_STEPS: dict[str, int] = {
    "records": 0,  # manifest, generation, foreign, outputs, scratch (torch-free)
    "select": 1,   # candidate, selection, verify, resume_path, branch (torch-free)
    "tensors": 1,  # state, ties, safe_read (torch)
    "publish": 2,  # rotation, follow
    "remote": 2,   # candidate, store, upload, choice, source, output (torch-free)
    "memory": 2,   # store (torch-free), exchange: the memory tier's shared memory and buddy copies
    "formats": 3,  # protocol, standard, async_save, files, sharded, weights_file, choose
    "weights": 4,  # sources, hub, read, strict_load, warm_start, key_rules
    "export": 5,   # model_dir, files, config, library_model
}

#: Rules between groups of one layer (importer prefix -> prefixes it never imports), as each package's
#: ``__init__`` states them: the run directory's files are read by the process helpers, not the reverse;
#: the config and the process helpers know nothing of data or checkpoints.
GROUP_RULES: dict[str, tuple[str, ...]] = {
    "pimm_core.run": ("pimm_core.process", "pimm_core.checkpoint"),
    "pimm_core.process": ("pimm_core.config", "pimm_core.data", "pimm_core.run.topology"),
    "pimm_core.config": ("pimm_core.data", "pimm_core.run.topology"),
    "pimm_core.data.global_order": ("pimm_core.config", "pimm_core.process", "pimm_core.run"),
}
#: Inside ``config``: ``module -> the modules of the package it may import``.
CONFIG_RULES: dict[str, tuple[str, ...]] = {
    "pimm_core.config.tables": (),
    "pimm_core.config.schema": ("pimm_core.config.tables",),
    "pimm_core.config.help": (),
    "pimm_core.config.checks": ("pimm_core.config.schema", "pimm_core.config.tables"),
    "pimm_core.config.show": ("pimm_core.config.schema", "pimm_core.config.tables"),
    "pimm_core.config.load": ("pimm_core.config.checks", "pimm_core.config.schema", "pimm_core.config.tables"),
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


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The pimm modules ``module`` imports (anywhere in the file, ``if TYPE_CHECKING:`` included),
    resolved to known module names."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
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


def checkpoint_step(module: str) -> tuple[int, str] | None:
    """``(step, subpackage)`` of a module inside ``pimm_core.checkpoint.<subpackage>``, else None."""
    parts = module.split(".")
    if parts[:2] == ["pimm_core", "checkpoint"] and len(parts) > 2 and parts[2] in CHECKPOINT_STEPS:
        return CHECKPOINT_STEPS[parts[2]], parts[2]
    return None


def checkpoint_step_problem(module: str, target: str) -> bool:
    """``module`` imports a ``checkpoint`` subpackage on its own step (another one) or above it."""
    mine, theirs = checkpoint_step(module), checkpoint_step(target)
    if mine is None or theirs is None or mine[1] == theirs[1]:
        return False
    return theirs[0] >= mine[0]


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
            if (upward or checkpoint_step_problem(module, target)) and not any(
                    (module == a or module.startswith(a + ".")) and (target == b or target.startswith(b + ".")) for a, b in ALLOWED):
                bad.append(f"{module} ({mine[1]}) imports {target} ({theirs[1]})")
    return bad


def cycles() -> list[list[str]]:
    """Groups of modules that import one another, directly or through others (each sorted).

    Imports inside functions count: a lazy import that closes a loop still makes each
    module's import depend on the other's having finished, and hides the loop until that
    function first runs. Imports under ``if TYPE_CHECKING:`` count too: an annotation naming
    the class that calls you is still a module that cannot be read without the other (the
    trainer's parts take the trainer as a :class:`~typing.Protocol` declared below them,
    :class:`pimm_core.train.host.TrainerHost`, not as ``trainer.Trainer``). Importing a
    package's submodule is an edge to the submodule only (Python runs the package's
    ``__init__`` first, but a package whose ``__init__`` imports the submodule back is still
    seen: that import is an edge of its own).
    """
    known = _modules()
    graph = {m: sorted(imports_of(m, p, known)) for m, p in known.items()}
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


def test_the_groups_of_a_layer_keep_their_own_rules() -> None:
    """:data:`GROUP_RULES` and :data:`CONFIG_RULES` (the ``__init__`` docstrings of ``run``, ``process``,
    ``config`` and ``data`` state them)."""
    known = _modules()
    under = lambda m, prefix: m == prefix or m.startswith(prefix + ".")  # noqa: E731
    bad = []
    for module, path in known.items():
        targets = imports_of(module, path, known)
        for prefix, never in GROUP_RULES.items():
            if under(module, prefix) and not (prefix == "pimm_core.run" and module == "pimm_core.run.topology"):
                bad += [f"{module} imports {t}" for t in targets if any(under(t, n) for n in never)]
        if module in CONFIG_RULES:
            bad += [f"{module} imports {t}" for t in targets
                    if under(t, "pimm_core.config") and t not in CONFIG_RULES[module]]
    assert sorted(set(bad)) == []
    assert sorted(m for m in known if m.startswith("pimm_core.config.")) == sorted(CONFIG_RULES)


def test_the_console_views_do_not_import_the_app() -> None:
    """The views talk to the app through messages (``pimm_tui.views.common``), not by calling it."""
    known = _modules()
    views = [m for m in known if m.startswith("pimm_tui.views")]
    assert "pimm_tui.views.checkpoints" in views  # the split this guards is still there
    assert {m: sorted(t for t in imports_of(m, known[m], known) if t == "pimm_tui.app" or t == "pimm_tui")
            for m in views} == {m: [] for m in views}


def _fake_tree(tmp_path: Path, monkeypatch, sources: dict[str, str], packages: tuple[str, ...] = ()) -> None:
    """Make the checks read ``sources`` (module -> its text) instead of the repository."""
    fake = {}
    for module, text in sources.items():
        rel = module.replace(".", "/")
        path = tmp_path / rel / "__init__.py" if module in packages else tmp_path / f"{rel}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        fake[module] = path
    monkeypatch.setitem(globals(), "_modules", lambda: fake)


def test_the_rule_sees_an_upward_import(tmp_path: Path, monkeypatch) -> None:
    """The checker itself: an upward import (run -> trainer), one up a checkpoint step (weights ->
    export) and one to a sibling on the same step (remote -> publish) are reported; one down a step
    (export -> weights) and one inside a subpackage are not."""
    _fake_tree(tmp_path, monkeypatch, {
        "pimm_core.run": "def f():\n    from .trainer import Trainer\n",
        "pimm_core.trainer": "from .run import STATUS\n",
        "pimm_core.checkpoint.weights.read": "from ..export import model_dir\nfrom .sources import y\n",
        "pimm_core.checkpoint.weights.sources": "",
        "pimm_core.checkpoint.export.model_dir": "from ..weights.read import x\n",
        "pimm_core.checkpoint.remote.store": "from ..publish.rotation import publish\n",
        "pimm_core.checkpoint.publish.rotation": "",
    })
    assert sorted(violations()) == [
        "pimm_core.checkpoint.remote.store (checkpoint) imports pimm_core.checkpoint.publish.rotation (checkpoint)",
        "pimm_core.checkpoint.weights.read (checkpoint) imports pimm_core.checkpoint.export.model_dir (checkpoint)",
        "pimm_core.run (run) imports pimm_core.trainer (train)",
    ]


def test_the_cycle_check_sees_lazy_and_type_checking_loops(tmp_path: Path, monkeypatch) -> None:
    """The checker itself: a loop closed by an import inside a function is a cycle (also through a
    package's ``from . import name``), and so is one closed only under ``if TYPE_CHECKING:``."""
    _fake_tree(tmp_path, monkeypatch, {
        "pimm_core.run": "from .trainer import Trainer\n",
        "pimm_core.trainer": "def f():\n    from .run import STATUS\n",
        "pimm_core.process.lock": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .stop import S\n",
        "pimm_core.process.stop": "from .lock import L\nfrom ..text import T\n",
        "pimm_core.text": "",
        "pimm_core.cli": "from . import train\nARGV = []\n",
        "pimm_core.cli.train": "def launch():\n    from . import ARGV\n",
    }, packages=("pimm_core.cli",))
    assert cycles() == [["pimm_core.cli", "pimm_core.cli.train"], ["pimm_core.process.lock", "pimm_core.process.stop"],
                        ["pimm_core.run", "pimm_core.trainer"]]


def test_each_checkpoint_subpackage_has_a_step_and_says_what_it_may_import() -> None:
    """Every subpackage of ``checkpoint`` is on a step, and its ``__init__`` docstring states its rule."""
    root = REPO / "pimm_core" / "checkpoint"
    subpackages = sorted(p.parent.name for p in root.glob("*/__init__.py"))
    assert subpackages == sorted(CHECKPOINT_STEPS)
    for group in [*subpackages, "../config", "../data", "../process"]:
        doc = ast.get_docstring(ast.parse((root / group / "__init__.py").read_text())) or ""
        assert "May import" in doc, group
