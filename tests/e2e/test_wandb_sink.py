"""``[log.wandb]`` in W&B's offline mode (no network), read back with W&B's own reader of its
``.wandb`` transaction logs (``wandb leet inspect --json``).

One run directory, three sessions of one W&B run: SIGKILLed inside the step-10 save (``last``
holds step 5; W&B had flushed at most part of what it was sent), resumed and stopped cleanly by a
real SIGTERM inside its step-10 save, resumed again to the end (step 14). Every step is in the
W&B run's history once, the id is the same in every session, the run's config and provenance
are its config. A second test gives the W&B run steps past the resumed position (an interrupted
session that W&B had flushed) and checks they are not logged again.

The killed and the stopped sessions are real processes (their fail points are read at import);
the last resume runs in this process (``pimm_here``), with the same W&B environment. A session that
fails while torchrun has a restart left (in this process, the agent's environment variables set) leaves
its W&B run preempting with exit code 0; with none left, exit code 1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import DIGITS, clean_env, describe, launch, pimm, pimm_here, read_json, read_jsonl

_RUN = ("train.max_steps=14", "train.log_every_steps=1", "checkpoint.every_steps=5", "checkpoint.every_epochs=0",
        'log.wandb.project="pimm-test"')


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Offline W&B, every W&B directory under ``tmp_path`` (nothing in the user's home)."""
    wb = tmp_path / "wandb-home"
    return {**clean_env(), "WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(wb / "config"),
            "WANDB_CACHE_DIR": str(wb / "cache"), "WANDB_DATA_DIR": str(wb / "data"), **extra}


def _inspect(path: Path, *args: str, env: dict[str, str]) -> str:
    r = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", *args, str(path)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _wandb_teardown() -> None:
    if sys.modules.get("wandb") is not None:
        sys.modules["wandb"].teardown()


def _sessions(wandb_dir: Path, run_id: str) -> list[Path]:
    """The W&B run's transaction log of each session, oldest first: ``offline-run-<time>-<id>``, and
    ``offline-run-<time>-<id>-<n>`` for a session that started in the same second as an earlier one."""
    name = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    found = {f: name.fullmatch(f.parent.name) for f in wandb_dir.glob(f"wandb/offline-run-*/run-{run_id}.wandb")}
    return sorted((f for f, m in found.items() if m), key=lambda f: (found[f][1], int(found[f][2] or 0)))


def _history(files: list[Path], env: dict[str, str]) -> list[tuple[int, dict]]:
    """``(step, row)`` of every history row in ``files``, in order."""
    rows = []
    for f in files:
        for line in _inspect(f, env=env).splitlines():
            rec = json.loads(line)
            if rec["type"] == "history":
                rows.append((int(rec["history"].get("step", {}).get("num", 0)), rec["history"]["item"]))
    return rows


def test_a_killed_stopped_and_resumed_run_is_one_wandb_run_with_each_step_once(tmp_path):
    wandb_dir = tmp_path / "wandb-dir"
    env = _env(tmp_path, WANDB_DIR=str(wandb_dir))
    killed = launch(tmp_path, "wb", *_RUN, env={**env, "PIMM_FAILPOINT": "standard.prepared@2=kill"}, timeout=600)
    assert killed.returncode in (-9, 137), describe(killed)  # inside the step-10 save: last is step 5
    run_dir = tmp_path / "digits" / "wb"
    run_id = read_json(run_dir / "wandb.json")["run_id"]
    assert not (run_dir / "wandb").exists()  # WANDB_DIR set: W&B's files go there

    # the resume replays steps 6-10 and is stopped by a real SIGTERM inside its own step-10 save
    stopped = pimm("resume", run_dir, env={**env, "PIMM_FAILPOINT": "standard.prepared@1=sigterm"}, timeout=600)
    assert stopped.returncode == 0, describe(stopped)
    assert read_json(run_dir / "status.json")["state"] == "stopped"
    with pytest.MonkeyPatch.context() as mp:  # W&B reads WANDB_* when it is set up: afresh here, ended after
        for k in [k for k in os.environ if k.startswith("WANDB_")]:
            mp.delenv(k)
        for k, v in env.items():
            if k.startswith("WANDB_"):
                mp.setenv(k, v)
        _wandb_teardown()
        try:
            finished = pimm_here("resume", str(run_dir))
        finally:
            _wandb_teardown()
    assert finished.returncode == 0, describe(finished)
    assert read_json(run_dir / "wandb.json")["run_id"] == run_id  # the same W&B run throughout

    files = _sessions(wandb_dir, run_id)
    assert len(files) == 3, files  # one per session, all of the one W&B run
    history = _history(files, env)
    assert [s for s, _ in history] == list(range(1, 15))  # each step once, in order
    train = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "train"}
    assert [row["train/loss"] for _, row in history] == pytest.approx([train[s]["loss"] for s in range(1, 15)])
    assert all("train/lr" in row for _, row in history)
    evals = [s for s, row in history if "val/loss" in row]  # (evaluated with the step-5, -10 saves and at the end)
    assert evals and evals == [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "val"]

    last = json.loads(_inspect(files[-1], "--summary", env=env))
    assert last["run_id"] == run_id and last["project"] == "pimm-test" and last["state"] == "finished"
    config = last["config"]
    assert config["train"]["max_steps"] == 14 and config["checkpoint"]["every_steps"] == 5
    assert config["provenance"]["world_size"] == 1 and config["provenance"]["torch_version"]
    stop = json.loads(_inspect(files[1], "--summary", env=env))  # (the killed session's may hold no run record:
    assert stop["run_id"] == run_id  # W&B had not flushed it)


