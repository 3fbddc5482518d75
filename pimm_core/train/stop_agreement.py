"""Every rank stops at the same optimizer step, for whichever reason any of them has.

The sources of a stop are a :class:`~pimm_core.process.stop.StopRequest` (signals, ``request()``
from any thread or a callback) and the run's ``control/stop`` file (``pimm stop``, the
console), which rank 0 polls at most every 0.1 s (one ``stat``; no per-sample I/O): the stop
step comes at most 0.1 s after the file is written, plus the rest of the window in progress.
At each accumulation-window boundary :meth:`StopAgreement.agree` returns the same
verdict on every rank; only when some rank wants to stop are the reasons gathered, and the
lowest rank's reason wins (no deadlock, no rank left training alone).

The verdict needs no collective of its own: at the window's end, before its optimizer step,
each rank's flags (:meth:`StopAgreement.window_flags`: "I want to stop", "I have
``on_step_end`` callbacks") ride in the window's all-reduce of its loss and count
(:mod:`~pimm_core.train.window_average`), and :meth:`StopAgreement.agree`, after the step's
callbacks, reads their sums. A stop requested by then (a signal, ``control/stop``, another
thread, the time limit, a failed save) stops every rank at this step. A callback's
``trainer.stop.request`` in ``on_step_end`` comes after that all-reduce: when any rank has
such callbacks, :meth:`StopAgreement.agree` adds one all-reduce of the flag after them, as
before, so a callback's stop is still the stop of the step it was asked at. (On a machine
where the ranks are not always scheduled at once each collective waits for the last rank
to arrive, and at a small model those waits are most of a step.)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..process import dist
from ..process.lock import claimed_since
from ..process.stop import StopRequest, read_stop_file, stop_file
from ..run.heartbeat import beat

log = logging.getLogger("pimm")


class StopAgreement:
    """Agree on stopping across ranks.

    Args:
        stop: the request this run obeys (``trainer.stop``).
        info: this process's rank layout.
        run_dir: the run directory whose ``control/stop`` rank 0 polls (None: no file).
        device: where the all-reduced flag lives (the training device).
        poll_every_s: the least time between two polls of ``control/stop``.
    """

    def __init__(self, stop: StopRequest, info: dist.DistInfo, run_dir: Path | None, device: torch.device, *,
                 poll_every_s: float = 0.1):
        self.stop, self.info, self.run_dir, self.device = stop, info, run_dir, device
        self.poll_every_s = poll_every_s
        self._last_poll = float("-inf")
        self.file_used = False  # the stop came from control/stop: consume it once the stop is recorded
        self.cause: Exception | None = None  # the error of the agreed reason (see agree)
        # the sums of this step's window_flags ([ranks wanting to stop, ranks with on_step_end
        # callbacks]), None when no window flags were reduced since the last agree()
        self._window: tuple[bool, bool] | None = None

    def window_flags(self, step_callbacks: bool) -> list[float] | None:
        """At a window's end, before its all-reduce: this rank's ``[wants to stop, has on_step_end
        callbacks]`` (1.0 or 0.0), summed over the ranks there; None with one rank (no collective
        to ride in: :meth:`agree` reads the request itself)."""
        if not self.info.distributed:
            return None
        if self.stop.reason is None:
            self.poll()
        return [0.0 if self.stop.reason is None else 1.0, 1.0 if step_callbacks else 0.0]

    def window_verdict(self, sums: torch.Tensor) -> None:
        """The sums of every rank's :meth:`window_flags` (the same on every rank)."""
        stop_any, callbacks_any = sums.tolist()  # (one host read, as the flag's item() was)
        self._window = (stop_any > 0, callbacks_any > 0)

    def discard_stale(self) -> None:
        """At the start of a session: a ``control/stop`` left from an earlier one never stops this run;
        one written since this launch claimed the run directory (``pimm stop`` while the run was
        starting: after ``lock.json``'s ``since``) stops it before its first step."""
        self._window = None  # (a verdict an earlier session left unread, at a non-finite stop)
        if self.run_dir is None or not self.info.is_main or not stop_file(self.run_dir).exists():
            return
        req = read_stop_file(self.run_dir) or {}
        since = claimed_since(self.run_dir)
        if since is not None and float(req.get("time") or 0) >= since:
            log.info("stop asked while the run was starting (reason %r): it stops before its first step",
                     req.get("reason"))
            return
        log.warning("ignoring a stop request left from an earlier session (%s, reason %r); removed %s",
                    time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(req.get("time", 0))), req.get("reason"),
                    stop_file(self.run_dir))
        stop_file(self.run_dir).unlink(missing_ok=True)

    def poll(self) -> None:
        """Rank 0: turn ``control/stop`` into a stop request (at most once per ``poll_every_s``)."""
        now = time.monotonic()
        if self.run_dir is None or not self.info.is_main or now - self._last_poll < self.poll_every_s:
            return
        self._last_poll = now
        if stop_file(self.run_dir).exists():
            req = read_stop_file(self.run_dir) or {}
            self.file_used = True
            self.stop.request(str(req.get("reason") or "operator"))

    def agree(self) -> str | None:
        """The reason to stop now, the same on every rank, or None to go on; :attr:`cause` is
        then the error that reason came with (``StopRequest.request(..., cause=)``), if any."""
        if self.stop.reason is None:
            self.poll()
        if not self.info.distributed:
            self.cause = self.stop.cause
            return self.stop.reason
        window, self._window = self._window, None
        if window is None or window[1]:  # no window verdict (before the first step), or callbacks ran since
            flag = torch.tensor([0 if self.stop.reason is None else 1], device=self.device)
            beat("collective", "stop agreement")  # (bounded by dist.timeout, like every collective)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            stop_any = bool(flag.item())
        else:
            stop_any = window[0]  # a request made since is in the next window's flags
        if not stop_any:
            return None
        # (a PimmError pickles with its class, so every rank gets the typed cause)
        reason, cause = next(rc for rc in dist.all_gather_object((self.stop.reason, self.stop.cause))
                             if rc[0] is not None)
        self.stop.request(reason, cause=cause)
        self.cause = cause
        return reason

    def consume(self) -> None:
        """Rank 0, after the stop is recorded: remove the ``control/stop`` that caused it, so
        that it does not stop the resumed run."""
        if self.file_used and self.run_dir is not None and self.info.is_main:
            stop_file(self.run_dir).unlink(missing_ok=True)
