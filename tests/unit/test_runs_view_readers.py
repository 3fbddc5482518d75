"""The runs view's readers (torch-free): the cached runs table, the compare view's bounded series
and config differences."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from pimm_core.watch.compare import MAX_METRICS, config_diff, read_series, samples_per_step
from pimm_core.watch.runs_poll import RunsPoller


def _run(root: Path, name: str, state: str = "finished", *, records=(), config: str = "", **status) -> Path:
    rd = root / "g" / name
    rd.mkdir(parents=True, exist_ok=True)
    (rd / "config.toml").write_text(config or '[train]\nlr = 0.1\n[data]\nbatch_size = 8\n')
    st = {"state": state, "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time(), **status}
    (rd / "status.json").write_text(json.dumps(st))
    with open(rd / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return rd


def _train(step: int, **kw) -> dict:
    return {"step": step, "split": "train", "loss": 1.0 / step, "lr": 0.1, "time": 1000.0 + step, **kw}


def test_poller_reads_again_only_what_changed(tmp_path: Path) -> None:
    done = _run(tmp_path, "done", records=[_train(1), _train(2)], step=2)
    _run(tmp_path, "live", "running", records=[_train(1)], step=1)
    poller = RunsPoller(tmp_path)
    rows = {r.name: r for r in poller.poll()}
    assert rows["g/done"].state == "finished" and rows["g/live"].state == "live" and poller.summarized == 2
    # Unchanged: the finished run keeps its row (older), the live one is read again (its verdict moves).
    again = {r.name: r for r in poller.poll(now=time.time() + 5)}
    assert poller.summarized == 1
    assert again["g/done"].loss == rows["g/done"].loss and again["g/done"].age_s >= rows["g/done"].age_s + 4
    # A finished run whose files change is read again; a new run appears; a removed one goes.
    with open(done / "metrics.jsonl", "a") as f:
        f.write(json.dumps(_train(4)) + "\n")
    _run(tmp_path, "new", records=[_train(1)])
    (tmp_path / "g" / "live" / "status.json").unlink()
    (tmp_path / "g" / "live" / "config.toml").unlink()
    (tmp_path / "g" / "live" / "metrics.jsonl").unlink()
    rows = {r.name: r for r in poller.poll()}
    assert set(rows) == {"g/done", "g/new"} and rows["g/done"].loss == 0.25


def test_read_series_keeps_every_metric_bounded(tmp_path: Path) -> None:
    recs = []
    for s in range(1, 20_001):
        recs.append(_train(s, grad_norm=0.5))
        if s % 1000 == 0:
            recs.append({"step": s, "split": "val", "loss": 2.0 / s, "acc": s / 20_000, "time": 0.0})
    rd = _run(tmp_path, "big", records=recs, config='[train]\ngrad_accum = 2\n[data]\nbatch_size = 8\n', world_size=3)
    rs = read_series(rd, max_points=100, tail_bytes=64 << 10, sample_lines=500)
    assert {"loss", "lr", "grad_norm", "val/loss", "val/acc"} <= set(rs.series)
    xs, ys = rs.series["loss"]
    assert len(xs) <= 101 and xs[0] < 1000 and xs[-1] == 20_000  # early history sampled, newest kept
    assert rs.series["val/acc"][0] == [float(s) for s in range(1000, 20_001, 1000)]  # every evaluation found
    assert rs.samples_per_step == 8 * 2 * 3
    assert rs.config["train.grad_accum"] == 2 and rs.problem is None


def test_read_series_bounds_the_metric_names(tmp_path: Path) -> None:
    rd = _run(tmp_path, "wide", records=[_train(1, **{f"m{i}": float(i) for i in range(200)})])
    assert len(read_series(rd).series) == MAX_METRICS


def test_read_series_of_a_damaged_run(tmp_path: Path) -> None:
    rd = tmp_path / "g" / "bad"
    rd.mkdir(parents=True)
    (rd / "config.toml").write_text("[train\n")
    (rd / "metrics.jsonl").write_text('not json\n{"step": 1, "loss": NaN}\n')
    rs = read_series(rd)
    assert rs.series == {} and rs.config == {} and "config.toml is unreadable" in (rs.problem or "")
    assert rs.samples_per_step is None


def test_config_diff_and_samples_per_step() -> None:
    a = {"run.name": "a", "train.lr": 0.1, "train.epochs": 2, "model.depth": 3}
    b = {"run.name": "b", "train.lr": 0.01, "train.epochs": 2, "data.batch_size": 16}
    assert config_diff(a, b) == [("data.batch_size", None, 16), ("model.depth", 3, None), ("train.lr", 0.1, 0.01)]
    assert config_diff(a, dict(a)) == []
    assert samples_per_step({"data": {"batch_size": 32}}, None) == 32
    assert samples_per_step({"data": {"batch_size": 32}, "train": {"grad_accum": 4}}, 2) == 256
    assert samples_per_step({"train": {"grad_accum": 4}}, 2) is None


def test_pimm_tui_decides_from_the_path(tmp_path: Path) -> None:
    import pytest

    from pimm_core.cli.console import opens_runs_table
    from pimm_core.errors import UsageError

    run = _run(tmp_path, "r")
    assert opens_runs_table(run) is False  # status.json / config.toml: one run
    assert opens_runs_table(tmp_path) is True and opens_runs_table(tmp_path / "g") is True  # a root, a group
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    for bad in (tmp_path / "empty", tmp_path / "missing", run / "status.json"):
        with pytest.raises(UsageError):
            opens_runs_table(bad)


def test_a_diverged_runs_last_loss_reads_nan_or_inf_never_dash(tmp_path: Path) -> None:
    """The LOSS of a run whose last logged loss is NaN or +-Inf says so (``-`` is "nothing
    logged"), in ``pimm runs ls``, its ``--json`` (still strict JSON: ``loss`` null) and the runs view."""
    import subprocess
    import sys

    from pimm_core.watch.runs import summarize
    from pimm_tui.views.runs import cells

    for name, loss in (("nan", float("nan")), ("inf", float("inf")), ("ninf", float("-inf")), ("ok", 0.5)):
        _run(tmp_path, name, records=[_train(1), _train(2, loss=loss)], step=2)
    _run(tmp_path, "none", records=[])
    want = {"g/nan": "NaN", "g/inf": "inf", "g/ninf": "-inf", "g/ok": "0.5", "g/none": "-"}
    rows = {r.name: r for r in RunsPoller(tmp_path).poll()}
    assert {n: r.loss_text() for n, r in rows.items()} == want
    assert {n: cells(r, False)[5].plain for n, r in rows.items()} == want  # the runs view's LOSS cell
    assert rows["g/nan"].loss is None and rows["g/ok"].loss == 0.5 and rows["g/none"].loss_nonfinite is None
    assert summarize(tmp_path / "g" / "inf", tmp_path).loss_nonfinite == "inf"

    def run(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "pimm_core.cli", "runs", "ls", str(tmp_path), *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    table = {line.split()[0]: line.split()[4] for line in run().splitlines()[1:] if line.startswith("g/")}
    assert table == want

    def strict(token: str):
        raise AssertionError(f"not strict JSON: {token}")

    got = json.loads(run("--json"), parse_constant=strict)["runs"]
    assert {r["name"]: (r["loss"], r["loss_nonfinite"]) for r in got} == {
        "g/nan": (None, "NaN"), "g/inf": (None, "inf"), "g/ninf": (None, "-inf"), "g/ok": (0.5, None),
        "g/none": (None, None)}


def test_best_is_what_model_best_was_ranked_by_not_the_current_eval_metric(tmp_path: Path) -> None:
    """After a resume that changed eval.metric (config.toml says val/loss) and before its first
    evaluation, model_best.pth is still the val/acc best: BEST says val/acc and its value, not the
    val/loss that evaluation happened to log. A sidecar without selection_metric falls back to eval.metric."""
    from pimm_core.watch.runs import summarize

    rd = _run(tmp_path, "changed", config='[eval]\nmetric = "val/loss"\nmode = "min"\n')
    (rd / "model").mkdir()
    side = {"kind": "best", "step": 18, "epoch": 2, "metrics": {"val/acc": 0.84, "val/loss": 2.01},
            "selection_metric": {"name": "val/acc", "value": 0.84, "mode": "max", "epoch": 2}}
    (rd / "model" / "model_best.pth.json").write_text(json.dumps(side))
    assert summarize(rd, tmp_path).best == {"metric": "val/acc", "value": 0.84, "epoch": 2}
    del side["selection_metric"]
    (rd / "model" / "model_best.pth.json").write_text(json.dumps(side))
    assert summarize(rd, tmp_path).best == {"metric": "val/loss", "value": 2.01, "epoch": 2}
