"""User text (run names, paths, metric names, file names, log lines) reaches a terminal as text:
no markup interpreted, no part dropped, no control sequence passed through (``pimm_core.text``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from _helpers import clean_env, describe, pimm
from tui_support import loaded, make_app, screen_text, wait_for

from pimm_core.text import clean_text, plain_text, printable

ESC_LINES = ["title \x1b]0;pwned\x07 here", "clear \x1b[2J screen", "leave \x1b[?1049l alt", "csi8 \x9b2J bidi \u202e"]


# ------------------------------------------------------------------------ the helper
def test_printable_escapes_every_control_character_visibly():
    assert printable("a\x1b]0;t\x07b") == "a\\x1b]0;t\\x07b"
    assert printable("x\ny\rz\x00\x7f\x9b\u202e") == "x\\ny\\rz\\x00\\x7f\\x9b\\u202e"
    assert printable("tab\tkept") == "tab\tkept"
    assert printable("two\nlines", keep_newlines=True) == "two\nlines"
    assert printable("é [b]x[/b] 日本") == "é [b]x[/b] 日本"  # ordinary text (and markup) unchanged


def test_plain_text_is_never_markup():
    for s in ("x[/red]", "[bold red]BOLD[link=https://e.x]click.tmp", "[@click=app.quit]q[/]"):
        t = plain_text(s)
        assert t.plain == s and not t.spans


def test_clean_text_keeps_styles_and_moves_spans():
    from rich.text import Text

    t = Text("ok ", style="bold")
    t.append("a\x1bb", style="red")
    t.append("\nnext", style="dim")
    out = clean_text(t)
    assert out.plain == "ok a\\x1bb\nnext"
    assert [(out.plain[s.start:s.end], str(s.style)) for s in out.spans] == [("a\\x1bb", "red"), ("\nnext", "dim")]
    assert out.style == "bold"
    assert clean_text("[b]x").plain == "[b]x"


# --------------------------------------------------------------------- checkpoints ls
@pytest.fixture
def hostile_run(tmp_path: Path) -> Path:
    """A run directory named ``x[/red]`` (a directory ``x[`` holding ``red]``) whose model/ holds leftovers
    named as markup and as escape sequences."""
    run = tmp_path / "x[" / "red]"
    model = run / "model"
    for name in ("[bold red]BOLD[link=https:e.x]click.tmp", "x[a=b:c]y.tmp", "[@click=app.quit]q.tmp",
                 "esc\x1b]0;pwned\x07.tmp"):
        (model / name).mkdir(parents=True)
    return run


@pytest.mark.parametrize("columns", [160, 80])
def test_checkpoints_ls_shows_names_exactly(hostile_run: Path, columns: int):
    env = {**clean_env(), "COLUMNS": str(columns), "FORCE_COLOR": "1"}
    result = pimm("checkpoints", "ls", hostile_run, env=env, timeout=60)
    assert result.returncode == 0, describe(result)
    out = result.stdout
    assert "Traceback" not in result.stderr and result.stderr == "", describe(result)
    assert f"{hostile_run}/model" in out  # the title, with its "[/red]"
    for name in ("[bold red]BOLD[link=https:e.x]click.tmp", "x[a=b:c]y.tmp", "[@click=app.quit]q.tmp",
                 "esc\\x1b]0;pwned\\x07.tmp"):
        assert name in out, out
    assert "\x1b]" not in out and "\x07" not in out  # no OSC (title, hyperlink), no bell: only Rich's colours


def test_checkpoints_verify_and_latest_explain_escape_names(hostile_run: Path):
    result = pimm("checkpoints", "latest", hostile_run, "--explain", timeout=60)
    assert result.returncode == 1
    assert "\x1b" not in result.stderr and "esc\\x1b]0;pwned\\x07.tmp" in result.stderr, describe(result)


def test_error_lines_escape_user_text(tmp_path: Path):
    result = pimm("stop", tmp_path / "no\x1b[2Jrun", timeout=60)
    assert result.returncode == 2
    assert "\x1b" not in result.stderr and "no\\x1b[2Jrun" in result.stderr, describe(result)


# ------------------------------------------------------------------------ the console
def _fake_run(run: Path) -> None:
    """A finished run's files, written directly (the console reads files only)."""
    now = time.time()
    (run / "config.toml").write_text('[eval]\nmetric = "val/x[/red]"\nmode = "max"\n')
    (run / "status.json").write_text(json.dumps({"state": "finished", "step": 10, "epoch": 1, "pid": os.getpid(),
                                                 "heartbeat": now, "stop_reason": None}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 10, "epoch": 0, "iter": 9, "split": "train",
                                                   "loss": 0.5, "lr": 0.001, "time": now}) + "\n")
    (run / "train.log").write_text("".join(f"2026-11-29 12:11:37,807 INFO {line}\n" for line in ESC_LINES))


def _segments(app):
    for strip in app.screen._compositor.render_strips():
        yield from strip


@pytest.mark.asyncio
async def test_console_shows_names_and_log_lines_as_text(hostile_run: Path) -> None:
    _fake_run(hostile_run)
    app = make_app(hostile_run)
    async with app.run_test(size=(160, 40)) as pilot:
        await loaded(pilot)
        text = screen_text(app)
        for line in ESC_LINES:  # the Live view's train.log panel
            assert printable(line) in text, text
        await pilot.press("2")
        await wait_for(pilot, lambda: "x[a=b:c]y.tmp" in screen_text(app), what="the Checkpoints table")
        text = screen_text(app)
        for name in ("x[a=b:c]y.tmp", "[@click=app.quit]q.tmp", "[bold red]BOLD[link=https:e.x]click.tmp",
                     "esc\\x1b]0;pwned\\x07.tmp", "val/x[/red]"):
            assert name in text, text
        for seg in _segments(app):
            assert not any(ord(c) < 32 or 0x7f <= ord(c) <= 0x9f for c in seg.text), repr(seg.text)
            meta = seg.style.meta if seg.style is not None else {}
            assert "@click" not in (meta or {}), (seg.text, meta)
            assert not (seg.style is not None and seg.style.link), (seg.text, seg.style)
