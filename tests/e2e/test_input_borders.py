"""Values and names that pass a loose check and fail later: refused where the config is checked.

Float keys must be finite and in range, integers fit in 64 bits, seeds fit the generators
they reach, launcher ports are ports, a run name is one path component; each is one line,
exit 2, before anything is created (so ``--dry-run`` refuses too). ``pimm stop`` tells a
live run from a dead one by the console's rule.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from _helpers import DIGITS, describe, pimm, pimm_here
from pimm_core.config import load_config
from pimm_core.config.tables import all_keys
from pimm_core.errors import ConfigError
from pimm_core.run.layout import name_problem
from pimm_core.run.status import write_status
from pimm_core.watch.snapshot import RunReader


def config_error(overrides: list[str], extra: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(DIGITS, overrides, extra)
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 2
    return message


FLOAT_KEYS = ["train.lr", "train.weight_decay", "train.momentum", "train.min_lr", "train.grad_clip",
              "train.max_time", "data.val_fraction", "data.timeout", "model.dropout", "ema.decay",
              "checkpoint.remote_timeout", "dist.timeout"]


def test_every_float_key_is_listed_here():
    """The finite check is per type: a float key added to the schema is covered by it (and by this test)."""
    import typing

    from pimm_core.config import Config

    def floats(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for name, hint in hints.items():
            if hasattr(hint, "__dataclass_fields__"):
                yield from floats(hint, f"{prefix}{name}.")
            elif float in (hint, *typing.get_args(hint)):
                yield f"{prefix}{name}"

    assert sorted(floats(Config)) == sorted(FLOAT_KEYS)
    assert set(FLOAT_KEYS) <= set(all_keys(Config))


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "+nan"])
def test_float_keys_must_be_finite(key, value):
    message = config_error([f"{key}={value}"])
    assert message.startswith(f"override: {key} = ") and "not a finite number" in message, message


def test_nan_in_a_file_names_file_and_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nepochs = 2\n\nweight_decay = nan\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:4: train.weight_decay = nan is not a finite number")


@pytest.mark.parametrize("override, key", [("train.lr=-0.1", "train.lr"), ("train.min_lr=-1e-6", "train.min_lr"),
                                           ("train.grad_clip=-1", "train.grad_clip"),
                                           ("train.weight_decay=-0.01", "train.weight_decay"),
                                           ("ema.decay=1.5", "ema.decay")])
def test_negative_or_out_of_range_floats(override, key):
    assert f"{key} = " in config_error([override]) and "out of range" in config_error([override])


@pytest.mark.parametrize("seed, ok", [(0, True), (2**63 - 1, True), (2**63, False), (2**64, False), (-1, False)])
def test_train_seed_range(seed, ok):
    if ok:
        assert load_config(DIGITS, [f"train.seed={seed}"]).train.seed == seed
        return
    message = config_error([f"train.seed={seed}"])
    assert f"train.seed = {seed}" in message


def test_split_seed_fits_numpy():
    assert "data.split_seed = 4294967296" in config_error(["data.split_seed=4294967296"])
    assert load_config(DIGITS, ["data.split_seed=4294967295"]).data.split_seed == 4294967295


def test_any_integer_beyond_64_bits_is_refused():
    message = config_error([f"data.batch_size={2**70}"])
    assert "data.batch_size" in message and "64 bits" in message


def test_the_largest_seed_trains_a_step(tmp_path):
    """The top of the range really works: seed + rank + epoch reach torch's generators."""
    result = pimm_here("launch", "--train.config", DIGITS, "--run.root", tmp_path, "--run.name", "s",
                       "--run.no-timestamp", "--", f"train.seed={2**63 - 1}", "train.max_steps=2", "train.epochs=2")
    assert result.returncode == 0, describe(result)


