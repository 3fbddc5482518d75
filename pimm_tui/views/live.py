"""The Live view: progress, ETA, throughput, loss and LR plots, evaluation, recent log lines."""

from __future__ import annotations

import re

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import ProgressBar, RichLog, Static

from pimm_core.text import clean_text, plain_text
from pimm_core.watch.fmt import human_duration
from pimm_core.watch.snapshot import RunSnapshot
from pimm_core.watch.tiers import tiers_line

from ..fmt import fmt_num, fmt_rate, nonfinite
from ..widgets import MetricPlot

# "2026-11-29 12:11:37,807 INFO msg" -> "12:11:37 msg" (other levels are kept: they matter).
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d (\d\d:\d\d:\d\d)(?:,\d+)? (?:INFO )?")


#: Keys of an evaluation record in metrics.jsonl that are not metrics (``loss`` is shown first).
EVAL_BOOKKEEPING = frozenset({"step", "epoch", "iter", "split", "time", "loss"})

#: Ranks listed by name in the ranks line (the lagging ones always are).
RANKS_SHOWN = 8


def ranks_text(snap: RunSnapshot) -> Text:
    """``ranks  0 collective (stop agreement) step 5 2s  1 STUCK callback (...) step 5 41s``: each
    rank's phase, step and seconds since its last progress; the ranks the others wait for in bold
    red (``ranks/<rank>.json``, :func:`pimm_core.run.ranks.lagging_ranks`), stragglers ``SLOW`` in
    yellow (:func:`~pimm_core.run.ranks.stragglers`), and the frame a rank waits in once a hang wrote
    its stack (``in cb.py:12 in on_step_end``, ``ranks/<rank>.stack``)."""
    t = Text()
    if len(snap.ranks) < 2:
        return t  # (one rank: nobody waits for anybody)
    t.append("ranks ", style="bold")
    lagging, slow = set(snap.lagging), set(snap.stragglers)
    shown = [b for b in snap.ranks if b.rank < RANKS_SHOWN or b.rank in lagging or b.rank in slow]
    for b in shown:
        idle = b.idle_s(snap.time)
        stuck = b.rank in lagging
        t.append(f" {b.rank}", style="bold")
        if stuck:
            t.append(" STUCK", style="bold red")
        elif b.rank in slow:
            t.append(" SLOW", style="bold yellow")
        t.append(f" {b.doing}" + (f" step {b.step}" if b.step is not None else ""), style="bold red" if stuck else "")
        if idle is not None and b.phase != "end":
            t.append(f" {human_duration(idle)}", style="bold red" if stuck else "dim")
        frame = snap.frame_of(b.rank)
        if frame is not None:  # its stack, written at a hang (ranks/<rank>.stack)
            t.append(f" in {frame}", style="bold red" if stuck else "")
        t.append(" ·")
    if len(snap.ranks) > len(shown):
        t.append(f" and {len(snap.ranks) - len(shown)} more")
    else:
        t.right_crop(2)
    return t


