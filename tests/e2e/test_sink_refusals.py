"""A metrics sink whose own library refuses to start (a bad ``WANDB_MODE``, a ``WANDB_DIR``
that is a file, a tracking URI MLflow does not support) is bad input: one ``error:`` line naming
the sink and the library's reason, exit 2, no traceback; a fresh run leaves no run directory
behind, and a resume leaves the run as it was (it resumes once the setting is fixed).
Real wandb (offline) and real mlflow, as the user would meet them.

Each ``pimm`` runs in this process (``pimm_here``) with the environment it is given: whether a
library refuses does not depend on a fresh process, and each subprocess spent ~3 CPU-s importing
torch and the library first. W&B reads its ``WANDB_*`` variables when it is set up, once per
process: it is torn down around each call, so each reads the environment given."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

from _helpers import describe, launch, pimm_here, read_json


def _wandb_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    wb = tmp_path / "wandb-home"  # (nothing in the user's home)
    return {"WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(wb / "config"),
            "WANDB_CACHE_DIR": str(wb / "cache"), "WANDB_DATA_DIR": str(wb / "data"), **extra}


def _wandb_teardown() -> None:
    if sys.modules.get("wandb") is not None:
        sys.modules["wandb"].teardown()


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """This process's environment with no ``WANDB_*``/``MLFLOW_*`` variables but those of ``env``,
    W&B set up afresh inside (and its service process ended after)."""
    with pytest.MonkeyPatch.context() as mp:
        for k in [k for k in os.environ if k.startswith(("WANDB_", "MLFLOW_"))]:
            mp.delenv(k)
        for k, v in env.items():
            mp.setenv(k, v)
        _wandb_teardown()
        try:
            yield
        finally:
            _wandb_teardown()


def _launch(env: dict[str, str], *args, **kwargs):
    with _environment(env):
        return launch(*args, here=True, **kwargs)


def _pimm(env: dict[str, str], *args):
    with _environment(env):
        return pimm_here(*map(str, args))


def _one_error(r) -> str:
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1, describe(r)
    assert "Traceback" not in r.stderr + r.stdout, describe(r)
    return errors[0]


@pytest.mark.parametrize("case", ["wandb-mode", "wandb-dir-is-a-file", "mlflow-uri"])
def test_a_sink_that_cannot_start_is_one_error_line_and_leaves_no_run(tmp_path, case):
    (tmp_path / "afile").write_text("")
    if case == "wandb-mode":
        env, over, names = _wandb_env(tmp_path, WANDB_MODE="bogus"), 'log.wandb.project="p"', ("[log.wandb]", "bogus")
    elif case == "wandb-dir-is-a-file":
        env, over = _wandb_env(tmp_path, WANDB_DIR=str(tmp_path / "afile")), 'log.wandb.project="p"'
        names = ("[log.wandb]", str(tmp_path / "afile"))
    else:
        env, over, names = {}, 'log.mlflow.tracking_uri="bogus://nowhere"', ("[log.mlflow]", "bogus://nowhere")
    r = _launch(env, tmp_path / "exp", "s", "train.max_steps=2", over)
    line = _one_error(r)
    assert all(n in line for n in names), line  # the sink and what its library refused
    assert not (tmp_path / "exp" / "digits" / "s").exists()  # nothing left behind


def test_a_resume_whose_sink_cannot_start_leaves_the_run_as_it_was(tmp_path):
    env = _wandb_env(tmp_path)
    first = _launch(env, tmp_path, "r", "train.max_steps=3", "train.epochs=2", 'log.wandb.project="p"')
    assert first.returncode == 0, describe(first)
    run_dir = tmp_path / "digits" / "r"
    run_id = read_json(run_dir / "wandb.json")["run_id"]
    refused = _pimm({**env, "WANDB_MODE": "bogus"}, "resume", run_dir, "--", "train.max_steps=5")
    assert "[log.wandb]" in _one_error(refused)
    assert read_json(run_dir / "status.json")["state"] == "finished"  # as the first session left it
    assert read_json(run_dir / "wandb.json")["run_id"] == run_id
    assert (run_dir / "model" / "last" / ".complete").is_file()
    again = _pimm(env, "resume", run_dir, "--", "train.max_steps=5")
    assert again.returncode == 0, describe(again)
    assert read_json(run_dir / "status.json")["step"] == 5
    assert read_json(run_dir / "wandb.json")["run_id"] == run_id  # still the same W&B run
