"""``pimm config show``: the resolved config as TOML, every schema key listed, changes marked."""

from __future__ import annotations

import tomllib

from _helpers import DIGITS, describe, pimm, pimm_here


def test_config_show_lists_every_key_and_marks_what_differs(tmp_path):
    from pimm_core.config import Config, load_config
    from pimm_core.config.tables import all_keys

    r = pimm_here("config", "show", "--train.config", DIGITS, "--", "train.epochs=3", "data.num_workers=2")
    assert r.returncode == 0, describe(r)
    lines = r.stdout.splitlines()
    assert "epochs = 3  # changed; default: 10" in lines
    assert "num_workers = 2  # changed; default: 0" in lines
    assert "seed = 0" in lines  # the default, unmarked
    # every key of the schema appears, set or (commented) unset, under its table
    table, shown = "", set()
    for line in lines:
        if line.startswith("["):
            table = line.strip("[]") + "."
        elif "=" in line:
            shown.add(table + line.lstrip("# ").split(" =", 1)[0])
    assert set(all_keys(Config)) <= shown, sorted(set(all_keys(Config)) - shown)
    # what it prints is the config a launch uses
    out = tmp_path / "shown.toml"
    out.write_text(r.stdout)
    tomllib.loads(r.stdout)
    assert load_config(out) == load_config(DIGITS, ["train.epochs=3", "data.num_workers=2"])


def test_config_show_names_the_fsdp_units_train_blocks_matches():
    r = pimm("config", "show", "--train.config", DIGITS, "--", 'train.strategy="fsdp"', 'train.blocks=["Linear"]')
    assert r.returncode == 0, describe(r)
    tail = r.stdout.split("# train.blocks matched", 1)[1].splitlines()
    assert tail[0] == " 3 module(s), each a FSDP unit (then the root):", r.stdout
    assert [line.split()[1] for line in tail[1:]] == ["net.0", "net.3", "net.6"]


def test_config_show_refusals_are_one_line():
    r = pimm("config", "show", "--train.config", DIGITS, "--", "train.epochs=nope")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, describe(r)
    r = pimm("config", "show")
    assert r.returncode == 2 and "needs --train.config" in r.stderr, describe(r)


def test_config_show_lists_the_keys_of_a_sink_table_the_config_turns_on(tmp_path):
    from pimm_core.config import load_config

    r = pimm_here("config", "show", "--train.config", DIGITS, "--", 'log.wandb.mode="offline"',
                  'log.mlflow.experiment="e"')
    assert r.returncode == 0, describe(r)
    text = r.stdout
    assert '[log.wandb]\nproject = ""\nentity = ""\nmode = "offline"  # changed; default: ""' in text
    assert '[log.mlflow]\ntracking_uri = ""\nexperiment = "e"  # changed; default: ""' in text
    out = tmp_path / "shown.toml"
    out.write_text(text)
    assert load_config(out) == load_config(DIGITS, ['log.wandb.mode="offline"', 'log.mlflow.experiment="e"'])