@pytest.mark.parametrize("args, flag", [
    (["--train.config", DIGITS, "--dry-run", "--", "train.lr=nan"], "train.lr"),
    (["--train.config", DIGITS, "--dry-run", "--", f"train.seed={2**64}"], "train.seed"),
    (["--train.config", DIGITS, "--dry-run", "--master-port", "99999"], "--master-port"),
    (["--train.config", DIGITS, "--dry-run", "--master-port", "0"], "--master-port"),
    (["--train.config", DIGITS, "--master-port", "99999"], "--master-port"),
    (["--train.config", DIGITS, "--dry-run", "--rdzv-endpoint", "localhost:70000"], "--rdzv-endpoint"),
    # a rendezvous setting for a launch that starts no torchrun (one process): nothing would read it
    (["--train.config", DIGITS, "--rdzv-conf", "last_call_timeout=10"], "--rdzv-conf"),
])
def test_cli_refuses_bad_values_in_one_line(tmp_path, args, flag):
    result = pimm("launch", "--run.root", tmp_path, *args, timeout=120)
    assert result.returncode == 2, describe(result)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], describe(result)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- run names
BAD_NAMES = ["../../escaped", "/tmp/abs", ".", "..", "a/b", "x" * 300, "tab\there", "nul\0"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_name_problem(name):
    assert name_problem(name) is not None


@pytest.mark.parametrize("name", ["run", "lr-3e-4", "a.b", "..x", "é" * 100, "x" * 255])
def test_valid_names(name):
    assert name_problem(name) is None


def test_name_room_for_the_timestamp():
    assert name_problem("x" * 235, suffix=20) is None
    assert "timestamp" in name_problem("x" * 236, suffix=20)


@pytest.mark.parametrize("name", [n for n in BAD_NAMES if "\0" not in n])  # argv cannot carry a NUL
@pytest.mark.parametrize("dry", [True, False])
def test_cli_refuses_bad_run_names_and_creates_nothing(tmp_path, name, dry):
    root = tmp_path / "root" / "exp"
    result = pimm("launch", "--train.config", DIGITS, "--run.root", root, "--run.name", name,
                  *(["--dry-run"] if dry else []), "--", "train.epochs=1", timeout=120)
    assert result.returncode == 2, describe(result)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "run.name" in lines[0], describe(result)
    assert sorted(p.name for p in tmp_path.rglob("*")) == [], "something was created"


@pytest.mark.parametrize("group", ["..", "a/b", ""])
def test_bad_group_is_refused(group):
    assert "run.group" in config_error([], {"run.group": group})


def test_config_file_named_dot_is_refused(tmp_path):
    path = tmp_path / "..toml"  # its stem, the default run name, is "."
    path.write_text(DIGITS.read_text())
    result = pimm_here("launch", "--train.config", path, "--run.root", tmp_path / "exp", "--dry-run")
    assert result.returncode == 2 and "--run.name" in result.stderr, describe(result)
    assert not (tmp_path / "exp").exists()


# ------------------------------------------------------------------------- pimm stop
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("pid_alive", [False, True])
def test_pimm_stop_on_a_dead_or_silent_run_says_not_live(tmp_path, pid_alive):
    """``status.json`` says running, but its pid is gone (or alive with a heartbeat an hour old):
    the console shows it not live, and ``pimm stop`` agrees (exit 1, nothing written)."""
    run = tmp_path / "run"
    run.mkdir()
    hour_ago = time.time() - 3600
    write_status(run, "running", pid=dead_pid() if not pid_alive else os.getpid(), heartbeat=hour_ago,
                 step=5)
    console = RunReader(run).poll().status
    assert console.live is False and console.note
    result = pimm("stop", run, timeout=60)
    assert result.returncode == 1, describe(result)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {run} is not live"), describe(result)
    age = re.compile(r"\d+ s\b")  # the heartbeat's age as of each reading: seconds apart under load
    assert age.sub("N s", console.note) in age.sub("N s", lines[0]), (console.note, lines[0])
    assert not (run / "control").exists()


def test_pimm_stop_on_a_live_run_writes_the_request(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    write_status(run, "running", step=5)  # this (live) process, a fresh heartbeat
    assert RunReader(run).poll().status.live is True
    result = pimm("stop", run, timeout=60)
    assert result.returncode == 0, describe(result)
    assert (run / "control" / "stop").is_file()


@pytest.mark.parametrize("value, empty", [("0", "validation"), ("1", "training"), ("1.0", "training")])
def test_val_fraction_that_empties_a_split_is_refused(value, empty):
    message = config_error([f"data.val_fraction={value}"])
    assert f"data.val_fraction = {float(value)!r} leaves the {empty} split empty" in message, message
