"""The documentation's reference cannot drift from the code; the README points into the docs.

Checked in process, without building the site (``tests/e2e/test_docs_site.py`` builds it and reads
the pages): every config key of the schema has a one-line meaning in ``pimm_core/config/help.py``
and that file names no other key; the resume policy's rows are ordered as ``plan_resume`` applies
them; the README keeps the test command CI runs, stays short, and its links into ``docs/`` exist.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "docs" / "hooks" / "reference.py"


def _hook():
    spec = importlib.util.spec_from_file_location("pimm_docs_reference", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_meanings_name_only_keys_of_the_schema() -> None:
    from pimm_core.config.help import KEY_HELP

    rows = {key for key, *_ in _hook().config_rows()}  # the schema's keys and its nested tables' keys
    stale = sorted(set(KEY_HELP) - rows)
    assert not stale, f"pimm_core/config/help.py describes keys the schema does not have: {stale}"
    missing = sorted(rows - set(KEY_HELP))
    assert not missing, f"keys without a meaning: add a line for each to pimm_core/config/help.py: {missing}"


def test_every_schema_key_has_a_meaning() -> None:
    from pimm_core.config import Config
    from pimm_core.config.help import KEY_HELP
    from pimm_core.config.tables import all_keys

    missing = [k for k in all_keys(Config) if not KEY_HELP.get(k)]
    assert not missing, f"config keys without a meaning: add a line for each to pimm_core/config/help.py: {missing}"


def test_policy_rows_are_generated_in_the_order_plan_resume_applies_them() -> None:
    from pimm_core.run.topology import ROWS

    hook = _hook()
    order = hook.policy_order()
    assert sorted(order) == sorted(ROWS)
    assert order[0] == "legacy" and order[-1] == "same"
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            picked = hook._plan(a, b).row
            if a in hook.CONDITIONAL:  # its condition may fail with b's change: then a later row applies, never b
                assert order.index(picked) < order.index(b), f"{a!r} is listed before {b!r}, but plan_resume picks {picked!r}"
            else:
                assert picked == a, f"{a!r} is listed before {b!r}, but plan_resume picks {picked!r}"
    table = hook.resume_policy_md()
    for row in ROWS.values():
        assert row.partition(": ")[0].replace("<", "&lt;").replace(">", "&gt;") in table


README_LINK = re.compile(r"\]\((docs/[^)#\s]+)(#[^)\s]*)?\)")


def test_readme_is_short_points_into_the_docs_and_keeps_the_test_command() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    lines = readme.splitlines()
    assert "uv run pytest" in lines, "CI runs the README's test command: keep the line `uv run pytest`"
    assert "uv run pimm launch --train.config configs/digits.toml" in lines
    assert len(lines) <= 120, f"README.md has {len(lines)} lines: keep it a two-minute read, move detail into docs/"
    links = README_LINK.findall(readme)
    assert len(links) >= 8
    for target, _ in links:
        assert (REPO / target).is_file(), f"README links to {target}, which does not exist"
