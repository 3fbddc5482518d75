"""A finished run always exits 0. 2-rank FSDP launches used to print ``done:`` and then, now and
then, die in rank 1 with ``terminate called without an active exception`` (SIGABRT, exit 1): the
gloo process group outlived ``destroy_process_group()`` (FSDP's DeviceMesh, kept by DTensor's
caches, held it), so its threads ran on into the interpreter's exit. Each rank now reaches its
exit with no process-group thread left: checked directly in the ranks of every launch (a
``sitecustomize`` that lists the process's threads at exit), the cause the abort came from now and
then, so two launches check it where three more without the probe only sampled its symptom."""

from __future__ import annotations

import json
from pathlib import Path

from _helpers import clean_env, describe, launch

# Records, in each rank, the native threads alive when the interpreter starts to exit (atexit).
_PROBE = '''
import atexit, json, os

def _threads_at_exit():
    if "RANK" not in os.environ:
        return
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    with open(os.path.join(os.path.dirname(__file__), f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(names, f)

atexit.register(_threads_at_exit)
'''

FSDP = ("train.strategy=fsdp", 'train.blocks=["Linear"]', "ema.enabled=true", "train.epochs=1", "train.max_steps=6",
        "checkpoint.every_steps=2", "checkpoint.async=true", "eval.every_epochs=1")


# the shortest run that still ends as the old abort did: FSDP at 2 ranks, an async save in flight
# at step 1, the final save at step 2, the process groups torn down at exit (no evaluation)
SHORT = ("train.strategy=fsdp", 'train.blocks=["Linear"]', "ema.enabled=true", "train.epochs=1",
         "train.max_steps=2", "checkpoint.every_steps=1", "checkpoint.async=true", "eval.every_epochs=0")


def _launch_fsdp(root: Path, name: str, probe: Path | None = None, overrides: tuple[str, ...] = FSDP):
    env = clean_env()
    if probe is not None:
        env["PYTHONPATH"] = str(probe) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return launch(root, name, *overrides, nproc=2, env=env, timeout=300)


def _assert_no_gloo_thread_at_exit(probe: Path) -> None:
    for rank in (0, 1):
        threads = json.loads((probe / f"rank{rank}.json").read_text())
        assert threads, "the probe did not run"
        left = [t for t in threads if "gloo" in t]
        assert left == [], f"rank {rank} exits with the process group's threads still running: {threads}"


def _probe(tmp_path: Path) -> Path:
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(_PROBE)
    return probe


def test_a_finished_fsdp_rank_has_no_process_group_thread_left_at_exit(tmp_path: Path):
    probe = _probe(tmp_path)
    r = _launch_fsdp(tmp_path / "exp", "exit", probe)
    assert r.returncode == 0 and "done:" in r.stdout, describe(r)
    # the exit's scan for meshes used to print torch's `reduce_op` FutureWarning twice per rank
    assert "reduce_op" not in r.stderr, describe(r)
    _assert_no_gloo_thread_at_exit(probe)


def test_the_shortest_fsdp_run_with_a_save_in_flight_exits_0_with_no_gloo_thread_left(tmp_path: Path):
    probe = _probe(tmp_path)
    r = _launch_fsdp(tmp_path / "exp", "short", probe, overrides=SHORT)
    assert r.returncode == 0 and "done:" in r.stdout, describe(r)
    assert "terminate called" not in r.stderr, describe(r)
    assert (tmp_path / "exp" / "digits" / "short" / "model" / "last" / ".complete").exists()
    _assert_no_gloo_thread_at_exit(probe)
