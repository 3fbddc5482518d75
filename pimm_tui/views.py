"""The console's views: Live, Checkpoints, Topology, Export.

Each view gets the newest :class:`~pimm_core.watch.snapshot.RunSnapshot` through ``show()``
(on the event loop) and redraws only what changed. Slow work (sha256, the resume
diff, export) runs in thread workers; nothing here reads files on the event loop.
"""

from __future__ import annotations

import math
import re
import shlex
import time
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Button, Checkbox, DataTable, Input, Label, ProgressBar, RichLog, Select, Static
from textual.worker import get_current_worker

from pimm_core.checkpoint.selection import Candidate
from pimm_core.errors import PimmError
from pimm_core.watch.candidates import VerifyResult, candidate_age, candidate_identity, verify_checkpoint
from pimm_core.watch.fmt import fmt_age, fmt_size, human_duration
from pimm_core.watch.resume_diff import DIFF_ROWS, planned_text, resume_diff
from pimm_core.watch.snapshot import RunSnapshot

from .widgets import MetricPlot, fmt_num, fmt_rate

#: Colours of the resume-policy rows' tones (:func:`pimm_core.watch.resume_diff.plan_rows`).
TONE_STYLE = {"plain": "", "info": "cyan", "ok": "green", "bad": "red", "warn": "yellow", "dim": "dim"}

#: Views narrower than this drop the Checkpoints table's format and epoch columns (the detail line shows them).
WIDE_TABLE = 100


class OpenView(Message):
    """A view asks the console to show another view for checkpoint ``name`` (``export``, ``topology``).

    The views never import the app: they post this and the app switches tabs.
    """

    def __init__(self, tab: str, name: str) -> None:
        super().__init__()
        self.tab = tab
        self.name = name


class RefreshRun(Message):
    """A view saw the run change under it (a checkpoint was replaced): read it again now."""


def _visible(widget: Widget) -> bool:
    """The widget is on the active tab (its result can be read where it is, without a toast)."""
    node: Any = widget
    while node is not None and isinstance(node, Widget):
        if not node.display:
            return False
        node = node.parent
    return True


def _bad(v: Any) -> bool:
    return isinstance(v, float) and not math.isfinite(v)

# "2026-11-29 12:11:37,807 INFO msg" -> "12:11:37 msg" (other levels are kept: they matter).
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d (\d\d:\d\d:\d\d)(?:,\d+)? (?:INFO )?")


def _error_line(e: BaseException) -> str:
    """A readable one-line message for an exception raised by pimm_core (or anything else)."""
    if isinstance(e, PimmError):
        return str(e)
    if isinstance(e, OSError):
        return f"{e.strerror or e.__class__.__name__}: {e.filename or ''}".rstrip(": ")
    text = str(e).strip().splitlines()
    return f"{e.__class__.__name__}: {text[0] if text else ''}".rstrip(": ")


# ------------------------------------------------------------------- live
class LiveView(Vertical):
    """Progress, ETA, throughput, loss and LR plots, evaluation, recent log lines."""

    def compose(self) -> ComposeResult:
        with Horizontal(id="progress-row"):
            yield ProgressBar(total=None, show_eta=False, id="progress")
            yield Static("", id="progress-text")
        yield Static("", id="stats")
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
        self.query_one("#progress-text", Static).update(" · ".join(parts) or "no progress recorded yet")

        t = Text()
        tr = snap.last_train
        if tr:
            t.append("train ", style="bold")
            t.append(f"loss {fmt_num(tr.get('loss'))}", style="bold red" if _bad(tr.get("loss")) else "")
            t.append(f"  lr {fmt_num(tr.get('lr'))}", style="bold red" if _bad(tr.get("lr")) else "")
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
            t.append(f"loss {fmt_num(v.get('loss'))}", style="bold red" if _bad(v.get("loss")) else "")
            t.append(f" acc {fmt_num(v.get('acc'))}", style="bold red" if _bad(v.get("acc")) else "")
            if snap.best_val:
                b = snap.best_val
                t.append("  best ", style="bold")
                t.append(f"{key} {fmt_num(b.get(key))} (epoch {b.get('epoch', '?')})", style="green")
        else:
            t.append("\nno evaluation yet", style="dim")
        self.query_one("#stats", Static).update(t)

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
                log.write(_LOG_PREFIX.sub(r"\1 ", line))

    def toggle_log(self) -> bool:
        """Switch the loss plot between a log and a linear y axis; returns True for log."""
        plot = self.query_one("#loss-plot", MetricPlot)
        plot.set_log(not plot.log_y)
        return plot.log_y


