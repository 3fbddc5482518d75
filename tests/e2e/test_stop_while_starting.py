"""``pimm stop`` while a run is starting: after the launch has claimed the run directory (it holds
only ``lock.json``) and before the trainer has written ``config.toml`` and ``status.json``.

The stop is accepted and honoured: the run stops before its first step, nothing trained or saved,
exit 0 (as Ctrl-C in the same window). Before, ``pimm stop`` refused ("not a run directory") and the
run trained to its end; and the trainer discarded any ``control/stop`` found at its start as left
from an earlier session. A real launch is paused at the fail point ``launch.claimed``.
"""

from __future__ import annotations

from pathlib import Path

from _helpers import DIGITS, pimm_here, read_json
from test_readers_mid_rotation import Paused, _pimm


def test_a_stop_asked_while_the_run_is_starting_stops_it_before_its_first_step(tmp_path: Path) -> None:
    run = tmp_path / "exp" / "digits" / "s"
    launch = Paused(_pimm("launch", "--train.config", DIGITS, "--run.root", tmp_path / "exp", "--run.name", "s",
                          "--run.no-timestamp", "--", "train.epochs=2"), "launch.claimed=pause", tmp_path / "sync")
    assert launch.reached("launch.claimed"), launch.finish()
    assert not (run / "status.json").exists() and not (run / "config.toml").exists()  # the window this is about

    r = pimm_here("stop", str(run))
    launch.go("launch.claimed")
    code, out, err = launch.finish()

    assert r.returncode == 0, r.stderr
    assert "the run is starting: it stops before its first step" in r.stdout
    assert code == 0, err
    status = read_json(run / "status.json")
    assert (status["state"], status["step"], status["stop_reason"]) == ("stopped", 0, "operator"), status
    assert "stop asked before the first step (operator)" in (run / "train.log").read_text()
    assert not list((run / "model").glob("*")) if (run / "model").exists() else True  # nothing saved


def test_stop_names_a_run_directory_that_does_not_exist(tmp_path: Path) -> None:
    r = pimm_here("stop", str(tmp_path / "exp" / "digits" / "nope"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr, r.stderr
