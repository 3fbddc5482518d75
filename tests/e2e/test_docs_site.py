"""The documentation site: it builds strictly, and its generated reference covers the code.

The site (``mkdocs.yml``, ``docs/``) is built once per session with ``mkdocs build --strict`` (a broken
link, a missing anchor or a nav entry without its page fails it). The reference pages are generated
from the code at build time (``docs/hooks/reference.py``); these tests read the built HTML and check
it against the code itself, walked here independently of the generator: every key of the config
schema, every command and flag of the Typer app, every row of the resume policy in the order the
policy applies them, every key binding of the console. mkdocs is in the ``docs`` dependency group,
which ``uv sync`` installs; without it the tests skip, except under ``CI=true`` where they fail.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "docs" / "hooks" / "reference.py"


def _hook():
    spec = importlib.util.spec_from_file_location("pimm_docs_reference", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text(page: Path) -> str:
    """A built page's text: tags removed, entities decoded, whitespace collapsed."""
    raw = re.sub(r"</?(code|a|em|strong)\b[^>]*>", "", page.read_text(encoding="utf-8"))  # inline: no gap
    raw = re.sub(r"<[^>]+>", " ", raw)
    return " ".join(html.unescape(raw).split())


def _codes(page: Path) -> set[str]:
    """Every ``<code>`` span's text of a built page."""
    return {html.unescape(c) for c in re.findall(r"<code>(.*?)</code>", page.read_text(encoding="utf-8"), re.S)}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        why = "mkdocs and mkdocs-material are not installed (the docs dependency group: uv sync --group docs)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                        "-d", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    return out


def test_site_builds_strictly_with_every_nav_page(site: Path) -> None:
    import yaml

    cfg = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    assert cfg["strict"] is True

    def pages(entry) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, list):
            return [p for e in entry for p in pages(e)]
        return [p for v in entry.values() for p in pages(v)]

    nav = pages(cfg["nav"])
    assert "getting-started.md" in nav and "reference/config.md" in nav
    for page in nav:
        built = site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert built.is_file(), f"{page} is in the nav but was not built"


def test_every_config_key_is_in_the_reference_with_a_meaning(site: Path) -> None:
    from pimm_core.config import Config
    from pimm_core.config.help import KEY_HELP
    from pimm_core.config.tables import all_keys

    codes = _codes(site / "reference" / "config" / "index.html")
    keys = all_keys(Config)  # the schema's own walk (what a config may set)
    assert len(keys) > 50
    missing = [k for k in keys if k not in codes]
    assert not missing, f"config keys missing from the reference page: {missing}"
    no_meaning = [k for k in keys if not KEY_HELP.get(k)]
    assert not no_meaning, f"config keys without a meaning: add a line for each to pimm_core/config/help.py: {no_meaning}"
    text = _text(site / "reference" / "config" / "index.html")
    for key in keys:
        assert " ".join(KEY_HELP[key].replace("`", "").split()) in text.replace("`", ""), key


def test_every_command_and_flag_is_in_the_reference(site: Path) -> None:
    import typer.main

    from pimm_core.cli import app

    page = site / "reference" / "cli" / "index.html"
    text, codes = _text(page), _codes(page)
    commands: list[tuple[str, object]] = []

    def walk(cmd, name: str) -> None:
        commands.append((name, cmd))
        for sub_name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, f"{name} {sub_name}")

    walk(typer.main.get_command(app), "pimm")
    leaves = [name for name, cmd in commands if not getattr(cmd, "commands", None)]
    assert {"pimm launch", "pimm resume", "pimm stop", "pimm tui", "pimm export", "pimm checkpoints ls",
            "pimm runs ls", "pimm config show"} <= set(leaves)
    for name in leaves:
        assert name in codes, f"command {name!r} missing from the reference"
    for name, cmd in commands:
        for p in cmd.params:
            if p.param_type_name == "option":
                for opt in p.opts:
                    assert any(c == opt or c.startswith(opt + " ") for c in codes), f"{name}: flag {opt} missing"
            else:
                assert (p.name or "").upper() in text, f"{name}: argument {p.name} missing"
            if getattr(p, "help", None):
                assert " ".join(p.help.split()) in text, f"{name}: help of {p.name} missing"


def test_every_resume_policy_row_is_in_the_reference_in_the_order_it_applies(site: Path) -> None:
    from pimm_core.run.topology import ROWS

    hook = _hook()
    text = _text(site / "reference" / "resume-policy" / "index.html")
    positions = []
    for key, description in ROWS.items():
        condition = description.partition(": ")[0]
        assert condition in text, f"resume-policy row {key!r} missing from the reference"
        positions.append((text.index(condition), key))
    shown = [key for _, key in sorted(positions)]
    # Shown first is the row the code picks when both conditions hold (asked of plan_resume itself).
    for i, a in enumerate(shown):
        for b in shown[i + 1:]:
            picked = hook._plan(a, b).row
            if a in hook.CONDITIONAL:  # its condition may fail with b's change: then a row shown before b applies
                assert shown.index(picked) < shown.index(b), f"the page shows {a!r} before {b!r}, but plan_resume picks {picked!r}"
            else:
                assert picked == a, f"the page shows {a!r} before {b!r}, but plan_resume picks {picked!r}"
    # And the stop-resume guide carries the same generated table.
    guide = _text(site / "stop-resume" / "index.html")
    assert all(d.partition(": ")[0] in guide for d in ROWS.values())


def test_every_console_key_is_in_the_console_page(site: Path) -> None:
    from pimm_tui.app import PimmConsole

    codes = _codes(site / "console-guide" / "index.html")
    for binding in PimmConsole.BINDINGS:
        assert binding.key in codes, f"console key {binding.key!r} missing from the console page"


def test_every_runs_view_and_compare_key_is_in_the_many_runs_page(site: Path) -> None:
    from pimm_tui.views.compare import CompareScreen
    from pimm_tui.views.runs import RunsScreen

    codes = _codes(site / "console" / "index.html")
    for screen in (RunsScreen, CompareScreen):
        for binding in screen.BINDINGS:
            assert binding.key in codes, f"{screen.__name__} key {binding.key!r} missing from docs/console.md"
