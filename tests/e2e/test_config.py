"""Config loading: the bundled file, dotted overrides, and one-line ConfigErrors (API and CLI)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from _helpers import DIGITS, pimm
from pimm_core.config import Config, config_from_dict, load_config, write_config
from pimm_core.errors import ConfigError


def error_of(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message, f"ConfigError message is not one line: {message!r}"
    assert info.value.exit_code == 2
    return message


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- loading
def test_bundled_config_loads_with_its_values():
    cfg = load_config(DIGITS)
    assert isinstance(cfg, Config)
    assert cfg.checkpoint_format == "standard"
    assert cfg.run.group == "digits"
    assert (cfg.train.epochs, cfg.train.lr, cfg.train.warmup_steps) == (30, 0.002, 20)
    assert isinstance(cfg.train.lr, float)
    assert (cfg.data.name, cfg.data.batch_size, cfg.data.num_workers) == ("digits", 32, 0)
    assert (cfg.model.name, cfg.model.hidden) == ("mlp", 128)
    assert cfg.train.max_steps is None  # commented out in the file
    assert (cfg.eval.metric, cfg.eval.mode) == ("val/acc", "max")


def test_no_file_gives_defaults():
    assert load_config(None) == Config()


def test_overrides_use_toml_values_and_bare_strings():
    cfg = load_config(DIGITS, ["train.epochs=3", "checkpoint_format=standard", "train.lr=3e-4", 'run.group="x"'])
    assert cfg.train.epochs == 3 and isinstance(cfg.train.epochs, int)
    assert cfg.checkpoint_format == "standard"  # unquoted: taken as a bare string
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    assert cfg.run.group == "x"


def test_int_override_of_float_key_becomes_float():
    cfg = load_config(DIGITS, ["train.lr=1"])
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)


def test_later_override_wins_and_extra_applies_last():
    cfg = load_config(DIGITS, ["train.epochs=3", "train.epochs=4"], {"train.epochs": 5, "run.no_timestamp": True})
    assert cfg.train.epochs == 5
    assert cfg.run.no_timestamp is True


def test_optional_key_can_be_set_by_override():
    assert load_config(DIGITS, ["train.max_steps=7"]).train.max_steps == 7


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(DIGITS, ["train.epochs=3", "train.lr=3e-4", 'run.group="x"'])
    out = tmp_path / "config.toml"
    write_config(cfg, out)
    assert config_from_dict(tomllib.loads(out.read_text())) == cfg
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]  # no temporary left behind


# ---------------------------------------------------------------------------- errors
def test_unknown_override_key_suggests_near_miss():
    message = error_of(DIGITS, ["train.epoch=3"])
    assert "train.epoch" in message
    assert "did you mean train.epochs" in message


def test_unknown_key_in_file_names_file_and_line(tmp_path):
    path = write(tmp_path, "# a comment\n[train]\nseed = 1\nepoch = 3\n")
    message = error_of(path)
    assert f"{path}:4" in message
    assert "did you mean train.epochs" in message


def test_unknown_key_without_near_miss_points_at_known_keys():
    message = error_of(DIGITS, ["zzzzzz=1"])
    assert "unknown key zzzzzz" in message
    assert "did you mean" not in message


def test_wrong_type_in_file_names_key_file_and_line(tmp_path):
    path = write(tmp_path, '[train]\nepochs = "three"\n')
    message = error_of(path)
    assert f"{path}:2" in message
    assert "train.epochs must be an integer" in message


@pytest.mark.parametrize("override, key", [
    ("train.epochs=three", "train.epochs"),
    ("train.epochs=1.5", "train.epochs"),
    ("train.lr=abc", "train.lr"),
    ("run.no_timestamp=1", "run.no_timestamp"),
    ("train=3", "train"),
])
def test_wrong_type_override(override, key):
    message = error_of(DIGITS, [override])
    assert key in message and "override" in message


def test_bad_toml_reports_line(tmp_path):
    path = write(tmp_path, "[train]\nepochs = 3\nlr = = 2\n")
    message = error_of(path)
    assert str(path) in message
    assert "invalid TOML" in message
    assert re.search(r"line 3\b", message), message


def test_missing_file():
    message = error_of("does/not/exist.toml")
    assert "does/not/exist.toml" in message and "does not exist" in message


def test_directory_instead_of_file(tmp_path):
    assert "directory" in error_of(tmp_path)


@pytest.mark.parametrize("override, key", [
    ("train.epochs=0", "train.epochs"),
    ("data.batch_size=0", "data.batch_size"),
    ("train.lr=-1", "train.lr"),
    ("model.dropout=1.5", "model.dropout"),
    ("train.max_steps=0", "train.max_steps"),
])
def test_out_of_range_override(override, key):
    message = error_of(DIGITS, [override])
    assert key in message and "out of range" in message


def test_out_of_range_in_file_names_line(tmp_path):
    path = write(tmp_path, "[model]\nhidden = 64\n\n[train]\n# zero epochs\nepochs = 0\n")
    message = error_of(path)
    assert f"{path}:6" in message and "out of range" in message


def test_unknown_checkpoint_format_lists_choices():
    message = error_of(DIGITS, ["checkpoint_format=bogus"])
    assert "checkpoint_format" in message and "'standard'" in message


@pytest.mark.parametrize("fmt", ["standard", "legacy", "single"])
def test_every_checkpoint_format_is_accepted(fmt):
    assert load_config(DIGITS, [f"checkpoint_format={fmt}"]).checkpoint_format == fmt


def test_unknown_checkpoint_format_names_the_choices():
    message = error_of(DIGITS, ["checkpoint_format=zarr"])
    assert "checkpoint_format" in message and "'legacy'" in message and "'single'" in message


def test_override_without_equals():
    assert "key=value" in error_of(DIGITS, ["train.epochs"])


# ------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("case", ["unknown_key", "wrong_type", "bad_toml", "missing", "bad_override", "range"])
def test_cli_config_errors_are_one_line_exit_2(tmp_path, case):
    files = {
        "unknown_key": "[train]\nepoch = 3\n",
        "wrong_type": '[train]\nepochs = "x"\n',
        "bad_toml": "[train\nepochs = 3\n",
        "range": "[data]\nbatch_size = 0\n",
    }
    config = tmp_path / "bad.toml"
    overrides: list[str] = []
    if case in files:
        config.write_text(files[case])
    elif case == "bad_override":
        config = DIGITS
        overrides = ["--", "train.epoch=3"]
    result = pimm("launch", "--train.config", config, "--run.root", tmp_path / "exp", *overrides, timeout=60)
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "exp").exists()  # nothing created for a rejected launch


@pytest.mark.parametrize("root", ["s3://bucket/exp", "gs://bucket/exp", "file:///tmp/exp"])
def test_remote_url_as_run_root_is_one_line_exit_2_and_creates_nothing(tmp_path, root):
    """The run directory must be a local path: a URL is refused rather than trained into ``./s3:/``."""
    result = pimm("launch", "--train.config", DIGITS, "--run.root", root, cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "run.root" in lines[0], result.stderr
    assert "checkpoint.remote" in lines[0]  # the fix: a local root, the URL as checkpoint.remote
    assert list(tmp_path.iterdir()) == []  # no directory named "s3:" (or anything else)


def test_checkpoint_remote_must_be_a_url():
    message = error_of(DIGITS, ["checkpoint.remote=bucket/prefix"])
    assert "checkpoint.remote" in message and "s3://" in message
    assert load_config(DIGITS, ["checkpoint.remote=s3://b/p"]).checkpoint.remote == "s3://b/p"
