"""User code named in a config: ``"package.module:attr"`` targets.

A *target* is the text ``"package.module:attr"`` (``attr`` may be dotted, e.g.
``"pkg.mod:Factory.build"``). pimm imports ``package.module``, looks up ``attr`` and
calls it with the keyword arguments of the target's ``args`` table::

    [model]
    target = "mypkg.models:build"       # mypkg/models.py defines build(width, depth=4)
    [model.args]
    width = 256

Where user code is imported from, first match wins:

1. the working directory pimm was started in,
2. the directory of the config file,
3. everything already on ``sys.path``: installed packages (``pip install -e .``),
   ``PYTHONPATH``.

``pimm resume RUN`` reads the config from the run directory, so it also looks for a
target's module in the directories the run's earlier starts searched (recorded as
``code_search_path`` in ``provenance.json``; :func:`add_search_dirs`), but only for a
module found nowhere above, and only in the one directory that holds it. A record pimm
wrote is data, never code: no directory at or inside a run directory (one holding
``provenance.json`` or ``status.json``, at any level above) is ever searched, neither the
run directory holding a resumed config nor a directory recorded inside it.

So a module next to the config, or in the project pimm runs from, shadows an installed
package of the same name. Ranks started by torchrun run in fresh interpreters: the
launcher puts the same directories on their ``PYTHONPATH`` (:func:`child_env`), so every
rank imports the same code.

Checks before any user code runs (:func:`check_args`): every key of ``args`` must be a
parameter of the target (an unknown one gets a near-miss suggestion) and every required
parameter must be given. A wrong target is one :class:`~pimm_core.errors.ConfigError`
line naming the config key (exit 2), e.g.
``model.target = "pkg.mod:fn": module 'pkg.mod' not found``. An exception raised *inside*
user code (while importing the module or calling the target) propagates unchanged, with
the user's own traceback.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .errors import ConfigError

#: ``package.module:attr`` with identifiers on both sides (attr may be dotted).
TARGET_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def is_target(text: str) -> bool:
    """True when ``text`` has the ``package.module:attr`` form (nothing is imported)."""
    return bool(TARGET_RE.match(text))


@dataclass(frozen=True)
class TargetSpec:
    """A target as a config names it.

    Attributes:
        key: the config key that names it, for messages (``"model.target"``).
        target: ``"package.module:attr"``.
        args: keyword arguments (the ``args`` table); never modified.
        args_key: the config key of the args table (``"model.args"``); empty when the
            target has none (``objective``, ``train.blocks``): it is called with pimm's
            positional arguments only.
    """

    key: str
    target: str
    args: Mapping[str, Any] = field(default_factory=dict)
    args_key: str = ""

    def label(self) -> str:
        """``model.target = "pkg.mod:fn"``: how messages name this target."""
        return f'{self.key} = "{self.target}"'


def search_path(config_path: str | Path | None = None) -> list[str]:
    """The directories user code is imported from before ``sys.path``, in order.

    Args:
        config_path: the config file (or ``None``: no config directory).

    Returns:
        Absolute paths: the working directory, then the config file's directory
        (once, if it differs).
    """
    dirs = [os.path.abspath(os.getcwd())]
    if config_path is not None:
        d = os.path.dirname(os.path.abspath(os.fspath(config_path)))
        if d not in dirs:
            dirs.append(d)
    return [d for d in dirs if not in_run_record(d)]


#: Files only a pimm run directory holds: a directory with one of them (or under one) is data.
_RECORD_FILES = ("provenance.json", "status.json")
_RECORDS: list[Path] = []


def mark_run_record(run_dir: str | Path) -> None:
    """Treat ``run_dir`` as a run directory whatever files it holds (``pimm resume RUN``: a
    run directory whose record files were removed is still no place for code)."""
    _RECORDS.append(Path(os.path.abspath(os.fspath(run_dir))))


def in_run_record(d: str | Path) -> bool:
    """True when ``d`` is a pimm run directory or lies inside one (it, or a directory above
    it, holds ``provenance.json`` or ``status.json``, or was given to :func:`mark_run_record`):
    pimm's record, never searched for code."""
    p = Path(os.path.abspath(os.fspath(d)))
    return any(q in _RECORDS or any((q / name).is_file() for name in _RECORD_FILES) for q in (p, *p.parents))


