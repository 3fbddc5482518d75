"""The command line's own surface: help text, version, the seeds' module spellings."""

from __future__ import annotations

import subprocess
import sys

import pytest

from _helpers import REPO, clean_env, hang_s, pimm, pimm_here

COMMANDS = [[], ["launch"], ["resume"], ["stop"], ["tui"], ["export"], ["checkpoints"], ["checkpoints", "ls"],
            ["checkpoints", "latest"], ["checkpoints", "verify"], ["checkpoints", "diff"]]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "pimm")
def test_help_is_plain(cmd):
    r = pimm(*cmd, "--help")
    assert r.returncode == 0, r.stderr
    usage = r.stdout.splitlines()[0]
    assert usage.startswith("Usage: pimm") and "{" not in usage and "}" not in usage, usage
    assert "<bool>" not in r.stdout  # flags take no value


def test_help_lists_choices_and_usage_names():
    r = pimm("export", "--help")
    assert "--weights <raw|ema>" in r.stdout and "--format <safetensors|bin>" in r.stdout
    assert r.stdout.splitlines()[0] == "Usage: pimm export [OPTIONS] CHECKPOINT OUT_DIR"
    assert pimm("resume", "--help").stdout.splitlines()[0] == "Usage: pimm resume [OPTIONS] RUN_DIR [OVERRIDES]..."


def test_version():
    from importlib.metadata import version

    r = pimm("--version")
    assert r.returncode == 0 and r.stdout == f"pimm {version('pimm')}\n"


@pytest.mark.parametrize("n", ["0", "-1"])
def test_nproc_per_node_below_one_is_refused(n, tmp_path):
    r = pimm("launch", "--train.config", REPO / "configs" / "digits.toml", "--run.root", tmp_path,
             "--nproc-per-node", n)
    assert r.returncode == 2 and r.stderr == f"error: --nproc-per-node must be at least 1 (got {n})\n"
    assert not any(tmp_path.iterdir())  # nothing trained, nothing written


def test_a_malformed_rdzv_conf_is_one_line(tmp_path):
    r = pimm_here("launch", "--train.config", REPO / "configs" / "digits.toml", "--run.root", tmp_path,
                  "--nproc-per-node", "2", "--rdzv-conf", "last_call_timeout=5,keep_alive_interval")
    assert r.returncode == 2 and r.stderr == ("error: --rdzv-conf must be KEY=VALUE,... (got 'last_call_timeout=5,"
                                              "keep_alive_interval': The rendezvous configuration option "
                                              "'keep_alive_interval' must have a value specified.)\n"), r.stderr
    assert not any(tmp_path.iterdir())


def test_seed_spellings(tmp_path):
    """``python -m pimm.utils.path`` and ``from pimm_core import TrainConfig`` work as the seeds write them."""
    r = subprocess.run([sys.executable, "-m", "pimm.utils.path", "latest-checkpoint", str(tmp_path)], cwd=tmp_path,
                       env=clean_env(), capture_output=True, text=True, timeout=hang_s(60))
    assert r.returncode == 1 and r.stderr.startswith("error: no complete checkpoint in"), r.stderr
    from pimm_core import TrainConfig
    from pimm_core.config import TrainConfig as Same

    assert TrainConfig is Same and TrainConfig(epochs=100).epochs == 100


def test_launch_needs_a_config(tmp_path):
    r = pimm("launch", "--run.root", tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: pimm launch needs --train.config FILE"), r.stderr
    assert not any(tmp_path.iterdir())


def test_usage_error_points_to_the_sub_commands_help():
    """A mistyped option names the help of the command it was given to, which lists the right one."""
    r = pimm("checkpoints", "ls", "--bogus")
    assert r.returncode == 2 and r.stderr == "error: No such option: --bogus; see `pimm checkpoints ls --help`\n"
    r = pimm("chekpoints")
    assert r.returncode == 2 and r.stderr.endswith("see `pimm --help`\n") and r.stderr.count("\n") == 1, r.stderr


def test_a_bad_flag_value_is_named_as_the_flag(tmp_path):
    """A value given by a flag is reported as that flag, not as an override the user never wrote."""
    r = pimm("launch", "--train.config", REPO / "configs" / "digits.toml", "--run.root", tmp_path, "--run.name", "a/b")
    assert r.returncode == 2 and r.stderr.startswith("error: --run.name: run.name = 'a/b' holds '/'"), r.stderr
    r = pimm("launch", "--train.config", REPO / "configs" / "digits.toml", "--run.root", tmp_path, "--", "run.name='a/b'")
    assert r.returncode == 2 and r.stderr.startswith("error: override: run.name = 'a/b' holds '/'"), r.stderr
    assert not any(tmp_path.iterdir())  # nothing written
