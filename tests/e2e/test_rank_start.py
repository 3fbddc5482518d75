"""How ``pimm launch --nproc-per-node N`` starts its ranks (pimm_core/launch/rank_start.py): forked from
the launcher's fork server, which imported torch once, and otherwise as ``python -m pimm_core.cli`` would
run them; ``PIMM_RANK_START=exec`` starts them that way instead."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _helpers import DIGITS, REPO, clean_env, hang_s
from test_user_code import USERPKG

_PROBE = """
[[callbacks]]
target = "userpkg.hooks:ExitProbe"
[callbacks.args]
out = "{out}"
"""


def test_ranks_are_forked_from_the_launchers_server_and_exit_as_an_interpreter(tmp_path):
    (tmp_path / "userpkg").symlink_to(USERPKG)  # beside the configs: found through their directory
    # "forked" is launched as the `pimm` console script (as `uv run pimm` does), whose module multiprocessing
    # imports again in each rank before the rank's environment is set; "exec" as `python -m pimm_core.cli`. In
    # both, a fail point armed for rank 1 only (a name no code passes) must be armed in rank 1 alone: pimm's
    # modules see the rank's RANK.
    cases = {"forked": {}, "exec": {"PIMM_RANK_START": "exec"}}
    armed = {"PIMM_FAILPOINT": "test.never_passed", "PIMM_FAILPOINT_RANK": "1"}

    def launch(name: str) -> subprocess.CompletedProcess[str]:
        config = tmp_path / f"{name}.toml"
        config.write_text(DIGITS.read_text() + _PROBE.format(out=tmp_path / name))
        pimm = [str(Path(sys.executable).with_name("pimm"))] if name == "forked" else [sys.executable, "-m",
                                                                                         "pimm_core.cli"]
        cmd = [*pimm, "launch", "--train.config", str(config), "--run.root",
               str(tmp_path / "exp"), "--run.name", name, "--run.no-timestamp", "--nproc-per-node", "2", "--",
               "train.max_steps=2", "data.num_workers=0"]
        return subprocess.run(cmd, cwd=REPO, env={**clean_env(), **armed, **cases[name]}, capture_output=True, text=True,
                              timeout=hang_s(300))

    with ThreadPoolExecutor(len(cases)) as pool:  # two independent 2-rank runs at once
        results = dict(zip(cases, pool.map(launch, cases)))
    for name, result in results.items():
        assert result.returncode == 0, f"{name}: {result.stdout[-2000:]}{result.stderr[-2000:]}"
        for rank in (0, 1):
            seen = json.loads((tmp_path / f"{name}-{rank}.json").read_text())
            # the interpreter's exit ran in the rank: threading's (the idle pool worker did not keep the
            # rank alive), then atexit's
            assert (tmp_path / f"{name}-{rank}.exit").read_text() == "exited", (name, rank)
            assert seen["sid"] == seen["pid"], (name, rank, seen)  # its own session, as torchrun gives a rank
            assert seen["failpoint_armed"] == (rank == 1), (name, rank, seen)
            # the config's user code (this callback's module) imported by the rank itself, with its environment
            assert seen["rank_at_import"] == str(rank), (name, rank, seen)
            if name == "forked":  # a child of the launcher's fork server, not of the launcher
                assert seen["ppid"] != seen["launcher"] and seen["grandparent"] == seen["launcher"], seen
                # the server a fork of the launcher (torch imported once), made before the launcher imported
                # the user code; what the launcher set in its environment later reached the rank all the same
                assert seen["parent_cmdline"] == seen["launcher_cmdline"], seen
                assert str(tmp_path) in seen["pythonpath"].split(":"), seen  # (the config's directory: targets.py)
            else:
                assert seen["ppid"] == seen["launcher"], seen


def test_a_stop_signal_to_the_launcher_ends_it_once_the_forked_ranks_saved(tmp_path):
    """A terminal's Ctrl-C at a one-node launch: torchrun's agent stops the ranks (SIGINT), they save `last` and
    end, and so does the launcher. A forked rank that finished once waited for the agent to read its result
    while the agent waited for it to exit, until the shutdown timeout (600 s by default; here an hour, so
    that the wait below catches it) SIGKILLed it."""
    import os
    import signal
    import time

    from _helpers import read_json

    run = tmp_path / "exp" / "digits" / "stop"
    cmd = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(DIGITS), "--run.root",
           str(tmp_path / "exp"), "--run.name", "stop", "--run.no-timestamp", "--nproc-per-node", "2", "--",
           "train.epochs=300", "data.num_workers=0", "train.log_every_steps=1"]
    launcher = subprocess.Popen(cmd, cwd=REPO, env={**clean_env(), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3600"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + hang_s(120)
        while not (run / "metrics.jsonl").exists() or "train" not in (run / "metrics.jsonl").read_text():
            assert launcher.poll() is None, launcher.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no step within the limit"
            time.sleep(0.1)
        os.killpg(launcher.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the launcher's process group
        out, _ = launcher.communicate(timeout=hang_s(120))
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 0, out[-3000:]
    assert read_json(run / "status.json")["state"] == "stopped"
    assert "pimm resume" in out


_SETS_AT_IMPORT = '''
import json
import os
from pathlib import Path

from torch import nn

# at import, in the launcher (which imports the model's module to check the config) as in each rank: set only
# where unset
os.environ.setdefault("ROLE_NAME", "set-by-user-code")
os.environ.setdefault("LOCAL_WORLD_SIZE", "7")


def net() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


class Probe:
    def __init__(self, out: str):
        self.out, self.done = out, False

    def on_step_end(self, trainer):
        if not self.done:
            self.done = True
            names = ("RANK", "LOCAL_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "PIMM_LAUNCHER_PID")
            Path(f"{self.out}-{trainer.info.rank}.json").write_text(json.dumps({n: os.environ.get(n) for n in names}))
'''


def test_what_user_code_sets_in_the_launcher_never_replaces_a_ranks_own_variables(tmp_path):
    """User code the launcher imports to check the config may set a variable torchrun's agent sets for each rank
    (``os.environ.setdefault("MASTER_PORT", ...)`` at import, as tutorials do: the ranks then met at that port
    and hung). The launcher's changes since the ranks' server was forked reach each rank, but the agent's own
    values win, as for a rank started as ``python -m`` (its environment: the launcher's, then the agent's)."""
    (tmp_path / "setsenv.py").write_text(_SETS_AT_IMPORT)
    text = DIGITS.read_text()
    text = text[:text.index("[model]")] + '[model]\ntarget = "setsenv:net"\n\n' + text[text.index("[checkpoint]"):]
    config = tmp_path / "c.toml"
    config.write_text(text + '\n[[callbacks]]\ntarget = "setsenv:Probe"\n[callbacks.args]\n'
                      f'out = "{tmp_path / "seen"}"\n')
    cmd = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(config), "--run.root",
           str(tmp_path / "exp"), "--run.name", "r", "--run.no-timestamp", "--nproc-per-node", "2",
           "train.max_steps=1", "data.num_workers=0"]
    result = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=hang_s(300))
    assert result.returncode == 0, f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"seen-{rank}.json").read_text())
        assert seen["RANK"] == seen["LOCAL_RANK"] == str(rank), seen
        assert seen["ROLE_NAME"] == "default" and seen["LOCAL_WORLD_SIZE"] == "2", seen  # torchrun's, not the user's
        assert seen["PIMM_LAUNCHER_PID"], seen  # (what the launcher set after the fork reached the rank)
