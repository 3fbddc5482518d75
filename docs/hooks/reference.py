"""MkDocs hook: the reference tables, generated from the code at every build so they cannot drift.

A page asks for a table with a marker line; the hook replaces it with Markdown made from:

- ``<!-- pimm:config-keys -->``: every key of the config schema (:class:`pimm_core.config.Config`,
  the same walk as ``pimm config show``), its type, default and allowed range
  (:data:`pimm_core.config.checks.RANGES`), and its meaning (:data:`pimm_core.config.help.KEY_HELP`);
- ``<!-- pimm:cli -->``: every command of the Typer app (:data:`pimm_core.cli.app`), its usage line
  and each flag and argument with its help, as ``pimm <command> --help`` prints them;
- ``<!-- pimm:resume-policy -->``: the resume policy's rows (:data:`pimm_core.run.topology.ROWS`) in the
  order :func:`pimm_core.run.topology.plan_resume` checks them, each with what that function decides
  (loader cursor, per-rank RNG, exactness) for a checkpoint saved mid-epoch;
- ``<!-- pimm:console-keys -->``: the console's key bindings (``pimm_tui.app.PimmConsole.BINDINGS``).
- ``<!-- pimm:runs-keys -->``: the runs view's and the compare view's bindings (``RunsScreen``, ``CompareScreen``).

The functions are importable on their own (``tests/unit/test_docs.py`` uses them), torch-free.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import re
import types
import typing
from typing import Any, Literal

MARKER = re.compile(r"^<!-- pimm:([a-z-]+) -->$", re.M)


def _cell(text: Any) -> str:
    """``text`` (Markdown) for one table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _plain(text: Any) -> str:
    """Plain ``text`` (a help line, not Markdown) for one table cell: ``<step>`` and ``*`` shown as written."""
    return _cell(html.escape(str(text), quote=False).replace("*", "\\*").replace("`", "\\`"))


# ---- config keys -------------------------------------------------------------------------------

def _type(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return " \\| ".join(f'`"{a}"`' for a in args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_type(a) for a in inner) + (" (optional)" if len(inner) < len(args) else "")
    if origin is list:
        if args and dataclasses.is_dataclass(args[0]):
            return "array of tables"
        return f"list of {_type(args[0])}" if args else "list"
    if origin is dict:
        return "table"
    if dataclasses.is_dataclass(hint):
        return "table"
    return {int: "integer", float: "float", bool: "boolean", str: "string"}.get(hint, str(hint))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return ""
    if value is None:
        return "unset"
    if dataclasses.is_dataclass(value):
        return ""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, list):
        return "`[" + ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in value) + "]`" if value else "`[]`"
    return f"`{value}`"


def config_rows() -> list[tuple[str, str, str, str, str]]:
    """``(dotted key, type, default, range, meaning)`` for every key of the schema, in its order.

    The keys of ``[log.mlflow]`` (an optional table) and ``[[callbacks]]`` (an array of tables)
    follow their table's own row, as ``log.mlflow.tracking_uri`` and ``callbacks.target``.
    """
    from pimm_core.config import Config
    from pimm_core.config.checks import RANGES
    from pimm_core.config.help import KEY_HELP
    from pimm_core.config.tables import toml_key

    rows: list[tuple[str, str, str, str, str]] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint, key = hints[f.name], prefix + toml_key(f.name)
            if dataclasses.is_dataclass(hint):
                walk(hint, key + ".")
                continue
            lo_hi = RANGES.get(key)
            rng = "" if lo_hi is None else (f">= {lo_hi[0]}" if lo_hi[1] is None else f"{lo_hi[0]} to {lo_hi[1]}")
            rows.append((key, _type(hint), _default(f), rng, KEY_HELP.get(key, "")))
            inner = [a for a in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(a)]
            for sub in inner:  # [log.mlflow] (optional) and [[callbacks]] (list of tables)
                walk(sub, key + ".")

    walk(Config, "")
    return rows


def config_keys_md() -> str:
    out = ["| key | type | default | range | meaning |", "|---|---|---|---|---|"]
    for key, typ, default, rng, meaning in config_rows():
        out.append(f"| `{key}` | {typ} | {default} | {rng} | {_cell(meaning)} |")
    return "\n".join(out)


