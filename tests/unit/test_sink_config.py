"""``[log.mlflow]``, ``[log.wandb]`` and ``[[callbacks]]`` tables: present means used, and a run's
saved ``config.toml`` keeps them (a resume reads it), even with every key at its default."""

from __future__ import annotations

import tomllib

import pytest

from pimm_core.config import config_from_dict, load_config, write_config
from pimm_core.errors import ConfigError
from pimm_core.train.sinks import run_params


def test_sink_tables_are_off_unless_present_and_survive_the_saved_config(tmp_path):
    assert load_config(None).log.mlflow is None and load_config(None).log.wandb is None
    path = tmp_path / "c.toml"
    path.write_text('[log.mlflow]\n\n[log.wandb]\n\n[[callbacks]]\ntarget = "m:F"\n[callbacks.args]\nn = 1\n')
    cfg = load_config(path)
    assert cfg.log.mlflow is not None and cfg.log.mlflow.experiment == "" and cfg.log.wandb.mode == ""
    assert cfg.callbacks[0].args == {"n": 1}
    write_config(cfg, tmp_path / "saved.toml")
    again = config_from_dict(tomllib.loads((tmp_path / "saved.toml").read_text()))
    assert again.log == cfg.log and again.callbacks == cfg.callbacks


def test_a_callback_table_with_an_unknown_key_is_named(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[[callbacks]]\ntarget = "m:F"\nargz = 1\n')
    with pytest.raises(ConfigError, match=r"callbacks\[0\]\.argz"):
        load_config(path)


def test_run_params_are_the_config_and_the_provenance_as_text():
    params = run_params(load_config(None, ["train.lr=0.5"]), {"world_size": 2, "code_version": None})
    assert params["train.lr"] == "0.5" and params["provenance.world_size"] == "2"
    assert "provenance.code_version" not in params


def test_no_sink_package_is_imported_unless_its_sink_is_configured(tmp_path):
    import subprocess
    import sys

    code = ("import sys\nfrom pathlib import Path\nfrom pimm_core.config import load_config\n"
            "from pimm_core.train.sinks import open_sinks\nimport pimm_core.trainer\n"
            f"assert open_sinks(load_config(None), Path({str(tmp_path)!r}), resumed_at=None, eval_done=True,"
            " provenance={}) == []\n"
            "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
