"""Training throughput: the one definition of ``samples_per_s`` and ``steps_per_s``.

``samples_per_s`` is the number of samples of the optimizer steps since the previous train
record (all ranks: a rank's samples times the world size) divided by the seconds spent in
those steps; ``steps_per_s`` is the number of those steps divided by the same seconds. The
seconds are wall-clock time since the previous record less the time spent in evaluation and
checkpoint saving (the trainer runs those inside :meth:`StepClock.paused`), so a record right
after an evaluation or a save is neither inflated nor deflated by it. Data loading, the
forward and backward passes and the optimizer step count as training.

The log line, ``metrics.jsonl`` and the console (which reads ``metrics.jsonl``) show these values.
"""

from __future__ import annotations

import time
from typing import Callable


class StepClock:
    """Samples, steps and training seconds since the last :meth:`take`.

    Args:
        clock: seconds, monotonic (``time.perf_counter``; a fake one in tests).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._mark = clock()
        self._excluded = 0.0  # paused seconds since the mark
        self._samples = self._steps = 0
        self._depth = 0  # nested paused() spans count once

    def start(self) -> None:
        """The training loop starts: count from now."""
        self._mark, self._excluded, self._samples, self._steps = self.clock(), 0.0, 0, 0

    def add(self, samples: int, steps: int = 1) -> None:
        """``steps`` optimizer steps of ``samples`` samples (all ranks) were taken."""
        self._samples += samples
        self._steps += steps

    def paused(self) -> "_Paused":
        """A context in which time spent is not training time (evaluation, checkpoint saving)."""
        return _Paused(self)

    def take(self) -> tuple[float, float]:
        """``(samples_per_s, steps_per_s)`` since the previous take (or :meth:`start`), then count anew.

        Returns:
            Both rates in units per second of training time; 0.0 when no time passed.
        """
        now = self.clock()
        seconds = now - self._mark - self._excluded
        rates = (self._samples / seconds, self._steps / seconds) if seconds > 0 else (0.0, 0.0)
        self._mark, self._excluded, self._samples, self._steps = now, 0.0, 0, 0
        return rates


class _Paused:
    """:meth:`StepClock.paused` (a class, not a generator: it wraps every step's due-save check)."""

    __slots__ = ("c", "started")

    def __init__(self, clock: StepClock):
        self.c = clock

    def __enter__(self) -> None:
        self.c._depth += 1
        self.started = self.c.clock()

    def __exit__(self, *exc: object) -> None:
        c = self.c
        c._depth -= 1
        if c._depth == 0:  # nested paused() spans count once
            c._excluded += c.clock() - self.started