def install_search_path(config_path: str | Path | None = None) -> None:
    """Put :func:`search_path` at the front of this process's ``sys.path`` (idempotent)."""
    for d in reversed(search_path(config_path)):
        if d in sys.path:
            sys.path.remove(d)
        sys.path.insert(0, d)
    importlib.invalidate_caches()


_FALLBACK: list[str] = []


def add_search_dirs(dirs: Iterable[str]) -> None:
    """Directories (``pimm resume``: those the run's earlier starts searched, from
    ``provenance.json``) where :func:`resolve` looks for a target's module that is found
    nowhere else. Nothing is put on ``sys.path`` here: only the directory holding such a
    module is, when that target is resolved. Directories that do not exist or are in a run
    directory (:func:`in_run_record`) are dropped. The ranks of ``pimm resume`` read the same
    record themselves."""
    for d in dirs:
        if isinstance(d, str) and os.path.isabs(d) and os.path.isdir(d) and not in_run_record(d) \
                and d not in _FALLBACK:
            _FALLBACK.append(d)


def _import_recorded(module_name: str) -> Any:
    """Import ``module_name`` from the first :func:`add_search_dirs` directory holding its
    top-level package or module (that directory is put on ``sys.path``), or None."""
    top = module_name.split(".")[0]
    for d in _FALLBACK:
        if os.path.isdir(os.path.join(d, top)) or os.path.isfile(os.path.join(d, top + ".py")):
            if d not in sys.path:
                sys.path.append(d)
                importlib.invalidate_caches()
            return importlib.import_module(module_name)
    return None