# ---- commands ----------------------------------------------------------------------------------

def _commands() -> list[tuple[str, Any]]:
    """``("pimm launch", command)`` for the root and every leaf command of the Typer app, in ``--help`` order."""
    import typer.main

    from pimm_core.cli import app

    out: list[tuple[str, Any]] = []

    def walk(cmd: Any, name: str) -> None:
        subs = getattr(cmd, "commands", None)
        if subs:
            for sub_name, sub in subs.items():
                walk(sub, f"{name} {sub_name}")
        else:
            out.append((name, cmd))

    root = typer.main.get_command(app)
    out.append(("pimm", root))  # its own options (--version)
    walk(root, "pimm")
    return out


def cli_rows() -> list[tuple[str, str, str, list[tuple[str, str]]]]:
    """``(command, its help, usage line, [(flag or argument, help)])`` for every command."""
    import typer

    rows = []
    for name, cmd in _commands():
        ctx = typer.Context(cmd, info_name=name)
        usage = cmd.get_usage(ctx).removeprefix("Usage: ").strip()
        params = []
        for p in cmd.params:
            if p.param_type_name == "argument":
                label = (p.metavar or p.name or "").upper() + ("..." if p.nargs != 1 else "")
                params.append((label, p.help or ""))
            else:
                record = p.get_help_record(ctx)
                if record:
                    params.append(record)
        rows.append((name, (cmd.help or "").strip(), usage, params))
    return rows


def cli_md() -> str:
    out = []
    for name, help_text, usage, params in cli_rows():
        out += [f"### `{name}`", "", _plain(help_text), "", f"    {usage}", ""]
        if params:
            out += ["| flag or argument | meaning |", "|---|---|"]
            out += [f"| `{_cell(flag)}` | {_plain(text)} |" for flag, text in params]
            out.append("")
    return "\n".join(out)


# ---- resume policy -----------------------------------------------------------------------------

#: For each row of the policy, the change (a saved manifest and planned arguments) that triggers it.
#: Every checkpoint here is saved mid-epoch (``iter`` > 0), where the rows differ.
_BASE = {"step": 10, "epoch": 1, "iter": 5, "epoch_start_step": 5, "world_size": 2, "strategy": "ddp",
         "workers_per_rank": 0, "batch_size": 32, "grad_accum": 1, "has_loader_state": True, "data_length": 100}
_TRIGGERS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "legacy": ({}, {"legacy": True}),
    "non_strict": ({}, {"strict": False}),
    "optimizer": ({}, {"optimizer_changed": True}),
    "world_size": ({"world_size": 4}, {}),
    "batch_size": ({"batch_size": 16}, {}),
    "grad_accum": ({"grad_accum": 2}, {}),
    "workers": ({"workers_per_rank": 2}, {}),
    "data": ({"data_length": 90}, {}),
    "no_loader_state": ({"has_loader_state": False}, {}),
    "strategy": ({"strategy": "fsdp"}, {}),
    "layout": ({"tp": 2}, {"world_size": 1}),  # tp 2 x dp 1 -> tp 1 x dp 1
    "global_order": ({"data_order": "global", "global_batch": 128, "world_size": 4}, {"order": "global", "global_batch": 128}),
    "order": ({}, {"order": "global", "global_batch": 128}),
    "same": ({}, {}),
}


# Rows whose condition excludes some later rows' changes: the global order's row needs the same
# micro-batch size and data, so with another batch size its condition fails and the next row that
# applies (the world size) is picked.
CONDITIONAL = frozenset({"global_order"})


def _plan(*rows: str) -> Any:
    from pimm_core.run.topology import plan_resume

    manifest, args = dict(_BASE), {"world_size": 2, "strategy": "ddp", "workers_per_rank": 0, "strict": True,
                                   "grad_accum": 1, "batch_size": 32, "data_length": 100}
    for row in rows:
        m, a = _TRIGGERS[row]
        manifest.update(m)
        args.update(a)
    return plan_resume(manifest, **args)


