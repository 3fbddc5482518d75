"""User text on a terminal: shown exactly as written, never as markup or terminal control (torch-free).

Run names, paths, metric names, file names, stop reasons and log lines come from users and
from files anyone could write. Wherever pimm shows them through Rich or Textual they go
through this module:

- :func:`printable`: control characters become visible escapes (``ESC`` is shown as the four
  characters ``\\x1b``, a newline in a name as ``\\n``), so no escape sequence (window title,
  clear screen, leave the alternate screen, hyperlinks) ever reaches the terminal and nothing
  is silently dropped. Escaped: C0 controls but tab, DEL, C1 controls (``\\x80``-``\\x9f``, e.g.
  the 8-bit CSI) and the Unicode bidirectional overrides/isolates (``\\u202e``...), which
  reorder what a reader sees.
- :func:`plain_text`: a ``rich.text.Text`` of that text: a ``Text`` is never parsed as markup,
  so ``x[/red]`` or ``[link=...]`` is shown as those characters.
- :func:`clean_text`: the same for a ``Text`` pimm built (styles kept, its own newlines kept).

A literal backslash is shown as it is: ``\\x1b`` typed into a name looks like an escaped ESC.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.text import Text

_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_CONTROL_KEEP_NEWLINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r"}


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: Any, *, keep_newlines: bool = False) -> str:
    """``str(value)`` with every control character written as a visible escape (``\\x1b``, ``\\n``).

    Args:
        keep_newlines: keep ``\\n`` as a line break (for multi-line text pimm composed itself).
    """
    text = str(value)
    pattern = _CONTROL_KEEP_NEWLINES if keep_newlines else _CONTROL
    return pattern.sub(lambda m: _escape(m.group()), text)


def plain_text(value: Any, style: str = "") -> "Text":
    """``value`` as a ``rich.text.Text`` shown exactly as written (no markup; controls escaped)."""
    from rich.text import Text

    return Text(printable(value), style=style)


def clean_text(text: "Text | str") -> "Text":
    """A renderable safe to draw: a ``str`` becomes :func:`plain_text` (never markup); a ``Text`` keeps
    its styles and line breaks, with every other control character escaped (its spans moved to match)."""
    from rich.text import Span, Text

    if not isinstance(text, Text):
        return plain_text(text)
    plain = text.plain
    if not _CONTROL_KEEP_NEWLINES.search(plain):
        return text
    pos, parts = [0], []
    for ch in plain:
        part = _escape(ch) if _CONTROL_KEEP_NEWLINES.match(ch) else ch
        parts.append(part)
        pos.append(pos[-1] + len(part))
    out = Text("".join(parts), style=text.style, justify=text.justify, overflow=text.overflow,
               no_wrap=text.no_wrap, end=text.end)
    out.spans[:] = [Span(pos[s.start], pos[min(s.end, len(plain))], s.style) for s in text.spans]
    return out
