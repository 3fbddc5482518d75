"""``[log.mlflow]`` against a real ``mlflow server`` (SQLite store, 127.0.0.1) started here: a run
SIGKILLed after step 10 was logged (its last checkpoint at step 5) and resumed continues the same
tracked run, each step once in its history, with the run's config and provenance as parameters.
Read back with MLflow's own client. The killed session is a real process (its fail point is read at
import); the resume runs in this process (``pimm_here``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from _helpers import DIGITS, clean_env, describe, hang_s, launch, pimm_here, read_json, read_jsonl

_RUN = ("train.max_steps=14", "train.log_every_steps=1", "checkpoint.every_steps=5", "checkpoint.every_epochs=0")


def _client(tracking_uri: str):
    """mlflow's own client (imported here: mlflow's import, ~1.6 CPU-s, is paid only by the worker that
    runs these tests, not by every worker that collects them)."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


@pytest.fixture
def mlflow_server(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = tmp_path / "mlflow"
    store.mkdir()
    log = open(store / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
                             "--default-artifact-root", (store / "artifacts").as_uri(), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**clean_env(), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # (no job workers)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + hang_s(180)  # only catches a hang: the loop ends when the server answers
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (store / "server.log").read_text()[-3000:]
        time.sleep(0.5)
    yield uri
    os.killpg(proc.pid, signal.SIGTERM)  # the server and the uvicorn worker it started
    try:
        proc.wait(timeout=hang_s(60))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


# (MLflow's own import of its SQL store, in this process for the resume)
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
def test_a_resumed_run_continues_the_same_mlflow_run_with_each_step_once(tmp_path, mlflow_server):
    uri = mlflow_server
    sink = (f'log.mlflow.tracking_uri="{uri}"', 'log.mlflow.experiment="pimm-test"')
    env = {**clean_env(), "PIMM_FAILPOINT": "standard.prepared@2=kill"}  # inside the step-10 save
    killed = launch(tmp_path, "ml", *_RUN, *sink, env=env, timeout=600)
    assert killed.returncode in (-9, 137), describe(killed)
    run_dir = tmp_path / "digits" / "ml"
    run_id = read_json(run_dir / "mlflow.json")["run_id"]
    client = _client(tracking_uri=uri)
    # (sent in the background: what the killed process had sent, at least up to a few steps before the kill)
    resumed = pimm_here("resume", str(run_dir))
    assert resumed.returncode == 0, describe(resumed)
    assert read_json(run_dir / "mlflow.json")["run_id"] == run_id  # the same tracked run

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [run_id]
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))
    steps = [s for s, _ in history]
    assert steps == list(range(1, 15)), steps  # each step once
    logged = {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "train"}
    assert [v for _, v in history] == pytest.approx([logged[s] for s in steps])  # an exact resume: same values
    assert run.data.params["train.max_steps"] == "14" and run.data.params["checkpoint.every_steps"] == "5"
    assert run.data.params["provenance.world_size"] == "1" and "provenance.torch_version" in run.data.params




@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
def test_a_step_the_killed_sender_never_delivered_is_sent_on_resume(tmp_path, mlflow_server):
    """MLflow's asynchronous logging of a killed process can deliver step 10 and lose step 9: the resumed
    session sends every step the tracked run lacks (not only those after its newest), each once."""
    from mlflow.entities import Metric

    from pimm_core.config import load_config
    from pimm_core.train.mlflow_sink import MlflowSink

    client = _client(tracking_uri=mlflow_server)
    exp = client.create_experiment("gaps")
    run_id = client.create_run(exp).info.run_id
    client.log_batch(run_id, metrics=[Metric("train/loss", 1.0, 0, s) for s in (*range(1, 9), 10)])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "mlflow.json").write_text(f'{{"run_id": "{run_id}", "experiment_id": "{exp}"}}')
    cfg = load_config(DIGITS, [f'log.mlflow.tracking_uri="{mlflow_server}"'])
    sink = MlflowSink(cfg, run_dir, resumed=True, params={})
    for step in range(6, 15):  # the resumed session replays from its checkpoint at step 5
        sink.write({"split": "train", "step": step, "loss": 2.0})
    sink.close("finished")
    steps = sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))
    assert steps == list(range(1, 15)), steps


def test_mlflow_without_its_package_is_one_error_line_before_any_rank(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed: importlib finds no spec
    for args in ((), ("--dry-run",)):
        r = pimm_here("launch", "--train.config", DIGITS, "--run.root", tmp_path, "--run.name", "no",
                      "--run.no-timestamp", *args, "--", 'log.mlflow.experiment="x"')
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 2 and len(errors) == 1, describe(r)
        assert "[log.mlflow] needs the mlflow package" in errors[0] and "pip install mlflow" in errors[0]
        assert not (tmp_path / "digits" / "no").exists()


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
def test_the_mlflow_run_stays_running_while_the_ranks_restart_and_is_failed_at_the_end(tmp_path):
    """MLflow's own SQLite store (no server): the session that failed with a restart left leaves the tracked
    run RUNNING; the restarted session continues the same run; a failure with none left marks it FAILED."""
    from pimm_core import load_config
    from pimm_core.train.mlflow_sink import MlflowSink

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, [f'log.mlflow.tracking_uri="{uri}"', 'log.mlflow.experiment="pimm-test"'])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = MlflowSink(cfg, run_dir, resumed=False, params={"a": "1"})
    first.write({"step": 1, "loss": 2.0})
    first.close("restarting")
    client = _client(tracking_uri=uri)
    assert client.get_run(first.run_id).info.status == "RUNNING"
    again = MlflowSink(cfg, run_dir, resumed=True, params={"a": "1"})
    assert again.run_id == first.run_id
    again.close("failed")
    assert client.get_run(first.run_id).info.status == "FAILED"
