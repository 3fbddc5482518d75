"""The Topology view: recorded vs. planned launch of a checkpoint, and what its resume would do."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Input, Label, Static
from textual.worker import get_current_worker

from pimm_core.text import clean_text, plain_text
from pimm_core.watch.resume_diff import DIFF_ROWS, planned_text, resume_diff
from pimm_core.watch.snapshot import RunSnapshot

from ..fmt import error_line

#: Colours of the resume-policy rows' tones (:func:`pimm_core.watch.resume_diff.plan_rows`).
TONE_STYLE = {"plain": "", "info": "cyan", "ok": "green", "bad": "red", "warn": "yellow", "dim": "dim"}


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
            result = error_line(e)
        if not get_current_worker().is_cancelled:
            self.app.call_from_thread(self._show_result, result)

    def _render_error(self, message: str) -> None:
        self.result_text = message
        self.query_one("#topo-out", Static).update(plain_text(message, style="bold red"))

    def _show_result(self, result: Any) -> None:
        if isinstance(result, str):
            self._render_error(result)
            return
        d = result
        c = d.candidate
        out = Table.grid(padding=(0, 1))
        out.add_column()
        head = Text()
        head.append(str(c['name']), style="bold")
        head.append(f"  step {c.get('step')}, epoch {c.get('epoch')}, iter {c.get('iter')}")
        head.append("  ▶ resume's pick" if d.selected_by == "resume" else "  (chosen in Checkpoints)",
                    style="green" if d.selected_by == "resume" else "yellow")
        out.add_row(clean_text(head))
        table = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold")
        table.add_column("")
        table.add_column("recorded", overflow="fold")
        table.add_column("planned", overflow="fold")
        table.add_column("")
        for key, label in DIFF_ROWS:
            a, b = d.recorded.get(key), d.planned.get(key)
            changed = a is not None and b is not None and a != b
            # recorded and planned values are user text (a config's lists print as "[...]"): never markup
            table.add_row(plain_text(label), plain_text("-" if a is None else a),
                          plain_text(planned_text(key, b), style="dim") if b is None else plain_text(b),
                          Text("changed", style="bold yellow") if changed else "")
        out.add_row(table)
        diff = Text()
        diff.append("config diff: ", style="bold")
        diff.append("none" if not d.config_diff else "\n  " + "\n  ".join(d.config_diff))
        out.add_row(clean_text(diff))
        pol = Text()
        for i, (label, text, tone) in enumerate(d.policy_rows()):  # the rows `pimm checkpoints diff` prints
            if i:
                pol.append("\n")
            pol.append(f"{label}: ", style="dim" if tone == "dim" else "bold")
            pol.append(text, style=TONE_STYLE[tone])
        out.add_row(clean_text(pol))
        self.result_text = "\n".join(d.lines())
        self.query_one("#topo-out", Static).update(out)
