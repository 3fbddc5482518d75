"""The console's views: Live, Checkpoints, Topology, Export.

Each view gets the newest :class:`~pimm_core.runview.RunSnapshot` through ``show()``
(on the event loop) and redraws only what changed. Slow work (sha256, the resume
diff, export) runs in thread workers; nothing here reads files on the event loop.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Checkbox, DataTable, Input, Label, ProgressBar, RichLog, Select, Static
from textual.worker import get_current_worker

from pimm_core.checkpoint.selection import Candidate
from pimm_core.errors import PimmError
from pimm_core.runview import DIFF_ROWS, RunSnapshot, candidate_age, human_duration, resume_diff, verify_candidate

from .widgets import MetricPlot, fmt_age, fmt_num, fmt_rate, fmt_size

if TYPE_CHECKING:
    from .app import PimmConsole

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
            yield MetricPlot("loss (train) vs step", "cyan", id="loss-plot")
            yield MetricPlot("learning rate vs step", "magenta", id="lr-plot")
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
            t.append(f"loss {fmt_num(tr.get('loss'))}  lr {fmt_num(tr.get('lr'))}")
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
            t.append(f"epoch {v.get('epoch', '?')} step {v.get('step', '?')}: "
                     f"loss {fmt_num(v.get('loss'))} acc {fmt_num(v.get('acc'))}")
            if snap.best_val:
                b = snap.best_val
                t.append("  best ", style="bold")
                t.append(f"{key} {fmt_num(b.get(key))} (epoch {b.get('epoch', '?')})", style="green")
        else:
            t.append("\nno evaluation yet", style="dim")
        self.query_one("#stats", Static).update(t)

        if snap.metrics_version != self._metrics_version:
            self._metrics_version = snap.metrics_version
            self.query_one("#loss-plot", MetricPlot).set_data(*snap.loss)
            self.query_one("#lr-plot", MetricPlot).set_data(*snap.lr)
        if snap.log_version != self._log_version:
            self._log_version = snap.log_version
            log = self.query_one("#log", RichLog)
            log.clear()
            for line in snap.log_lines[-60:]:
                log.write(_LOG_PREFIX.sub(r"\1 ", line))


# ------------------------------------------------------------ checkpoints
class CheckpointsView(Vertical):
    """Every candidate in model/, which one resume picks; verify / export / topology actions."""

    BINDINGS = [
        Binding("v", "verify", "Verify"),
        Binding("e", "export", "Export"),
        Binding("t", "topology", "Topology"),
    ]

    app: "PimmConsole"

    def compose(self) -> ComposeResult:
        yield DataTable(id="ckpt-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="ckpt-detail")

    def on_mount(self) -> None:
        self._key: Any = None
        self._metric: str | None = None
        self._cands: dict[str, Candidate] = {}
        self._chosen: str | None = None
        self._verified: dict[str, tuple[str, list[str]]] = {}  # name -> (state, problems)
        self._drawn_at = 0.0

    def _columns(self, metric: str) -> None:
        table = self.query_one(DataTable)
        table.clear(columns=True)
        for label, key in (("", "mark"), ("name", "name"), ("format", "format"), ("step", "step"),
                           ("epoch", "epoch"), (metric, "metric"), ("size", "size"), ("age", "age"),
                           ("status", "status")):
            table.add_column(label, key=key)
        self._metric = metric

    def _status_cell(self, c: Candidate) -> Text:
        v = self._verified.get(c.name)
        if v is not None:
            state, problems = v
            if state == "running":
                return Text("verifying…", style="yellow")
            if not problems:
                return Text("verified ✓", style="bold green")
            return Text(f"FAILED: {problems[0]}", style="bold red")
        if c.complete:
            return Text("complete", style="green")
        return Text(c.reason or "incomplete", style="red")

    def show(self, snap: RunSnapshot, force: bool = False) -> None:
        if snap.metric != self._metric:
            self._columns(snap.metric)
            self._key = None
        now = time.time()
        if not force and snap.candidates_key == self._key and now - self._drawn_at < 10:
            return
        self._key, self._drawn_at = snap.candidates_key, now
        self._cands = {c.name: c for c in snap.candidates}
        self._chosen = snap.chosen
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
            table.add_row(mark, c.name, c.format, "-" if c.step is None else str(c.step),
                          "-" if c.epoch is None else str(c.epoch), fmt_num(value), fmt_size(c.size),
                          fmt_age(candidate_age(c)), self._status_cell(c), key=c.name)
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
                v = self._verified.get(c.name)
                if v is not None and v[0] == "done":
                    if v[1]:
                        out.append("verify FAILED: " + "; ".join(v[1]), style="bold red")
                    else:
                        out.append("verified: every file matches its manifest size and sha256", style="green")
                elif c.reason:
                    out.append(c.reason, style="red")
                elif not c.resumable and c.kind != "tmp":
                    out.append("weights only: export or warm-start it; it cannot resume a run", style="dim")
                else:
                    out.append("complete; resumable", style="green")
                out.append(f"\n{c.path}", style="dim")
        self.query_one("#ckpt-detail", Static).update(out)

    def action_verify(self) -> None:
        c = self.highlighted()
        if c is None:
            self.app.notify("no checkpoint highlighted", severity="warning")
            return
        if self._verified.get(c.name, ("",))[0] == "running":
            return
        self._verified[c.name] = ("running", [])
        self._draw()
        self._verify(c)

    @work(thread=True, group="verify")
    def _verify(self, c: Candidate) -> None:
        try:
            problems = verify_candidate(c)
        except Exception as e:  # unreadable files: report, never crash
            problems = [_error_line(e)]
        self.app.call_from_thread(self._verified_done, c, problems)

    def _verified_done(self, c: Candidate, problems: list[str]) -> None:
        self._verified[c.name] = ("done", problems)
        if problems:
            self.app.notify(f"{c.name}: {'; '.join(problems)}", title="verify failed", severity="error")
        else:
            self.app.notify(f"{c.name}: every file matches its manifest", title="verified")
        self._draw()

    def action_export(self) -> None:
        c = self.highlighted()
        if c is None:
            self.app.notify("no checkpoint highlighted", severity="warning")
            return
        self.app.open_export(c.name)

    def action_topology(self) -> None:
        c = self.highlighted()
        if c is None:
            self.app.notify("no checkpoint highlighted", severity="warning")
            return
        self.app.open_topology(c.name)


# --------------------------------------------------------------- topology
class TopologyView(Vertical):
    """Recorded vs. planned (world size, workers, config, versions) and the resume-policy row."""

    app: "PimmConsole"

    def compose(self) -> ComposeResult:
        with Horizontal(id="plan-inputs"):
            yield Label("world size", classes="plan-label")
            yield Input("1", type="integer", id="plan-ws", compact=True)
            yield Label("workers", classes="plan-label")
            yield Input("", type="integer", id="plan-workers", compact=True, placeholder="config")
            yield Label("overrides", classes="plan-label")
            yield Input("", id="plan-overrides", compact=True, placeholder="key=value …")
        with VerticalScroll(id="topo-body"):
            yield Static("", id="topo-out")

    def on_mount(self) -> None:
        self.candidate: str | None = None  # None: what resume would pick
        self._workers_edited = False
        self._timer = None
        self._cands_key: Any = None
        self.result_text = ""

    def show(self, snap: RunSnapshot) -> None:
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

    def plan_args(self) -> tuple[int, int | None, list[str]] | str:
        ws_text = self.query_one("#plan-ws", Input).value.strip()
        wk_text = self.query_one("#plan-workers", Input).value.strip()
        try:
            ws = int(ws_text or "1")
            workers = int(wk_text) if wk_text else None
        except ValueError:
            return "world size and workers must be whole numbers"
        try:
            overrides = shlex.split(self.query_one("#plan-overrides", Input).value)
        except ValueError as e:
            return f"overrides: {e}"
        return ws, workers, overrides

    def recompute(self) -> None:
        args = self.plan_args()
        if isinstance(args, str):
            self._render_error(args)
            return
        self._compute(*args, self.candidate)

    @work(thread=True, exclusive=True, group="topology")
    def _compute(self, ws: int, workers: int | None, overrides: list[str], candidate: str | None) -> None:
        try:
            diff = resume_diff(self.app.run_dir, world_size=ws, workers=workers, overrides=overrides,
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
            table.add_row(label, "-" if a is None else str(a), "checked at launch" if b is None else str(b),
                          Text("changed", style="bold yellow") if changed else "")
        out.add_row(table)
        diff = Text()
        diff.append("config diff: ", style="bold")
        diff.append("none" if not d.config_diff else "\n  " + "\n  ".join(d.config_diff))
        out.add_row(diff)
        p = d.plan
        pol = Text()
        if p is None:
            pol.append("policy: ", style="bold")
            pol.append("weights only: this file cannot resume a run (warm-start it with --train.weight)")
        else:
            pol.append("policy: ", style="bold")
            pol.append(p["description"], style="cyan")
            pol.append("\nrestored: ", style="bold")
            pol.append(", ".join(p["restored"]), style="green")
            pol.append("\ndiscarded: ", style="bold")
            pol.append(", ".join(p["discarded"]) or "nothing", style="red" if p["discarded"] else "green")
            rb = p.get("replay_boundary")
            pol.append("\nreplay boundary: ", style="bold")
            if rb:
                pol.append(f"epoch {rb['epoch']} restarts at step {rb['step']}; the {rb['from_iter']} batches "
                           "already run in that epoch train again", style="yellow")
            else:
                pol.append(f"none: {'exact continuation' if p['exact'] else 'nothing to replay'} at step "
                           f"{p['step']}, epoch {p['epoch']}, iter {p['iter']}", style="green")
            for w in p.get("warnings", []):
                pol.append(f"\nwarning: {w}", style="yellow")
        for n in d.notes:
            pol.append(f"\nnote: {n}", style="dim")
        out.add_row(pol)
        self.result_text = "\n".join(d.lines())
        self.query_one("#topo-out", Static).update(out)


# ----------------------------------------------------------------- export
class ExportView(Vertical):
    """A form that exports one weight set of a checkpoint with pimm_core's export()."""

    app: "PimmConsole"

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
        self._names: list[str] = []
        self._dest_auto = True
        self.running = False
        self.last_result: dict[str, Any] | None = None
        self.last_error: str | None = None
        self.query_one("#exp-progress", ProgressBar).display = False

    def show(self, snap: RunSnapshot) -> None:
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
            self.app.notify(f"{name} is not a complete checkpoint; it cannot be exported", severity="warning")
        self._default_dest()

    def _default_dest(self) -> None:
        if not self._dest_auto:
            return
        sel = self.query_one("#exp-cand", Select)
        weights = self.query_one("#exp-weights", Select).value
        if sel.value is Select.NULL:
            return
        stem = str(sel.value).removesuffix(".pth")
        box = self.query_one("#exp-dest", Input)
        with box.prevent(Input.Changed):
            box.value = str(self.app.run_dir / "export" / f"{stem}-{weights}")

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
            self.app.notify("an export is already running", severity="warning")
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
        self._export(name, weights, fmt, dest_path, force)
        return True

    def _result(self, text: Text) -> None:
        self.query_one("#exp-result", Static).update(text)

    def _progress(self, message: str) -> None:
        self._result(Text(message, style="yellow"))

    @work(thread=True, group="export")
    def _export(self, name: str, weights: str, fmt: str, dest: Path, force: bool) -> None:
        start = time.perf_counter()
        source = Path(self.app.run_dir) / "model" / name
        try:
            self.app.call_from_thread(self._progress, f"loading torch to read {name}…")
            import json

            from pimm_core.checkpoint.export import EXPORT_JSON, export

            self.app.call_from_thread(self._progress, f"exporting {name} ({weights} weights, {fmt}) to {dest}…")
            out = export(str(source), dest, weights=weights, fmt=fmt, run_dir=Path(self.app.run_dir), force=force)
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
            self.app.notify(error, title="export failed", severity="error")
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
        self.app.notify(f"{dest}", title="exported")