# ------------------------------------------------------------ checkpoints
def _problem_kind(problem: str) -> str:
    for word in ("sha256", "missing", "size", "incomplete"):
        if word in problem:
            return word
    return "see below"


class CheckpointsView(Vertical):
    """Every candidate in model/, which one resume picks; verify / export / topology actions.

    A verify result belongs to the checkpoint generation that was hashed
    (:func:`~pimm_core.watch.candidates.candidate_identity`: name, manifest created time, step), not
    to the row name: when ``last`` is replaced by a newer save, its row shows the newer
    checkpoint unverified, and the older one's result is kept for it.
    """

    # Its keys (v, e, t) are the console's, shown while this tab is active.

    def compose(self) -> ComposeResult:
        yield DataTable(id="ckpt-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="ckpt-detail")

    def on_mount(self) -> None:
        self._key: Any = None
        self._layout: tuple[str, bool] | None = None
        self._metric: str | None = None
        self._cands: dict[str, Candidate] = {}
        self._ids: dict[str, tuple[Any, ...]] = {}
        self._chosen: str | None = None
        self._live = False
        self._running: set[tuple[Any, ...]] = set()
        self.results: dict[tuple[Any, ...], VerifyResult] = {}  # identity -> the result of that generation
        self._drawn_at = 0.0
        self.detail_text = ""

    @property
    def wide(self) -> bool:
        return (self.size.width or 80) >= WIDE_TABLE

    def _columns(self, metric: str) -> None:
        table = self.query_one(DataTable)
        table.clear(columns=True)
        cols: list[tuple[str, str]] = [("", "mark"), ("name", "name")]
        if self.wide:
            cols.append(("format", "format"))
        cols.append(("step", "step"))
        if self.wide:
            cols.append(("epoch", "epoch"))
        cols += [(metric, "metric"), ("size", "size"), ("age", "age"), ("status", "status")]
        for label, key in cols:
            table.add_column(label, key=key)
        self._metric = metric
        self._layout = (metric, self.wide)

    def on_resize(self) -> None:
        if self._layout is not None and self._layout[1] != self.wide and self._metric is not None:
            self._columns(self._metric)
            self._draw()

    def result_for(self, name: str) -> VerifyResult | None:
        """The verify result of the generation row ``name`` shows now (None: not verified)."""
        ident = self._ids.get(name)
        return self.results.get(ident) if ident is not None else None

    def _earlier_result(self, name: str) -> VerifyResult | None:
        """The newest result for an earlier generation of ``name`` (replaced since)."""
        ident = self._ids.get(name)
        older = [r for i, r in self.results.items() if r.name == name and i != ident and r.outcome != "changed"]
        return older[-1] if older else None

    def _status_cell(self, c: Candidate) -> Text:
        ident = self._ids.get(c.name)
        if ident in self._running:
            return Text("verifying…", style="yellow")
        r = self.results.get(ident) if ident is not None else None
        if r is not None:
            if r.outcome == "ok":
                return Text("verified ✓", style="bold green")
            if r.outcome == "changed":
                return Text("changed: v again", style="yellow")
            return Text(f"FAILED: {_problem_kind(r.problems[0]) if r.problems else '?'}", style="bold red")
        if c.kind == "tmp":  # while the trainer runs, a save in progress
            return Text("being written", style="yellow") if self._live else Text("leftover", style="red")
        if c.verify_problems:  # resume's own selection pass found a mismatch
            return Text(f"corrupt: {_problem_kind(c.verify_problems[0])}", style="bold red")
        if c.complete:
            return Text("complete", style="green")
        return Text("incomplete", style="red")

    def show(self, snap: RunSnapshot, force: bool = False) -> None:
        if snap.metric != self._metric or self._layout is None:
            self._columns(snap.metric)
            self._key = None
        now = time.time()
        if not force and snap.candidates_key == self._key and now - self._drawn_at < 10:
            return
        self._key, self._drawn_at = snap.candidates_key, now
        self._cands = {c.name: c for c in snap.candidates}
        ids = snap.candidate_ids if len(snap.candidate_ids) == len(snap.candidates) else \
            tuple(candidate_identity(c) for c in snap.candidates)
        self._ids = {c.name: i for c, i in zip(snap.candidates, ids)}
        self._chosen = snap.chosen
        self._live = snap.status.live
        self._draw(snap.metric)

    def _draw(self, metric: str | None = None) -> None:
        metric = metric or self._metric or "val/acc"
        table = self.query_one(DataTable)
        current = self.highlighted()
        table.clear()
        for c in self._cands.values():
            mark = Text("▶", style="bold green") if c.name == self._chosen else Text("")
            value = c.metrics.get(metric) if isinstance(c.metrics, dict) else None
            if value is None and c.manifest and isinstance(c.manifest.get("selection_metric"), dict):
                sm = c.manifest["selection_metric"]
                value = sm.get("value") if sm.get("name") == metric else None
            cells: list[Any] = [mark, c.name]
            if self.wide:
                cells.append(c.format)
            cells.append("-" if c.step is None else str(c.step))
            if self.wide:
                cells.append("-" if c.epoch is None else str(c.epoch))
            cells += [Text(fmt_num(value), style="bold red" if _bad(value) else ""), fmt_size(c.size),
                      fmt_age(candidate_age(c)), self._status_cell(c)]
            table.add_row(*cells, key=c.name)
        names = list(self._cands)
        if current is not None and current.name in names:
            table.move_cursor(row=names.index(current.name), animate=False)
        elif self._chosen in names:
            table.move_cursor(row=names.index(self._chosen), animate=False)
        self._detail()

    def highlighted(self) -> Candidate | None:
        table = self.query_one(DataTable)
        if not self._cands or table.row_count == 0:
            return None
        try:
            key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        except Exception:
            return None
        return self._cands.get(str(key.value)) if key is not None else None

    @on(DataTable.RowHighlighted)
    def _on_highlight(self) -> None:
        self._detail()

    def _detail(self) -> None:
        out = Text()
        if not self._cands:
            out.append("no checkpoints (model/ is missing or empty)", style="dim")
        else:
            out.append("▶ ", style="bold green")
            out.append(f"resume would load: {self._chosen or 'nothing (no complete resumable candidate)'}")
            c = self.highlighted()
            if c is not None:
                out.append(f"\n{c.name}: ", style="bold")
                where = [c.format]
                if c.step is not None:
                    where.append(f"step {c.step}")
                if c.epoch is not None:
                    where.append(f"epoch {c.epoch}" + (f" iter {c.iter}" if c.iter is not None else ""))
                out.append(", ".join(where) + "; ", style="dim")
                ident = self._ids.get(c.name)
                r = self.results.get(ident) if ident is not None else None
                if ident in self._running:
                    out.append("verifying sizes and sha256 against its manifest…", style="yellow")
                elif r is not None and r.outcome == "ok":
                    out.append("verified: every file matches its manifest size and sha256", style="green")
                elif r is not None and r.outcome == "changed":
                    out.append("; ".join(r.problems), style="yellow")
                elif r is not None:
                    out.append("verify FAILED: " + "; ".join(r.problems), style="bold red")
                elif c.verify_problems:
                    out.append("does not match its manifest: " + "; ".join(c.verify_problems), style="bold red")
                elif c.kind == "tmp" and self._live:
                    out.append("a save in progress (the running trainer renames it into place when complete)",
                               style="yellow")
                elif c.reason:
                    out.append(c.reason, style="red")
                elif not c.resumable and c.kind != "tmp":
                    out.append("weights only: export or warm-start it; it cannot resume a run", style="dim")
                else:
                    out.append("complete; resumable", style="green")
                old = self._earlier_result(c.name) if r is None else None
                if old is not None:
                    verdict = "verified ✓" if old.ok else "FAILED: " + "; ".join(old.problems)
                    out.append(f"\nthe earlier {c.name} (step {old.step}, replaced since): {verdict}", style="dim")
                out.append(f"\n{c.path}", style="dim")
        self.detail_text = out.plain
        self.query_one("#ckpt-detail", Static).update(out)

    def action_verify(self) -> None:
        c = self.highlighted()
        if c is None:
            self.notify("no checkpoint highlighted", severity="warning")
            return
        ident = self._ids.get(c.name) or candidate_identity(c)
        if ident in self._running:
            return
        self._running.add(ident)
        self.results.pop(ident, None)
        self._draw()
        self._verify(Path(c.path).parent, c.name, ident)

    @work(thread=True, group="verify")
    def _verify(self, model_dir: Path, name: str, ident: tuple[Any, ...]) -> None:
        try:
            result = verify_checkpoint(model_dir, name)
        except Exception as e:  # unreadable files: report, never crash
            result = VerifyResult(name, ident, None, "failed", [_error_line(e)])
        self.app.call_from_thread(self._verified_done, ident, result)

    def _verified_done(self, ident: tuple[Any, ...], r: VerifyResult) -> None:
        self._running.discard(ident)
        self.results[r.identity] = r
        if r.identity != ident:
            # The row showed a generation that a save replaced before it was read: the result
            # is the newer one's; say so on the old row and read the run again.
            step = "?" if r.step is None else r.step
            self.results[ident] = VerifyResult(r.name, ident, None, "changed",
                                               [f"replaced by a newer {r.name} (step {step}) before it was "
                                                "checked; its result is shown on its row"])
            self.post_message(RefreshRun())
        if not _visible(self):  # shown in the row and the detail line; a toast only when they are hidden
            if r.outcome == "ok":
                self.notify(f"{r.name} (step {r.step}): every file matches its manifest", title="verified")
            elif r.outcome == "failed":
                self.notify(f"{r.name}: {'; '.join(r.problems)}", title="verify failed", severity="error")
        self._draw()

    def action_export(self) -> None:
        c = self.highlighted()
        if c is None:
            self.notify("no checkpoint highlighted", severity="warning")
            return
        self.post_message(OpenView("export", c.name))

    def action_topology(self) -> None:
        c = self.highlighted()
        if c is None:
            self.notify("no checkpoint highlighted", severity="warning")
            return
        self.post_message(OpenView("topology", c.name))


# --------------------------------------------------------------- topology
class TopologyView(Vertical):
    """Recorded vs. planned (world size, workers, config, versions) and the resume-policy row."""

    def compose(self) -> ComposeResult:
        with Horizontal(id="plan-inputs"):
            yield Label("world size", classes="plan-label")
            yield Input("", type="integer", id="plan-ws", compact=True, placeholder="as run")
            yield Label("workers", classes="plan-label")
            yield Input("", type="integer", id="plan-workers", compact=True, placeholder="config")
            yield Label("overrides", classes="plan-label")
            yield Input("", id="plan-overrides", compact=True, placeholder="key=value …")
        with VerticalScroll(id="topo-body"):
            yield Static("", id="topo-out")

    def on_mount(self) -> None:
        self.run_dir: Path | None = None  # from the first snapshot
        self.candidate: str | None = None  # None: what resume would pick
        self._workers_edited = False
        self._timer = None
        self._cands_key: Any = None
        self.result_text = ""

    def show(self, snap: RunSnapshot) -> None:
        self.run_dir = snap.run_dir
        if not self._workers_edited and snap.config:
            workers = (snap.config.get("data") or {}).get("num_workers")
            box = self.query_one("#plan-workers", Input)
            if isinstance(workers, int) and box.value != str(workers):
                with box.prevent(Input.Changed):
                    box.value = str(workers)
        if snap.candidates_key != self._cands_key:
            self._cands_key = snap.candidates_key
            self.recompute()

    def select(self, name: str | None) -> None:
        self.candidate = name
        self.recompute()

    @on(Input.Changed)
    def _changed(self, event: Input.Changed) -> None:
        if event.input.id == "plan-workers":
            self._workers_edited = True
        if self._timer is not None:
            self._timer.stop()
        self._timer = self.set_timer(0.3, self.recompute)

    def plan_args(self) -> tuple[int | None, int | None, list[str]] | str:
        ws_text = self.query_one("#plan-ws", Input).value.strip()
        wk_text = self.query_one("#plan-workers", Input).value.strip()
        try:
            ws = int(ws_text) if ws_text else None  # None: the run's recorded launch
            workers = int(wk_text) if wk_text else None
        except ValueError:
            return "world size and workers must be whole numbers"
        try:
            overrides = shlex.split(self.query_one("#plan-overrides", Input).value)
        except ValueError as e:
            return f"overrides: {e}"
        return ws, workers, overrides

    def recompute(self) -> None:
        if self.run_dir is None:  # before the first read of the run
            return
        args = self.plan_args()
        if isinstance(args, str):
            self._render_error(args)
            return
        self._compute(self.run_dir, *args, self.candidate)

    @work(thread=True, exclusive=True, group="topology")
    def _compute(self, run_dir: Path, ws: int | None, workers: int | None, overrides: list[str],
                 candidate: str | None) -> None:
        try:
            diff = resume_diff(run_dir, world_size=ws, workers=workers, overrides=overrides,
                               candidate=candidate)
            result: Any = diff
        except Exception as e:  # PimmError (bad override, no checkpoint) and anything unexpected
            result = _error_line(e)
        if not get_current_worker().is_cancelled:
            self.app.call_from_thread(self._show_result, result)

    def _render_error(self, message: str) -> None:
        self.result_text = message
        self.query_one("#topo-out", Static).update(Text(message, style="bold red"))

    def _show_result(self, result: Any) -> None:
        if isinstance(result, str):
            self._render_error(result)
            return
        d = result
        c = d.candidate
        out = Table.grid(padding=(0, 1))
        out.add_column()
        head = Text()
        head.append(f"{c['name']}", style="bold")
        head.append(f"  step {c.get('step')}, epoch {c.get('epoch')}, iter {c.get('iter')}")
        head.append("  ▶ resume's pick" if d.selected_by == "resume" else "  (chosen in Checkpoints)",
                    style="green" if d.selected_by == "resume" else "yellow")
        out.add_row(head)
        table = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold")
        table.add_column("")
        table.add_column("recorded", overflow="fold")
        table.add_column("planned", overflow="fold")
        table.add_column("")
        for key, label in DIFF_ROWS:
            a, b = d.recorded.get(key), d.planned.get(key)
            changed = a is not None and b is not None and a != b
            table.add_row(label, "-" if a is None else str(a),
                          Text(planned_text(key, b), style="dim") if b is None else str(b),
                          Text("changed", style="bold yellow") if changed else "")
        out.add_row(table)
        diff = Text()
        diff.append("config diff: ", style="bold")
        diff.append("none" if not d.config_diff else "\n  " + "\n  ".join(d.config_diff))
        out.add_row(diff)
        pol = Text()
        for i, (label, text, tone) in enumerate(d.policy_rows()):  # the rows `pimm checkpoints diff` prints
            if i:
                pol.append("\n")
            pol.append(f"{label}: ", style="dim" if tone == "dim" else "bold")
            pol.append(text, style=TONE_STYLE[tone])
        out.add_row(pol)
        self.result_text = "\n".join(d.lines())
        self.query_one("#topo-out", Static).update(out)


# ----------------------------------------------------------------- export
class ExportView(Vertical):
    """A form that exports one weight set of a checkpoint with pimm_core's export()."""

    def compose(self) -> ComposeResult:
        with Horizontal(classes="form-row"):
            yield Label("checkpoint", classes="form-label")
            yield Select([], id="exp-cand", compact=True, prompt="(no complete checkpoint)")
        with Horizontal(classes="form-row"):
            yield Label("weights", classes="form-label")
            yield Select([("raw", "raw"), ("ema", "ema")], value="raw", allow_blank=False, compact=True,
                         id="exp-weights")
        with Horizontal(classes="form-row"):
            yield Label("format", classes="form-label")
            yield Select([("safetensors", "safetensors"), ("bin", "bin")], value="safetensors",
                         allow_blank=False, compact=True, id="exp-format")
        with Horizontal(classes="form-row"):
            yield Label("destination", classes="form-label")
            yield Input("", id="exp-dest", compact=True)
        with Horizontal(classes="form-row"):
            yield Label("", classes="form-label")
            yield Checkbox("replace a non-empty destination", id="exp-force", compact=True)
        with Horizontal(classes="form-row", id="exp-actions"):
            yield Label("", classes="form-label")
            yield Button("Export", id="exp-go", variant="primary", compact=True)
            yield ProgressBar(total=None, show_eta=False, show_percentage=False, id="exp-progress")
        yield Static("", id="exp-result")

    def on_mount(self) -> None:
        self.run_dir: Path | None = None  # from the first snapshot
        self._names: list[str] = []
        self._dest_auto = True
        self.running = False
        self.last_result: dict[str, Any] | None = None
        self.last_error: str | None = None
        self.query_one("#exp-progress", ProgressBar).display = False

    def show(self, snap: RunSnapshot) -> None:
        self.run_dir = snap.run_dir
        names = [c.name for c in snap.candidates if c.complete and c.kind != "tmp"]
        if names == self._names:
            return
        sel = self.query_one("#exp-cand", Select)
        current = sel.value if sel.value is not Select.NULL else None
        labels = {c.name: f"{c.name} (step {c.step})" if c.step is not None else c.name for c in snap.candidates}
        with sel.prevent(Select.Changed):
            sel.set_options([(labels[n], n) for n in names])
            if current in names:
                sel.value = current
            elif names:
                sel.value = snap.chosen if snap.chosen in names else names[0]
        self._names = names
        self._default_dest()

    def prefill(self, name: str) -> None:
        sel = self.query_one("#exp-cand", Select)
        if name in self._names:
            sel.value = name
        else:
            self.notify(f"{name} is not a complete checkpoint; it cannot be exported", severity="warning")
        self._default_dest()

    def _default_dest(self) -> None:
        if not self._dest_auto:
            return
        sel = self.query_one("#exp-cand", Select)
        weights = self.query_one("#exp-weights", Select).value
        if sel.value is Select.NULL or self.run_dir is None:
            return
        stem = str(sel.value).removesuffix(".pth")
        box = self.query_one("#exp-dest", Input)
        with box.prevent(Input.Changed):
            box.value = str(self.run_dir / "export" / f"{stem}-{weights}")

    @on(Select.Changed)
    def _select_changed(self) -> None:
        self._default_dest()

    @on(Input.Changed, "#exp-dest")
    def _dest_changed(self) -> None:
        self._dest_auto = False

    @on(Button.Pressed, "#exp-go")
    def _go(self) -> None:
        self.start_export()

    def start_export(self) -> bool:
        if self.running:
            self.notify("an export is already running", severity="warning")
            return False
        if self.run_dir is None:
            self._result(Text("the run has not been read yet", style="bold red"))
            return False
        sel = self.query_one("#exp-cand", Select)
        if sel.value is Select.NULL:
            self._result(Text("choose a complete checkpoint first", style="bold red"))
            return False
        dest = self.query_one("#exp-dest", Input).value.strip()
        if not dest:
            self._result(Text("choose a destination directory", style="bold red"))
            return False
        name = str(sel.value)
        weights = str(self.query_one("#exp-weights", Select).value)
        fmt = str(self.query_one("#exp-format", Select).value)
        force = self.query_one("#exp-force", Checkbox).value
        dest_path = Path(dest).expanduser()
        if not dest_path.is_absolute():
            dest_path = Path.cwd() / dest_path
        self.running = True
        self.last_result, self.last_error = None, None
        self.query_one("#exp-go", Button).disabled = True
        self.query_one("#exp-progress", ProgressBar).display = True
        self._result(Text(f"exporting {name} ({weights}, {fmt}) to {dest_path}…", style="yellow"))
        self._export(self.run_dir, name, weights, fmt, dest_path, force)
        return True

    def _result(self, text: Text) -> None:
        self.query_one("#exp-result", Static).update(text)

    def _progress(self, message: str) -> None:
        self._result(Text(message, style="yellow"))

    @work(thread=True, group="export")
    def _export(self, run_dir: Path, name: str, weights: str, fmt: str, dest: Path, force: bool) -> None:
        start = time.perf_counter()
        source = Path(run_dir) / "model" / name
        try:
            self.app.call_from_thread(self._progress, f"loading torch to read {name}…")
            import json

            from pimm_core.checkpoint.export import EXPORT_JSON, export

            self.app.call_from_thread(self._progress, f"exporting {name} ({weights} weights, {fmt}) to {dest}…")
            out = export(str(source), dest, weights=weights, fmt=fmt, run_dir=Path(run_dir), force=force)
            record = json.loads((out / EXPORT_JSON).read_text(encoding="utf-8"))
            self.app.call_from_thread(self._done, record, None, time.perf_counter() - start, out)
        except BaseException as e:  # noqa: BLE001 - shown to the operator, never raised into the UI
            self.app.call_from_thread(self._done, None, _error_line(e), time.perf_counter() - start, dest)

    def _done(self, record: dict[str, Any] | None, error: str | None, took: float, dest: Path) -> None:
        self.running = False
        self.query_one("#exp-go", Button).disabled = False
        self.query_one("#exp-progress", ProgressBar).display = False
        if error is not None:
            self.last_error = error
            t = Text("export failed: ", style="bold red")
            t.append(error, style="red")
            self._result(t)
            if not _visible(self):  # the result line says it; a toast only when it is hidden
                self.notify(error, title="export failed", severity="error")
            return
        assert record is not None
        self.last_result = record
        files = [record["file"], *([record["config"]] if record.get("config") else []), "export.json"]
        t = Text("exported ", style="bold green")
        t.append(f"{record.get('weights')} weights, step {record.get('step')}, {record.get('num_tensors')} tensors "
                 f"in {took:.1f} s\n")
        t.append(f"to {dest}: {', '.join(files)}\n")
        t.append(f"sha256 {record.get('sha256', '')[:16]}…", style="dim")
        self._result(t)
        if not _visible(self):
            self.notify(f"{dest}", title="exported")
