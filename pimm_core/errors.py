"""User-facing errors.

Every error a person can fix (bad config, missing checkpoint, wrong path) is a
:class:`PimmError`. The CLI prints its message as one plain line and exits with
``exit_code``; nothing else is printed (no traceback).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .fsio import atomic_write_bytes
from .text import printable


#: Exit status of a reader (``pimm checkpoints verify|ls|latest``, ``pimm export``) whose
#: checkpoint a live run's saves replaced during every try: "changed while reading; try again".
#: Not a verdict on any checkpoint; a script retries on it. 75 is ``EX_TEMPFAIL`` of sysexits.h.
CHANGED_EXIT_CODE = 75


class PimmError(Exception):
    """An error with a one-line, actionable message.

    Attributes:
        exit_code: process exit status the CLI uses: 2 for bad usage or input
            (config, paths, flags), 1 for an operation that failed, :data:`CHANGED_EXIT_CODE`
            (75) for a read that a live run's saves kept overtaking (retry it).
    """

    exit_code = 1

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code

    def __reduce__(self):
        """Pickle with the class and exit code (``Exception``'s default drops keyword arguments),
        so an error crosses ranks as itself (``dist.broadcast_object``), not as a string to parse."""
        return _rebuild, (type(self), str(self), self.exit_code)


def _rebuild(cls: type[PimmError], message: str, exit_code: int) -> PimmError:
    return cls(message, exit_code=exit_code)


class ConfigError(PimmError):
    """The config file or an override is invalid (exit code 2)."""

    exit_code = 2


class UsageError(PimmError):
    """A command-line argument or path is invalid (exit code 2)."""

    exit_code = 2


class CheckpointError(PimmError):
    """A checkpoint cannot be selected, read or written (exit code 1)."""

    exit_code = 1


class CheckpointParseError(CheckpointError):
    """A checkpoint file is hostile or malformed: it would run code when unpickled, or is not
    what pimm writes (exit code 2). The message names the file; nothing in it has run."""

    exit_code = 2


class WeightNotFoundError(CheckpointError):
    """A non-empty weight source does not resolve to a file (exit code 2).

    The message starts with ``No weight found:`` and names the source.
    """

    exit_code = 2


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint directory lacks a required part (exit code 2).

    The message starts with ``Incomplete checkpoint directory`` and names what is missing.
    """

    exit_code = 2


class HubUnreachableError(CheckpointError):
    """An ``hf://`` file is not in the local cache and the Hub cannot be asked for it (exit code 1).

    Either the Hub (``HF_ENDPOINT``) did not answer one quick probe, or ``HF_HUB_OFFLINE=1``
    forbids asking it. The message says which, and what to do.
    """

    exit_code = 1


class RemoteStoreError(CheckpointError):
    """A remote store (``s3://``... through fsspec) cannot be reached or read: network, credentials,
    a missing filesystem package, a download that does not match its record (exit code 1)."""

    exit_code = 1


class TrainingError(PimmError):
    """Training itself went wrong (e.g. the weights stopped being finite); exit code 1."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (disk full, I/O error); the previous one is intact."""


def first_line(e: BaseException, *, empty: str | None = None) -> str:
    """The first non-blank line of ``str(e)``, stripped: an error's text on one line.

    Args:
        empty: what an error without text gives; ``None``: its class name.
    """
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()
    return e.__class__.__name__ if empty is None else empty


# A rank started by ``pimm launch --nproc-per-node`` hands its error message to the launcher
# through a file in this directory instead of printing it: with N ranks failing together
# (a collective save error reaches every rank) the user would otherwise read N+1 ``error:``
# lines. The launcher prints one (see launch.spawn). Ranks started by an external
# torchrun/srun have no such directory and print their own line.
RANK_ERRORS_ENV = "PIMM_RANK_ERRORS"


def report(e: PimmError, *, secondary: bool = False, file=None) -> None:
    """Print ``error: <message>`` to stderr, or hand it to the ``pimm launch`` parent.

    Args:
        secondary: the failure is a consequence of another rank's (a lost connection to a
            rank that died); the launcher reports the root cause instead when it knows it.

    A handed-over message is written to ``$PIMM_RANK_ERRORS/rank<RANK>.json``
    (``{"code", "message", "secondary"}``) through a temporary file and a rename, so the
    launcher never reads half of it.
    """
    where = os.environ.get(RANK_ERRORS_ENV)
    rank = os.environ.get("RANK")
    if where and rank is not None and os.path.isdir(where):
        final = os.path.join(where, f"rank{rank}.json")
        try:
            data = json.dumps({"code": e.exit_code, "message": str(e), "secondary": secondary}).encode()
            atomic_write_bytes(Path(final), data, durable=False)
            return
        except OSError:
            pass  # fall back to printing: a lost message is worse than an extra line
    print(f"error: {printable(e)}", file=file or sys.stderr, flush=True)


def rank_errors(where: str) -> dict[int, dict]:
    """The reports ranks handed over: ``{rank: {"code", "message", "secondary"}}``."""
    out: dict[int, dict] = {}
    for name in os.listdir(where):
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(where, name)) as f:
                    out[int(name[4:-5])] = json.load(f)
            except (OSError, ValueError):
                continue
    return out


# How a collective fails in the surviving ranks when a peer process died (gloo, NCCL, the store).
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket Timeout",
              "NCCL communicator was aborted", "failed to recv", "Connection refused")


def is_peer_loss(e: BaseException) -> bool:
    """True for the error a collective raises in a rank whose peer process died (torch-free check)."""
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_LOST)


def restarts_left() -> int:
    """How often torchrun's elastic agent will still restart this rank's group after a failure
    (``pimm launch --max-restarts K``: ``TORCHELASTIC_MAX_RESTARTS - TORCHELASTIC_RESTART_COUNT``);
    0 outside torchrun (torch-free).

    A rank that fails while restarts are left is not the run's end: the agent stops the other ranks and
    starts new ones, which recover (``docs/memory-tier.md``)."""
    env = os.environ
    try:
        return max(0, int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0) - int(env.get("TORCHELASTIC_RESTART_COUNT") or 0))
    except ValueError:
        return 0
