"""User-facing errors.

Every error a person can fix (bad config, missing checkpoint, wrong path) is a
:class:`PimmError`. The CLI prints its message as one plain line and exits with
``exit_code``; nothing else is printed (no traceback).
"""

from __future__ import annotations


class PimmError(Exception):
    """An error with a one-line, actionable message.

    Attributes:
        exit_code: process exit status the CLI uses: 2 for bad usage or input
            (config, paths, flags), 1 for an operation that failed.
    """

    exit_code = 1

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(PimmError):
    """The config file or an override is invalid (exit code 2)."""

    exit_code = 2


class UsageError(PimmError):
    """A command-line argument or path is invalid (exit code 2)."""

    exit_code = 2


class CheckpointError(PimmError):
    """A checkpoint cannot be selected, read or written (exit code 1)."""

    exit_code = 1


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (disk full, I/O error); the previous one is intact."""
