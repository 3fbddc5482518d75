"""The ``pimm`` logger's console output (torch-free).

Log lines go to the *current* ``sys.stdout`` (``sys.stderr`` for ranks other than 0) at
each record, not to the stream that was there when the handler was made: while Rich's
live progress bar is shown it redirects both, so log lines scroll above one bar instead
of colliding with it. When stdout is not a terminal (cluster logs) there is no bar and
the trainer writes plain periodic progress lines instead.

The CLI calls :func:`setup_logging` once per process. A :class:`~pimm_core.trainer.Trainer`
used from Python attaches the same console output for the length of ``train()`` when the
host program has not configured the ``pimm`` logger itself (:func:`attach_console`),
without touching the root logger.
"""

from __future__ import annotations

import logging
import sys

from ..text import printable

FORMAT = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")


class ConsoleHandler(logging.StreamHandler):
    """A StreamHandler on whatever ``sys.stdout`` (or ``sys.stderr``) is at emit time."""

    def __init__(self, *, stderr: bool = False):
        super().__init__()
        self._stderr = stderr
        self.setFormatter(FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        """The line as logged, with control characters from user text (names, paths) shown escaped
        (:func:`pimm_core.text.printable`): nothing in a message drives the terminal."""
        return printable(super().format(record), keep_newlines=True)

    @property
    def stream(self):  # noqa: D102 - logging reads it for every record
        return sys.stderr if self._stderr else sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property decides
        pass


def setup_logging(is_main: bool) -> None:
    """CLI processes: INFO to stdout on rank 0, warnings to stderr on other ranks."""
    logger = logging.getLogger("pimm")
    if logger.handlers:
        return
    logger.addHandler(ConsoleHandler(stderr=not is_main))
    logger.setLevel(logging.INFO if is_main else logging.WARNING)
    logger.propagate = False


def attach_console(is_main: bool):
    """Give an unconfigured ``pimm`` logger a console for one run; returns a function that undoes it.

    A logger the host program configured (it has handlers, or a level) is left alone.
    """
    logger = logging.getLogger("pimm")
    if logger.handlers or logger.level != logging.NOTSET:
        return lambda: None
    handler = ConsoleHandler(stderr=not is_main)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if is_main else logging.WARNING)
    logger.propagate = False

    def detach() -> None:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True

    return detach