@functools.cache
def policy_order() -> tuple[str, ...]:
    """The rows in the order :func:`~pimm_core.run.topology.plan_resume` checks them: a row comes before
    another when a resume that meets both conditions gets it (asked of the function itself)."""
    from pimm_core.run.topology import ROWS

    missing = set(ROWS) - set(_TRIGGERS)
    if missing:
        raise KeyError(f"no trigger for resume-policy rows {sorted(missing)}: add one to _TRIGGERS in {__file__}")

    def before(a: str, b: str) -> int:
        picked = _plan(a, b).row
        if picked not in (a, b):  # a conditional row whose condition b's change breaks: it is checked first
            return -1 if a in CONDITIONAL else 1
        return -1 if picked == a else 1

    return tuple(sorted(ROWS, key=functools.cmp_to_key(before)))


def policy_rows() -> list[tuple[str, str, str, str, str, str]]:
    """``(row key, condition, behaviour, loader cursor, per-rank RNG, exact)`` in checking order."""
    from pimm_core.run.topology import ROWS

    out = []
    for row in policy_order():
        plan = _plan(row)
        assert plan.row == row, f"trigger of {row!r} gives {plan.row!r}"
        condition, _, behaviour = ROWS[row].partition(": ")
        cursor = "restored" if plan.restore_cursor else "discarded"
        rng = "restored" if plan.restore_rng else "discarded"
        if row == "optimizer":  # a refusal: nothing is loaded
            cursor = rng = "not loaded (refused)"
        if any(r.startswith("loader cursor (samples consumed") for r in plan.restored):
            # the global order: the position is the samples consumed, the randomness rank-free streams
            cursor, rng = "kept as samples consumed", "drawn per (step, micro-batch), not per rank"
        out.append((row, condition, behaviour, cursor, rng, "yes" if plan.exact else "no"))
    return out


def resume_policy_md() -> str:
    out = ["| # | condition (checked in this order) | behaviour | loader cursor | per-rank RNG | bitwise exact |",
           "|---|---|---|---|---|---|"]
    for i, (_, condition, behaviour, cursor, rng, exact) in enumerate(policy_rows(), 1):
        out.append(f"| {i} | {_plain(condition)} | {_plain(behaviour)} | {cursor} | {rng} | {exact} |")
    return "\n".join(out)


# ---- console keys ------------------------------------------------------------------------------

def console_rows() -> list[tuple[str, str, str]]:
    """``(key, footer label, action)`` for each of the console's bindings (``PimmConsole.BINDINGS``)."""
    from pimm_tui.app import PimmConsole

    return [(b.key, b.description, b.action) for b in PimmConsole.BINDINGS]


def console_keys_md() -> str:
    out = ["| key | footer label | action |", "|---|---|---|"]
    out += [f"| `{_cell(key)}` | {_plain(label)} | `{_cell(action)}` |" for key, label, action in console_rows()]
    return "\n".join(out)


def runs_view_rows() -> list[tuple[str, str, str, str]]:
    """``(view, key, footer label, action)`` for the runs view's and the compare view's bindings
    (``RunsScreen.BINDINGS``, ``CompareScreen.BINDINGS``)."""
    from pimm_tui.views.compare import CompareScreen
    from pimm_tui.views.runs import RunsScreen

    return [(view, b.key, b.description, b.action)
            for view, screen in (("runs", RunsScreen), ("compare", CompareScreen)) for b in screen.BINDINGS]


def runs_keys_md() -> str:
    out = ["| view | key | footer label | action |", "|---|---|---|---|"]
    out += [f"| {view} | `{_cell(key)}` | {_plain(label)} | `{_cell(action)}` |"
            for view, key, label, action in runs_view_rows()]
    return "\n".join(out)


GENERATORS = {
    "config-keys": config_keys_md,
    "cli": cli_md,
    "resume-policy": resume_policy_md,
    "console-keys": console_keys_md,
    "runs-keys": runs_keys_md,
}


def expand(markdown: str) -> str:
    """``markdown`` with each marker line replaced by its generated table."""

    def one(m: re.Match[str]) -> str:
        if m.group(1) not in GENERATORS:
            raise KeyError(f"unknown generated table {m.group(1)!r}; known: {sorted(GENERATORS)}")
        return GENERATORS[m.group(1)]()

    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:  # MkDocs hook
    return expand(markdown)