def child_env(config_path: str | Path | None = None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment for rank processes that import user code like this one does.

    Args:
        config_path: the config file.
        env: the base environment (default: ``os.environ``).

    Returns:
        A copy of ``env`` whose ``PYTHONPATH`` starts with :func:`search_path`, the
        directories already in it kept after (without repeats).
    """
    out = dict(os.environ if env is None else env)
    old = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    dirs = search_path(config_path)
    out["PYTHONPATH"] = os.pathsep.join(dirs + [p for p in old if p not in dirs])
    return out


def _near(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _missing_module(e: ModuleNotFoundError, module: str) -> bool:
    """The target's module itself (or a parent package) is missing, not something it imports."""
    return e.name is not None and (module == e.name or module.startswith(e.name + "."))


def resolve(spec: TargetSpec, config_path: str | Path | None = None) -> Any:
    """Import ``spec.target`` and return the object it names (not called).

    Args:
        spec: the target and the key naming it.
        config_path: the config file; its directory is searched (see the module docstring).

    Raises:
        ConfigError: malformed target, module not found, attribute missing.
        Exception: whatever the user's module raises while it is imported, unchanged
            (including a ``ModuleNotFoundError`` for a package *it* imports).
    """
    if not is_target(spec.target):
        raise ConfigError(f"{spec.label()}: not a target; write 'package.module:attr'")
    module_name, attr = spec.target.split(":")
    install_search_path(config_path)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if not _missing_module(e, module_name):
            raise
        obj = _import_recorded(module_name)
    if obj is None:
        where = ", ".join(search_path(config_path) + _FALLBACK)
        raise ConfigError(f"{spec.label()}: module {module_name!r} not found (searched {where} and the "
                          "installed packages)") from None
    path = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise ConfigError(f"{spec.label()}: {path!r} has no attribute {part!r}{_near(part, names)}")
        obj, path = getattr(obj, part), f"{path}.{part}"
    return obj


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C extensions have none
        return None


def check_args(spec: TargetSpec, fn: Callable, *, provided: Iterable[str] = (), positional: int = 0) -> None:
    """Check ``spec.args`` against ``fn``'s signature without calling it.

    Args:
        spec: the target; its ``args`` are checked.
        fn: the resolved callable.
        provided: keyword names pimm passes itself (they may not be in ``args``).
        positional: how many leading positional arguments pimm passes (e.g. the
            optimizer's parameter groups); those parameters are neither required nor allowed
            in ``args``.

    Raises:
        ConfigError: ``fn`` is not callable; an ``args`` key ``fn`` does not take (with a
            near-miss suggestion) or one pimm sets itself; a required parameter missing.
            A callable without an inspectable signature is not checked.
    """
    if not callable(fn):
        raise ConfigError(f"{spec.label()}: {type(fn).__name__} object is not callable")
    sig = _signature(fn)
    if sig is None:
        return
    params = list(sig.parameters.values())
    taken = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:positional]
    rest = [p for p in params if p not in taken]
    if len(taken) < positional and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ConfigError(f"{spec.label()}: takes {len(taken)} positional arguments; pimm passes {positional}")
    provided = set(provided)
    args_key = spec.args_key or spec.key
    if not spec.args_key:  # no args table: only pimm's positional arguments are passed
        required = [p.name for p in rest if p.default is p.empty and p.name not in provided
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)]
        if required:
            raise ConfigError(f"{spec.label()}: parameter {required[0]!r} has no default, but pimm calls it with "
                              f"{positional} positional argument(s) only ({spec.key} has no args table); "
                              f"give {required[0]!r} a default or name a function of {positional} argument(s)")
    keyword_ok = {p.name for p in rest if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    for name in spec.args:
        if name in provided or any(p.name == name for p in taken):
            raise ConfigError(f"{args_key}.{name}: pimm sets {name!r} itself; remove it from [{args_key}]")
        if name not in keyword_ok and not takes_any:
            hint = _near(name, sorted(keyword_ok - provided))
            raise ConfigError(f"{args_key}.{name}: {spec.target} has no parameter {name!r}{hint}")
    for p in rest:
        if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind is p.POSITIONAL_ONLY:
            raise ConfigError(f"{spec.label()}: parameter {p.name!r} is positional-only; pimm passes keyword arguments")
        if p.name not in spec.args and p.name not in provided:
            raise ConfigError(f"{args_key}: {spec.target} needs {p.name!r}; set {args_key}.{p.name}")


def accepts(fn: Callable, name: str) -> bool:
    """True when ``fn`` can be called with keyword ``name`` (a parameter of that name, or
    ``**kwargs``; also when its signature cannot be inspected)."""
    sig = _signature(fn)
    if sig is None:
        return True
    return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
               for p in sig.parameters.values())


def load(spec: TargetSpec, config_path: str | Path | None = None, *, provided: Iterable[str] = (),
         positional: int = 0) -> Callable:
    """:func:`resolve` then :func:`check_args`: the checked callable, not yet called."""
    fn = resolve(spec, config_path)
    check_args(spec, fn, provided=provided, positional=positional)
    return fn


def call(spec: TargetSpec, *pos: Any, config_path: str | Path | None = None, **provided: Any) -> Any:
    """Resolve, check and call ``spec.target(*pos, **provided, **spec.args)``.

    Args:
        spec: the target and its args.
        *pos: positional arguments pimm passes first.
        config_path: the config file (its directory is searched).
        **provided: keyword arguments pimm passes itself.

    Returns:
        Whatever the target returns.

    Raises:
        ConfigError: as :func:`resolve` and :func:`check_args`.
        Exception: anything the user's code raises, unchanged.
    """
    fn = load(spec, config_path, provided=provided, positional=len(pos))
    return fn(*pos, **provided, **dict(spec.args))
