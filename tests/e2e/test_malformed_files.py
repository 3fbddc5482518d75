"""Files of a run that are malformed (issue 21): a warning or one line naming the file and what
is wrong, never a traceback; history pimm keeps is set aside, never overwritten.

- A manifest with wrong types or missing keys (``files`` a list, ``step`` a string, no
  ``step``, a files entry without its sha256, not an object, nested too deeply): the
  candidate is ``invalid manifest: <what>`` in ``checkpoints ls/latest/verify/diff``,
  ``resume --dry-run`` and the console (which stays live, stop enabled), and selection
  passes over it to the intact ``last.prev``.
- ``provenance.json`` that is not a record (``starts`` a string, truncated, a JSON list):
  the resume keeps it as ``provenance.json.corrupt-1``, warns once, starts a new record.
- A ``metrics.jsonl`` line nested 5,000 deep: the resume skips it with a warning.

The commands run in this process (``pimm_here``): a traceback would escape ``main()``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from _helpers import describe, pimm_here, read_json
from conftest import TrainedRun

DEEP = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"

# (id, how the manifest of `last` is broken, what the reason says)
BROKEN = [
    ("files-a-list", lambda m: {**m, "files": list(m["files"])}, '"files" is a list, not a mapping'),
    ("step-a-string", lambda m: {**m, "step": "120"}, '"step" is a string, not an integer'),
    ("no-step", lambda m: {k: v for k, v in m.items() if k != "step"}, 'missing "step"'),
    ("no-sha256", lambda m: {**m, "files": {k: {"size": v["size"]} for k, v in m["files"].items()}},
     '"files" entry "trainer.dcp/.complete" has no sha256'),
    ("metrics-a-list", lambda m: {**m, "metrics": [1, 2]}, '"metrics" is a list, not a mapping'),
    ("a-list", lambda m: [m], "a list, not a JSON object"),
    ("too-deep", None, "nested too deeply"),
]


def _break_last(run: Path, change) -> Path:
    """``model/last.prev`` = an intact copy of ``last``; then ``last``'s manifest broken by ``change``."""
    model = run / "model"
    shutil.copytree(model / "last", model / "last.prev")
    manifest = model / "last" / "manifest.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(DEEP if change is None else json.dumps(change(m)))
    return model


def _ok(result, code: int = 0) -> str:
    assert result.returncode == code and "Traceback" not in result.stderr, describe(result)
    return result.stdout + result.stderr


@pytest.mark.parametrize("name,change,what", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_malformed_manifest_is_one_reason_everywhere_and_selection_passes_over_it(
        trained_run: TrainedRun, tmp_path: Path, name, change, what) -> None:
    run = trained_run.copy_to(tmp_path)
    model = _break_last(run, change)

    listed = json.loads(_ok(pimm_here("checkpoints", "ls", str(run), "--json")))
    by_name = {c["name"]: c for c in listed["candidates"]}
    assert by_name["last"]["complete"] is False and f"invalid manifest: {what}" in by_name["last"]["reason"]
    assert listed["selected"] == "last.prev"
    assert by_name["last.prev"]["step"] == 135  # the intact copy of the run's last

    latest = pimm_here("checkpoints", "latest", str(model), "--explain")
    assert _ok(latest).count("\n") and latest.stdout.strip() == str(model / "last.prev")
    assert f"last: rejected: invalid manifest: {what}" in latest.stderr

    verify = pimm_here("checkpoints", "verify", str(run))
    assert f"last: cannot verify (invalid manifest: {what}" in _ok(verify, code=1)

    assert "last.prev" in _ok(pimm_here("checkpoints", "diff", str(run)))
    dry = _ok(pimm_here("resume", str(run), "--dry-run", "--", "train.epochs=4"))
    assert f"checkpoint: {model / 'last.prev'} (step 135" in dry


def test_a_malformed_manifest_alone_is_no_checkpoint_one_line(trained_run: TrainedRun, tmp_path: Path) -> None:
    run = trained_run.copy_to(tmp_path)
    manifest = run / "model" / "last" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "step": "x"}))
    out = _ok(pimm_here("resume", str(run), "--", "train.epochs=4"), code=2)
    assert out.count("error:") == 1 and 'last: rejected: invalid manifest: "step" is a string' in out


@pytest.mark.asyncio
async def test_the_console_shows_a_live_run_whose_manifest_has_wrong_types(trained_run: TrainedRun,
                                                                           tmp_path: Path) -> None:
    from tui_support import loaded, make_app, screen_text

    run = trained_run.copy_to(tmp_path)
    manifest = run / "model" / "last" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "files": ["weights.pth"], "step": "x"}))
    status = read_json(run / "status.json")
    status.update(state="running", pid=os.getpid(), pids=[os.getpid()], heartbeat=time.time())
    (run / "status.json").write_text(json.dumps(status))
    app = make_app(run)
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot)
        assert "damaged manifest: last" in screen_text(app), screen_text(app)
        assert app.check_action("stop", ()) is True  # live: stop enabled
        for tab in "21":
            await pilot.press(tab)
            await pilot.pause(0.05)
        await loaded(pilot)
        assert app.poll_error is None and app.is_running
    last = next(c for c in app.snapshot.candidates if c.name == "last")
    assert last.manifest is None and last.reason.startswith("invalid manifest:")


PROVENANCE = [
    ("starts-a-string", lambda text: json.dumps({**json.loads(text), "starts": "oops"})),
    ("truncated", lambda text: text[: len(text) // 2]),
    ("a-list", lambda text: json.dumps([json.loads(text)])),
]


@pytest.mark.parametrize("name,damage", PROVENANCE, ids=[p[0] for p in PROVENANCE])
def test_provenance_that_is_not_a_record_is_kept_aside_once(trained_run: TrainedRun, tmp_path: Path,
                                                            name, damage) -> None:
    run = trained_run.copy_to(tmp_path)
    bad = damage((run / "provenance.json").read_text()).encode()
    (run / "provenance.json").write_bytes(bad)
    first = pimm_here("resume", str(run), "--", "train.epochs=4")
    _ok(first)
    assert (run / "provenance.json.corrupt-1").read_bytes() == bad  # the history, kept as it was
    starts = read_json(run / "provenance.json")["starts"]
    assert [e["kind"] for e in starts] == ["resume"] and starts[0]["checkpoint_step"] == 135
    log = (run / "train.log").read_text()
    assert log.count("kept it as provenance.json.corrupt-1") == 1
    if name == "truncated":  # the new record is appended to from now on: no second warning, nothing more set aside
        _ok(pimm_here("resume", str(run), "--", "train.epochs=5"))
        assert (run / "train.log").read_text().count("kept it as provenance.json.corrupt") == 1
        assert not (run / "provenance.json.corrupt-2").exists()
        assert [e["kind"] for e in read_json(run / "provenance.json")["starts"]] == ["resume", "resume"]


def test_a_metrics_line_nested_too_deeply_is_skipped_by_the_resume(trained_run: TrainedRun, tmp_path: Path) -> None:
    run = trained_run.copy_to(tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(DEEP + "\n")
    out = _ok(pimm_here("resume", str(run), "--", "train.epochs=4"))
    assert "metrics.jsonl: 1 damaged line(s) skipped" in out
    assert "resume check: restored step 135" in (run / "train.log").read_text()
    assert read_json(run / "status.json")["state"] == "finished"
