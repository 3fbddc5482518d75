"""``[[callbacks]]`` from the config: the moments a Lightning user expects, the callback's
``state_dict()`` saved in the checkpoint and given back on resume, and a wrong target refused
before any rank starts. (``trainer.callbacks`` from Python: tests/e2e/test_stop_api.py and the
resume tests that stop through it.)"""

from __future__ import annotations

import json
from pathlib import Path

from _helpers import DIGITS, describe, pimm
from test_user_code import USERPKG, _launch, _launch_here

_CALLBACK = """
[[callbacks]]
target = "userpkg.hooks:EventCounter"
[callbacks.args]
out = "{out}"
stop_at = {stop_at}
"""


def _config(tmp_path: Path, target: str = "userpkg.hooks:EventCounter", stop_at: int = 50) -> Path:
    (tmp_path / "userpkg").symlink_to(USERPKG)  # beside the config: found through its directory
    path = tmp_path / "cb.toml"
    text = DIGITS.read_text() + _CALLBACK.format(out=tmp_path / "events.json", stop_at=stop_at)
    path.write_text(text.replace("userpkg.hooks:EventCounter", target))
    return path


def test_a_config_callback_sees_each_moment_and_its_state_survives_a_resume(tmp_path):
    config = _config(tmp_path)
    # 45 steps per epoch: an evaluation and a save at the end of epoch 0, the callback stops at step 50
    first = _launch(config, tmp_path / "exp", "cb", overrides=("train.epochs=2", "checkpoint.every_epochs=1"))
    assert first.returncode == 0, describe(first)
    seen = json.loads((tmp_path / "events.json").read_text())
    assert seen["counts"] == {"step_end": 50, "eval_end": 1, "checkpoint_saved": 2, "stop_requested": 1,
                              "train_end": 1}, seen
    assert seen["saved"] == ["last", "last"] and not seen["restored"]

    second = pimm("resume", tmp_path / "exp" / "digits" / "cb")
    assert second.returncode == 0, describe(second)
    after = json.loads((tmp_path / "events.json").read_text())
    assert after["restored"] and after["pid"] != seen["pid"]  # a new process, given the saved counts
    # counted on from the state the step-50 save held (50 steps, 1 evaluation, 1 earlier save, the stop;
    # its own save and the train end came after it), then epoch 1's 40 steps, evaluation, final save and end
    assert after["counts"] == {"step_end": 90, "eval_end": 2, "checkpoint_saved": 2, "stop_requested": 1,
                               "train_end": 1}, after
    assert after["saved"] == ["last", "last"]


def test_a_wrong_callback_target_is_one_error_line_before_any_rank(tmp_path):
    config = _config(tmp_path, target="userpkg.hooks:EventCountr")
    for args in ((), ("--dry-run",)):
        if args:  # the dry run: the same refusal, in this process (the user package imported anew)
            r = _launch_here(config, tmp_path / "exp", "bad", *args, nproc=2, fresh="userpkg")
        else:  # the launch through the console script
            r = _launch(config, tmp_path / "exp", "bad", nproc=2)
        assert r.returncode == 2, describe(r)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "callbacks[0].target" in errors[0] and "EventCounter" in errors[0], describe(r)
        assert "Traceback" not in r.stderr
        assert not (tmp_path / "exp" / "digits" / "bad").exists()


def test_a_wrong_callback_argument_names_its_key(tmp_path):
    config = _config(tmp_path)
    config.write_text(config.read_text().replace("stop_at =", "stop_att ="))
    r = _launch_here(config, tmp_path / "exp", "bad", "--dry-run", fresh="userpkg")  # (a refusal: no process of its own)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "callbacks[0].args.stop_att" in errors[0], describe(r)