class LiveView(Vertical):
    """Progress, ETA, throughput, loss and LR plots, evaluation, recent log lines."""

    def compose(self) -> ComposeResult:
        with Horizontal(id="progress-row"):
            yield ProgressBar(total=None, show_eta=False, id="progress")
            yield Static("", id="progress-text")
        yield Static("", id="stats")
        yield Static("", id="ranks")
        yield Static("", id="tiers")
        with Horizontal(id="plots"):
            yield MetricPlot("loss (train) vs global step", "cyan", log_y=True, id="loss-plot")
            yield MetricPlot("learning rate vs global step", "magenta", id="lr-plot")
        yield RichLog(id="log", max_lines=300, wrap=True, markup=False, highlight=False, min_width=20)

    def on_mount(self) -> None:
        self.query_one("#log", RichLog).border_title = "train.log"
        self._metrics_version = -1
        self._log_version = -1

    def show(self, snap: RunSnapshot) -> None:
        bar = self.query_one("#progress", ProgressBar)
        if snap.total_steps:
            bar.update(total=snap.total_steps, progress=min(snap.step or 0, snap.total_steps))
        elif snap.status.live:
            bar.update(total=None)  # indeterminate while a live run has not said how long it is
        else:
            bar.update(total=1, progress=0)
        parts = []
        if snap.step is not None:
            parts.append(f"step {snap.step}" + (f"/{snap.total_steps}" if snap.total_steps else ""))
        if snap.epoch is not None:
            parts.append(f"epochs {snap.epoch}" + (f"/{snap.epochs}" if snap.epochs else "") + " done")
        if snap.status.live:
            parts.append(f"ETA {human_duration(snap.eta_s)}" if snap.eta_s is not None else "ETA -")
        self.query_one("#progress-text", Static).update(plain_text(" · ".join(parts) or "no progress recorded yet"))

        t = Text()
        tr = snap.last_train
        if tr:
            t.append("train ", style="bold")
            t.append(f"loss {fmt_num(tr.get('loss'))}", style="bold red" if nonfinite(tr.get("loss")) else "")
            t.append(f"  lr {fmt_num(tr.get('lr'))}", style="bold red" if nonfinite(tr.get("lr")) else "")
            if snap.samples_per_s is not None:
                t.append(f"  {fmt_rate(snap.samples_per_s)} samples/s")
            if snap.steps_per_s is not None and snap.status.live:
                t.append(f"  {fmt_rate(snap.steps_per_s)} steps/s")
        else:
            t.append("no training records yet", style="dim")
        key = snap.metric.split("/", 1)[-1]
        if snap.last_val:
            v = snap.last_val
            t.append("\neval ", style="bold")
            t.append(f"epoch {v.get('epoch', '?')} step {v.get('step', '?')}: ")
            t.append(f"loss {fmt_num(v.get('loss'))}", style="bold red" if nonfinite(v.get("loss")) else "")
            for name, value in v.items():  # every metric the run's objective reports (acc, mae, perplexity, ...)
                if name not in EVAL_BOOKKEEPING and isinstance(value, (int, float)) and not isinstance(value, bool):
                    t.append(f" {name} {fmt_num(value)}", style="bold red" if nonfinite(value) else "")
            if snap.best_val:
                b = snap.best_val
                t.append("  best ", style="bold")
                t.append(f"{key} {fmt_num(b.get(key))} (epoch {b.get('epoch', '?')})", style="green")
        elif snap.metrics_history is None:
            t.append("\nno evaluation yet", style="dim")
        if snap.metrics_history is not None:  # a large metrics.jsonl: its earlier part is read after the first paint
            t.append(f"\nreading earlier evaluations ({snap.metrics_history:.0%})", style="dim")
        self.query_one("#stats", Static).update(clean_text(t))  # metric names are user text
        ranks = self.query_one("#ranks", Static)
        line = ranks_text(snap)
        ranks.display = bool(line)  # (a one-rank run has no ranks line)
        ranks.update(clean_text(line))
        tiers = Text(tiers_line(snap.tiers) if snap.tiers else "")
        if snap.recovery:
            tiers.append(f"\n{snap.recovery}", style="bold yellow")
        self.query_one("#tiers", Static).update(clean_text(tiers))  # (a store's error is user text)

        if snap.metrics_version != self._metrics_version:
            self._metrics_version = snap.metrics_version
            last = snap.last_train or {}
            self.query_one("#loss-plot", MetricPlot).set_data(*snap.loss, nonfinite=snap.nonfinite_of("loss"),
                                                              latest=last.get("loss"))
            self.query_one("#lr-plot", MetricPlot).set_data(*snap.lr, nonfinite=snap.nonfinite_of("lr"),
                                                            latest=last.get("lr"))
        if snap.log_version != self._log_version:
            self._log_version = snap.log_version
            log = self.query_one("#log", RichLog)
            log.clear()
            for line in snap.log_lines[-60:]:
                # a log line is shown as text: markup is not read, escape sequences are shown escaped
                log.write(plain_text(_LOG_PREFIX.sub(r"\1 ", line)))

    def toggle_log(self) -> bool:
        """Switch the loss plot between a log and a linear y axis; returns True for log."""
        plot = self.query_one("#loss-plot", MetricPlot)
        plot.set_log(not plot.log_y)
        return plot.log_y
