"""What every view shares: the messages views post to the app, and whether a view is showing.

The views never import the app: a view posts one of these dataclass messages and
:class:`~pimm_tui.app.PimmConsole` (``on_open_view``, ``on_refresh_run``) acts on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.message import Message
from textual.widget import Widget


@dataclass
class OpenView(Message):
    """A view asks the console to show another view for checkpoint ``name``.

    Attributes:
        tab: ``export`` (the form, prefilled with ``name``) or ``topology`` (its plan for ``name``).
        name: the checkpoint's entry name in ``model/`` (``last``, ``iter_40.pth``...).
    """

    tab: str
    name: str


@dataclass
class RefreshRun(Message):
    """A view saw the run change under it (a checkpoint was replaced): read it again now."""


def visible(widget: Widget) -> bool:
    """The widget is on the active tab (its result can be read where it is, without a toast)."""
    node: Any = widget
    while node is not None and isinstance(node, Widget):
        if not node.display:
            return False
        node = node.parent
    return True