def test_steps_the_wandb_run_holds_past_the_resumed_position_are_not_logged_again(tmp_path, monkeypatch):
    """W&B flushed the interrupted session up to step 8 (here: a session that finished writing
    steps 1-8); a resume at step 5 logs steps 9-14 only (6-8 keep the interrupted session's values)."""
    import wandb

    from pimm_core.config import load_config
    from pimm_core.run import METRICS, MetricsWriter
    from pimm_core.train.wandb_sink import WandbSink

    for k, v in _env(tmp_path).items():
        monkeypatch.setenv(k, v)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "wandb.json").write_text('{"run_id": "held8"}\n')
    first = wandb.init(id="held8", project="p", dir=str(run_dir), mode="offline",
                       settings=wandb.Settings(console="off"))  # (pytest's own output stays unwrapped)
    for s in range(1, 9):
        first.log({"train/loss": 100.0 + s}, step=s)
    first.finish()
    metrics = MetricsWriter(run_dir / METRICS)
    for s in range(1, 6):  # metrics.jsonl as a resume at step 5 leaves it
        metrics.write({"step": s, "split": "train", "loss": float(s)})
    metrics.close()

    cfg = load_config(None, ['log.wandb.project="p"', 'log.wandb.mode="offline"'])
    sink = WandbSink(cfg, run_dir, resumed_at=5, run_config=cfg.to_dict())
    for s in range(6, 15):
        sink.write({"step": s, "split": "train", "loss": float(s)})
    sink.close("finished")
    wandb.teardown()  # (W&B's service process of this test process)
    history = _history(_sessions(run_dir, "held8"), dict(os.environ))
    assert [(s, row["train/loss"]) for s, row in history] == [(s, 100.0 + s) for s in range(1, 9)] + \
        [(s, float(s)) for s in range(9, 15)]


def test_wandb_without_its_package_is_one_error_line_before_any_rank(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: importlib finds no spec
    for args in ((), ("--dry-run",)):
        r = pimm_here("launch", "--train.config", DIGITS, "--run.root", tmp_path, "--run.name", "no",
                      "--run.no-timestamp", *args, "--", 'log.wandb.project="x"')
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 2 and len(errors) == 1, describe(r)
        assert "[log.wandb] needs the wandb package" in errors[0] and "pip install wandb" in errors[0]
        assert not (tmp_path / "digits" / "no").exists()


@pytest.mark.parametrize("restarts, state, preempting, exit_code", [("1", "restarting", True, 0),
                                                                     ("0", "failed", False, 1)])
def test_a_session_that_fails_with_a_restart_left_leaves_the_wandb_run_preempting(tmp_path, monkeypatch, restarts,
                                                                                  state, preempting, exit_code):
    """A rank's session fails at step 3 under torchrun's agent (``pimm launch --max-restarts 1``, as the
    agent tells it: ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RESTART_COUNT``). With a restart left the W&B
    run is marked preempting and finished with exit code 0 (the restarted ranks continue it); with none,
    exit code 1. In this process: the failure is a callback's exception."""
    import wandb

    from pimm_core import Trainer, load_config

    for k, v in _env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", restarts)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    cfg = load_config(DIGITS, ["train.max_steps=6", "train.log_every_steps=1", "checkpoint.every_epochs=0",
                               "model.hidden=16", "data.num_workers=0", 'log.wandb.project="p"'])
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg, run_dir=run_dir)

    class PeerLost(RuntimeError):
        pass

    def fail_at_three(tr) -> None:
        if tr.state.global_step == 3:
            raise PeerLost("a rank died")

    trainer.callbacks.append(fail_at_three)
    _wandb_teardown()
    try:
        with pytest.raises(PeerLost):
            trainer.train(checkpoint_dir=run_dir / "model")
    finally:
        wandb.teardown()
    assert read_json(run_dir / "status.json")["state"] == state
    run_id = read_json(run_dir / "wandb.json")["run_id"]  # (the id the restarted ranks resume)
    (session,) = _sessions(run_dir, run_id)
    env = dict(os.environ)
    types = [json.loads(line)["type"] for line in _inspect(session, env=env).splitlines()]
    assert ("preempting" in types) is preempting, types
    summary = json.loads(_inspect(session, "--summary", env=env))
    assert summary["exit_code"] == exit_code and summary["step"] == 3, {k: summary[k] for k in ("exit_code", "step")}
