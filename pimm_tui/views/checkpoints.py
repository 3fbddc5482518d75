"""The Checkpoints view: every candidate in model/, which one resume picks; verify, export, topology."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import events, on, work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from pimm_core.checkpoint.select.selection import Candidate
from pimm_core.text import clean_text, plain_text, printable
from pimm_core.watch.candidates import VerifyResult, candidate_age, candidate_identity, verify_checkpoint
from pimm_core.watch.fmt import fmt_age, fmt_size
from pimm_core.watch.snapshot import RunSnapshot

from ..fmt import error_line, fmt_num, nonfinite
from .common import OpenView, RefreshRun, visible

#: Views narrower than this drop the Checkpoints table's format and epoch columns (the detail line shows them).
WIDE_TABLE = 100


def _problem_kind(problem: str) -> str:
    for word in ("sha256", "missing", "size", "incomplete"):
        if word in problem:
            return word
    return "see below"


class CheckpointTable(DataTable):
    """The Checkpoints table: its cursor is the operator's selection. With the selection cleared
    (``show_cursor`` off: the selected checkpoint was removed) no row is highlighted; the first
    navigation key or a click shows the cursor again, on the first row (down, home), the last
    (up, end) or the row clicked, never on a row the operator did not choose."""

    def _reveal(self, row: int | None) -> bool:
        """Show a hidden cursor at ``row`` (None: where it is); True when it was hidden."""
        if self.show_cursor:
            return False
        if row is not None and self.row_count:
            self.move_cursor(row=row, animate=False)
        self.show_cursor = True  # posts RowHighlighted: the view takes it as the new selection
        return True

    def action_cursor_down(self) -> None:
        if not self._reveal(0):
            super().action_cursor_down()

    def action_cursor_up(self) -> None:
        if not self._reveal(self.row_count - 1):
            super().action_cursor_up()

    def action_scroll_top(self) -> None:
        self._reveal(0)
        super().action_scroll_top()

    def action_scroll_bottom(self) -> None:
        self._reveal(self.row_count - 1)
        super().action_scroll_bottom()

    async def _on_click(self, event: events.Click) -> None:
        meta = event.style.meta
        if not self.show_cursor and meta.get("row", -1) >= 0:
            self._reveal(meta["row"])
        await super()._on_click(event)


class CheckpointsView(Vertical):
    """Every candidate in model/, which one resume picks; verify / export / topology actions.

    The highlighted row is the operator's selection (what ``v``, ``e`` and ``t`` act on), kept by
    name across refreshes: when rotation removes the selected checkpoint, the selection is
    cleared visibly (no row highlighted, the detail line says so) rather than moved to another
    row, and the actions ask for a selection first.

    A verify result belongs to the checkpoint generation that was hashed
    (:func:`~pimm_core.watch.candidates.candidate_identity`: name, manifest created time, step), not
    to the row name: when ``last`` is replaced by a newer save, its row shows the newer
    checkpoint unverified, and the older one's result is kept for it.
    """

    # Its keys (v, e, t) are the console's, shown while this tab is active.

    def compose(self) -> ComposeResult:
        yield CheckpointTable(id="ckpt-table", cursor_type="row", zebra_stripes=True)
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
        self.selected: str | None = None  # the operator's selection (a row name), kept across refreshes
        self._selection_made = False  # a first selection was set (resume's choice, by default)
        self._lost: str | None = None  # the selected checkpoint that rotation removed (selection cleared)

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
            table.add_column(plain_text(label), key=key)  # the metric's name is user text: never markup
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
        current = self.highlighted()  # a key just moved the cursor: that row is the selection
        if current is not None:
            self.selected = current.name
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
            cells += [Text(fmt_num(value), style="bold red" if nonfinite(value) else ""), fmt_size(c.size),
                      fmt_age(candidate_age(c)), self._status_cell(c)]
            table.add_row(*(clean_text(cell) for cell in cells), key=c.name)  # a file name is never markup
        names = list(self._cands)
        if self.selected is None and not self._selection_made and names:
            # the first view of the run: resume's choice is selected (else the first row)
            self.selected = self._chosen if self._chosen in names else names[0]
            self._selection_made = True
        if self.selected is not None and self.selected in names:
            table.move_cursor(row=names.index(self.selected), animate=False)
        elif self.selected is not None:  # removed (rotation): clear the selection, never move it to another row
            self._lost, self.selected = self.selected, None
            table.show_cursor = False
        self._detail()

    def highlighted(self) -> Candidate | None:
        """The selected checkpoint (the highlighted row), or None: no rows, or the selection cleared."""
        table = self.query_one(DataTable)
        if not self._cands or table.row_count == 0 or not table.show_cursor:
            return None
        try:
            key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        except Exception:
            return None
        return self._cands.get(str(key.value)) if key is not None else None

    @on(DataTable.RowHighlighted)
    def _on_highlight(self) -> None:
        c = self.highlighted()  # the row the cursor is on now (a redraw has put it back on the selection)
        if c is not None:
            self.selected, self._lost = c.name, None
        self._detail()

    def _detail(self) -> None:
        out = Text()
        if not self._cands:
            out.append("no checkpoints (model/ is missing or empty)", style="dim")
        else:
            out.append("▶ ", style="bold green")
            out.append(f"resume would load: {self._chosen or 'nothing (no complete resumable candidate)'}")
            c = self.highlighted()
            if c is None and self._lost is not None:
                out.append(f"\nno checkpoint selected: {self._lost} was removed; "
                           "select one with ↑/↓", style="yellow")
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
        self.query_one("#ckpt-detail", Static).update(clean_text(out))

    def action_verify(self) -> None:
        c = self.highlighted()
        if c is None:
            self.notify("select a checkpoint first (↑/↓)", severity="warning")
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
            result = VerifyResult(name, ident, None, "failed", [error_line(e)])
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
        if not visible(self):  # shown in the row and the detail line; a toast only when they are hidden
            if r.outcome == "ok":
                self.notify(printable(f"{r.name} (step {r.step}): every file matches its manifest"), title="verified",
                            markup=False)
            elif r.outcome == "failed":
                self.notify(printable(f"{r.name}: {'; '.join(r.problems)}"), title="verify failed", severity="error",
                            markup=False)
        self._draw()

    def action_export(self) -> None:
        c = self.highlighted()
        if c is None:
            self.notify("select a checkpoint first (↑/↓)", severity="warning")
            return
        self.post_message(OpenView("export", c.name))

    def action_topology(self) -> None:
        c = self.highlighted()
        if c is None:
            self.notify("select a checkpoint first (↑/↓)", severity="warning")
            return
        self.post_message(OpenView("topology", c.name))
