"""docs/getting-started.md, run as written.

Every line of the page's ```bash blocks is run in order with ``bash -c``, in a fresh directory that
holds a copy of ``configs/`` (so runs land in its ``exp/``, not the repository's), through ``uv run``
against this checkout (``UV_PROJECT``). Blocks the page marks ```shell (install, the console, the
test suite itself) are not run: they are interactive, change the environment, or are this suite.
The page's ```python block then runs in the same directory, and the summary line the page shows
must have the shape of the one pimm printed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import REPO, clean_env

PAGE = REPO / "docs" / "getting-started.md"
CUSTOM = REPO / "docs" / "custom-model.md"


def blocks(text: str, lang: str) -> list[str]:
    """The bodies of the page's fenced blocks of language ``lang`` (without a title), in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def titled(text: str) -> dict[str, str]:
    """``{title: body}`` of the page's fenced blocks with a ``title="..."`` (a file to write)."""
    return dict(re.findall(r'^```\w+ title="([^"]+)"\n(.*?)^```', text, re.S | re.M))


def commands(text: str) -> list[str]:
    """Each non-empty, non-comment line of the page's ```bash blocks (a trailing ``\\`` joins lines)."""
    out = []
    for body in blocks(text, "bash"):
        for line in body.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(line.strip())
    return out


def test_the_page_has_what_a_newcomer_runs() -> None:
    text = PAGE.read_text(encoding="utf-8")
    cmds = commands(text)
    assert cmds and all(c.startswith("uv run pimm ") for c in cmds), cmds
    assert any(c.startswith("uv run pimm launch --train.config configs/digits.toml") for c in cmds)
    for step in ("uv run pimm checkpoints ls ", "uv run pimm resume ", "uv run pimm export "):
        assert any(c.startswith(step) for c in cmds), step
    shell = [line.strip() for body in blocks(text, "shell") for line in body.splitlines() if line.strip()]
    assert shell == ["uv sync --compile-bytecode", "uv run pimm tui exp/digits/first", "uv run pytest"], shell


def test_getting_started_runs_as_written(tmp_path: Path) -> None:
    uv = shutil.which("uv")
    if uv is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("uv is not on PATH: the page's commands start with `uv run`")
        pytest.skip("uv is not on PATH: the page's commands start with `uv run`")
    text = PAGE.read_text(encoding="utf-8")
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    env = {**clean_env(), "UV_PROJECT": str(REPO), "UV_NO_SYNC": "1", "NO_COLOR": "1"}
    outputs = []
    for cmd in commands(text):
        r = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"`{cmd}` exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        outputs.append((cmd, r.stdout + r.stderr))

    run = tmp_path / "exp" / "digits" / "first"
    assert (run / "model" / "last" / ".complete").is_file()
    # The summary line the page shows has the shape of the one the first launch printed.
    shown = re.search(r"^done: .*$", text, re.M).group(0)
    shape = re.escape(shown)
    shape = re.sub(r"\d+(?:\\\.\d+)?", r"\\d+(?:\\.\\d+)?", shape)
    first = outputs[0][1]
    assert re.search(shape, first, re.M), f"the page's summary line {shown!r} does not match:\n{first[-1500:]}"
    # The resume continued the run to the 5 epochs the page asks for.
    resumed = next(out for cmd, out in outputs if cmd.startswith("uv run pimm resume") and "--dry-run" not in cmd)
    assert "epochs 5" in resumed
    # The page's Python loads the export.
    (code,) = blocks(text, "python")
    r = subprocess.run([sys.executable, "-c", code + "\nprint(len(state_dict))"], cwd=tmp_path, env=clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) > 0


def test_the_custom_model_example_runs_as_written(tmp_path: Path) -> None:
    """docs/custom-model.md's complete example: its two files written as shown, its command run."""
    if shutil.which("uv") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("uv is not on PATH: the page's commands start with `uv run`")
        pytest.skip("uv is not on PATH: the page's commands start with `uv run`")
    text = CUSTOM.read_text(encoding="utf-8")
    files = titled(text)
    assert set(files) == {"mytask.py", "mytask.toml"}, files
    for name, body in files.items():
        (tmp_path / name).write_text(body, encoding="utf-8")
    (cmd,) = commands(text)
    env = {**clean_env(), "UV_PROJECT": str(REPO), "UV_NO_SYNC": "1", "NO_COLOR": "1"}
    r = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"`{cmd}` exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert re.search(r"^done: best val/mae \d\.\d+ \(epoch \d\) \| epochs 5 \|", r.stdout + r.stderr, re.M)
    assert (tmp_path / "exp" / "mytask" / "first" / "model" / "last" / ".complete").is_file()
