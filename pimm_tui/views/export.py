"""The Export view: a form that exports one weight set of a checkpoint with pimm_core's export()."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Checkbox, Input, Label, ProgressBar, Select, Static

from pimm_core.text import clean_text, plain_text, printable
from pimm_core.watch.snapshot import RunSnapshot

from ..fmt import error_line
from .common import visible


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
            yield Checkbox("replace a previous export", id="exp-force", compact=True)
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
            sel.set_options([(plain_text(labels[n]), n) for n in names])  # file names are never markup
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
            self.notify(printable(f"{name} is not a complete checkpoint; it cannot be exported"), severity="warning",
                        markup=False)
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
        self.query_one("#exp-result", Static).update(clean_text(text))

    def _progress(self, message: str) -> None:
        self._result(Text(message, style="yellow"))

    @work(thread=True, group="export")
    def _export(self, run_dir: Path, name: str, weights: str, fmt: str, dest: Path, force: bool) -> None:
        start = time.perf_counter()
        source = Path(run_dir) / "model" / name
        try:
            self.app.call_from_thread(self._progress, f"loading torch to read {name}…")
            import json

            from pimm_core.checkpoint.export.model_dir import EXPORT_JSON, export

            self.app.call_from_thread(self._progress, f"exporting {name} ({weights} weights, {fmt}) to {dest}…")
            out = export(str(source), dest, weights=weights, fmt=fmt, run_dir=Path(run_dir), force=force)
            record = json.loads((out / EXPORT_JSON).read_text(encoding="utf-8"))
            self.app.call_from_thread(self._done, record, None, time.perf_counter() - start, out)
        except BaseException as e:  # noqa: BLE001 - shown to the operator, never raised into the UI
            self.app.call_from_thread(self._done, None, error_line(e), time.perf_counter() - start, dest)

    def _done(self, record: dict[str, Any] | None, error: str | None, took: float, dest: Path) -> None:
        self.running = False
        self.query_one("#exp-go", Button).disabled = False
        self.query_one("#exp-progress", ProgressBar).display = False
        if error is not None:
            self.last_error = error
            t = Text("export failed: ", style="bold red")
            t.append(error, style="red")
            self._result(t)
            if not visible(self):  # the result line says it; a toast only when it is hidden
                self.notify(printable(error), title="export failed", severity="error", markup=False)
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
        if not visible(self):
            self.notify(printable(dest), title="exported", markup=False)
