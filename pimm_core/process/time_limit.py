"""The wall-clock budget of a training session: ``train.max_time`` and the scheduler's end time.

A session stops cleanly, with ``last`` saved, before whichever comes first of

- ``train.max_time`` after the session's start (``Trainer.train()`` called; each resume
  gets the budget again), and
- the job's own end, when the scheduler tells it: ``$SLURM_JOB_END_TIME`` (UNIX seconds),
  read when the session starts.

The rule (:meth:`TimeLimit.reason`, checked after every optimizer step on every rank; the
stop agreement spreads the first rank's verdict to all): stop when the time left is less than
``SAVE_FACTOR`` x the duration of the last synchronous save this session measured (0 before
the first one) + the duration of the last step + ``MARGIN_S``, so that one more step cannot
overrun the limit and the final save and the exit fit before it.

Torch-free: the config checks use :func:`parse_duration`.
"""

from __future__ import annotations

import os
import re
import time
from typing import Callable, Mapping

#: The environment variable a Slurm job's end time is read from (UNIX seconds).
SLURM_END_ENV = "SLURM_JOB_END_TIME"
#: Seconds kept free for the exit after the final save (process groups, the launcher's report).
MARGIN_S = 10.0
#: How many times the last measured save's duration is kept free (saves vary in length).
SAVE_FACTOR = 1.5

# Slurm's --time forms: "M:S" and "H:M:S", "D-H", "D-H:M", "D-H:M:S"
_CLOCK = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_duration(value: float | int | str) -> float:
    """Seconds of ``train.max_time``: a number of seconds, or a string like Slurm's ``--time``:
    ``"HH:MM:SS"``, ``"MM:SS"``, ``"D-HH"``, ``"D-HH:MM"``, ``"D-HH:MM:SS"``.

    Raises:
        ValueError: not a duration, or not positive (the message says what to write).
    """
    hint = 'write seconds (3600) or "HH:MM:SS" / "D-HH:MM:SS" (e.g. "01:30:00")'
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        m = _CLOCK.match(str(value).strip())
        if m is None or (m.group(1) is None and m.group(3) is None):  # a bare "90": minutes in Slurm, seconds here?
            raise ValueError(f"{value!r} is not a duration; {hint}")
        days, first, second, third = (int(g) if g is not None else None for g in m.groups())
        if days is not None:  # D-H[:M[:S]]
            seconds = days * 86400 + first * 3600 + (second or 0) * 60 + (third or 0)
        elif third is not None:  # H:M:S
            seconds = first * 3600 + second * 60 + third
        else:  # M:S
            seconds = first * 60 + second
    if not seconds > 0:
        raise ValueError(f"{value!r} is not a positive duration; {hint}")
    return seconds


def scheduler_end(environ: Mapping[str, str] = os.environ) -> float | None:
    """The job's end time the scheduler exported (``$SLURM_JOB_END_TIME``), or None when it
    is unset, not a number, or 0 (a job without a time limit)."""
    try:
        end = float(environ.get(SLURM_END_ENV, ""))
    except ValueError:
        return None
    return end if end > 0 else None


class TimeLimit:
    """When a session must stop to end before its limit.

    Args:
        max_time: ``train.max_time`` in seconds (None: no budget of its own).
        end: the scheduler's end time, UNIX seconds (None: none known).
        clock: the wall clock (UNIX seconds); ``time.time`` outside tests.

    The session starts when this is made.
    """

    def __init__(self, max_time: float | None, end: float | None, *, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.started = clock()
        limits = []
        if max_time is not None:
            limits.append((self.started + max_time, "train.max_time"))
        if end is not None:
            limits.append((end, SLURM_END_ENV))
        self.end, self.name = min(limits) if limits else (None, None)
        self._last = self.started

    @classmethod
    def from_config(cls, max_time: float | str | None, environ: Mapping[str, str] = os.environ) -> "TimeLimit":
        return cls(None if max_time is None else parse_duration(max_time), scheduler_end(environ))

    def reserve(self, last_save_s: float | None, step_s: float) -> float:
        """Seconds that must be left after a step to take another one: see the module's rule."""
        return SAVE_FACTOR * (last_save_s or 0.0) + step_s + MARGIN_S

    def reason(self, last_save_s: float | None) -> str | None:
        """After an optimizer step: the stop reason when the time left is too short, else None.

        Args:
            last_save_s: the duration of the last synchronous save in seconds (None: none yet).
        """
        now = self.clock()
        step_s, self._last = now - self._last, now
        if self.end is None:
            return None
        left = self.end - now
        if left >= self.reserve(last_save_s, step_s):
            return None
        return f"time limit: {self.name} ends in {max(left, 0.0):.0f} s"
