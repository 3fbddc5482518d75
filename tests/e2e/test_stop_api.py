"""StopRequest (handlers, real signals, threads) and stopping through the Python API.

Signals here are real: ``os.kill(os.getpid(), ...)`` to the test process itself while
``catch_signals()`` is active.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from _helpers import DIGITS, hang_s, read_json, read_jsonl
from pimm_core.process.stop import StopRequest


def _wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + hang_s(timeout)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


@pytest.fixture
def custom_handlers():
    """Install recording handlers for SIGINT/SIGTERM; restore the originals afterwards."""
    seen: list[int] = []

    def record(signum, _frame):
        seen.append(signum)

    originals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in originals:
        signal.signal(s, record)
    yield record, seen
    for s, h in originals.items():
        signal.signal(s, h)


# ------------------------------------------------------------------ signals
def test_catch_signals_installs_and_restores_handlers(custom_handlers):
    record, seen = custom_handlers
    stop = StopRequest()
    with stop.catch_signals() as yielded:
        assert yielded is stop
        for s in (signal.SIGINT, signal.SIGTERM):
            assert signal.getsignal(s) is not record
            assert callable(signal.getsignal(s))
    for s in (signal.SIGINT, signal.SIGTERM):
        assert signal.getsignal(s) is record
    # restored for real: a signal after the block reaches the previous handler, not the request
    os.kill(os.getpid(), signal.SIGTERM)
    assert _wait_for(lambda: seen == [signal.SIGTERM])
    assert stop.reason is None


def test_catch_signals_restores_handlers_after_an_exception(custom_handlers):
    record, _ = custom_handlers
    stop = StopRequest()
    with pytest.raises(RuntimeError, match="boom"), stop.catch_signals():
        raise RuntimeError("boom")
    assert signal.getsignal(signal.SIGINT) is record and signal.getsignal(signal.SIGTERM) is record


def test_real_sigterm_sets_reason_without_killing(custom_handlers):
    _, seen = custom_handlers
    stop = StopRequest()
    with stop.catch_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        assert _wait_for(lambda: stop.requested)
        assert stop.reason == "signal:SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)  # a second signal: no KeyboardInterrupt, the first reason stays
        time.sleep(0.05)
        assert stop.reason == "signal:SIGTERM"
    assert seen == []  # the previous handlers saw nothing while the request was installed


def test_real_sigint_sets_reason_without_keyboardinterrupt():
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN under `nohup ... &`, Python's default otherwise
    stop = StopRequest()
    with stop.catch_signals():
        os.kill(os.getpid(), signal.SIGINT)
        assert _wait_for(lambda: stop.requested)
    assert stop.reason == "signal:SIGINT"
    assert signal.getsignal(signal.SIGINT) is before  # what was installed before is back


def test_catch_signals_outside_main_thread_is_refused_and_changes_nothing():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    errors: list[BaseException] = []

    def enter():
        try:
            with StopRequest().catch_signals():
                pass
        except BaseException as e:  # noqa: BLE001 - recorded for the assert
            errors.append(e)

    t = threading.Thread(target=enter)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ValueError), errors
    assert {s: signal.getsignal(s) for s in before} == before


# ------------------------------------------------------------------ threads
def test_request_from_another_thread():
    stop = StopRequest()
    t = threading.Thread(target=stop.request, args=("from a thread",))
    t.start()
    t.join()
    assert stop.requested and stop.reason == "from a thread"


def test_first_reason_wins_across_threads():
    stop = StopRequest()
    n = 16
    barrier = threading.Barrier(n)

    def go(i: int) -> None:
        barrier.wait()
        stop.request(f"thread {i}")

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winner = stop.reason
    assert winner in {f"thread {i}" for i in range(n)}
    stop.request("late")
    assert stop.reason == winner


# --------------------------------------------------------------- Python API
API_OVERRIDES = ["train.epochs=2", "model.dropout=0.3", "data.num_workers=0", "train.log_every_steps=5"]
STEPS_PER_EPOCH = 45  # 1,437 training samples at batch 32
BUDGET = STEPS_PER_EPOCH + 5  # mid-epoch 1: epoch 0 was evaluated, the end of the run is not reached


def _trainer(run_dir: Path):
    from pimm_core import Trainer, load_config

    return Trainer(load_config(DIGITS, API_OVERRIDES), run_dir=run_dir)


@pytest.fixture(scope="module")
def api_runs(tmp_path_factory):
    """Through the Python API: a completed run; a run a callback stops; that run resumed to the end."""
    root = tmp_path_factory.mktemp("stop-api")
    done_dir, budget_dir = root / "done", root / "budget"
    completed = _trainer(done_dir).train(checkpoint_dir=done_dir / "model")

    trainer = _trainer(budget_dir)
    calls: list[int] = []

    def budget(tr) -> None:
        calls.append(tr.state.global_step)
        if tr.state.global_step >= BUDGET:
            tr.stop.request("budget")

    trainer.callbacks.append(budget)
    stopped = trainer.train(checkpoint_dir=budget_dir / "model")
    stopped_snapshot = {"status": read_json(budget_dir / "status.json"),
                        "metrics": read_jsonl(budget_dir / "metrics.jsonl"),
                        "provenance": read_json(budget_dir / "provenance.json"),
                        "manifest": read_json(budget_dir / "model" / "last" / "manifest.json")}
    resumed = _trainer(budget_dir).train(checkpoint_dir=budget_dir / "model",
                                         resume_from=budget_dir / "model" / "last")
    return {"completed": completed, "stopped": stopped, "resumed": resumed, "calls": calls,
            "done_dir": done_dir, "budget_dir": budget_dir, "at_stop": stopped_snapshot}


def test_api_completed_run_has_no_stop_reason(api_runs):
    state = api_runs["completed"]
    assert state.stop_reason is None and state.finished
    assert state.global_step == 2 * STEPS_PER_EPOCH
    status = read_json(api_runs["done_dir"] / "status.json")
    assert status["state"] == "finished" and status["stop_reason"] is None
    assert not [e for e in read_json(api_runs["done_dir"] / "provenance.json")["starts"] if e["kind"] == "stop"]


def test_api_callback_stop_returns_callers_reason(api_runs):
    state, snap = api_runs["stopped"], api_runs["at_stop"]
    assert state.stop_reason == "budget" and not state.finished
    # the callback ran after every optimizer step, and the stop came at the end of that same window
    assert api_runs["calls"] == list(range(1, BUDGET + 1))
    assert (state.global_step, state.epoch, state.iter) == (BUDGET, 1, BUDGET - STEPS_PER_EPOCH)
    assert snap["status"]["state"] == "stopped" and snap["status"]["stop_reason"] == "budget"
    assert (snap["manifest"]["step"], snap["manifest"]["epoch"], snap["manifest"]["iter"]) == \
        (state.global_step, state.epoch, state.iter)
    stop = snap["provenance"]["starts"][-1]
    assert stop["kind"] == "stop" and stop["reason"] == "budget" and stop["step"] == BUDGET


def test_api_no_final_evaluation_after_stop(api_runs):
    val = [r for r in api_runs["at_stop"]["metrics"] if r["split"] == "val"]
    assert [(r["epoch"], r["step"]) for r in val] == [(0, STEPS_PER_EPOCH)]  # epoch 0 only; nothing at/after the stop
    train = [r["step"] for r in api_runs["at_stop"]["metrics"] if r["split"] == "train"]
    assert max(train) <= BUDGET


def test_api_resume_after_stop_matches_completed_run(api_runs):
    import torch

    resumed = api_runs["resumed"]
    assert resumed.stop_reason is None and resumed.finished
    assert resumed.global_step == api_runs["completed"].global_step
    a = torch.load(api_runs["done_dir"] / "model" / "last" / "weights.pth", weights_only=True)["state_dict"]
    b = torch.load(api_runs["budget_dir"] / "model" / "last" / "weights.pth", weights_only=True)["state_dict"]
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    val = [r for r in read_jsonl(api_runs["budget_dir"] / "metrics.jsonl") if r["split"] == "val"]
    assert [(r["epoch"], r["step"]) for r in val] == [(0, STEPS_PER_EPOCH), (1, 2 * STEPS_PER_EPOCH)]
