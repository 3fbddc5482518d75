"""Config targets ("package.module:attr"): where user code is found, the args checked
against the signature before the call, one-line errors naming the key, and the user's own
exceptions left alone."""

from __future__ import annotations

import os
import sys
import uuid

import pytest

from pimm_core.errors import ConfigError
from pimm_core.targets import TargetSpec, call, check_args, child_env, install_search_path, resolve, search_path

USER_CODE = """
import math

def build(width, depth=4, *, act="relu"):
    return {"width": width, "depth": depth, "act": act}

class Net:
    def __init__(self, hidden: int, dropout: float = 0.1):
        self.hidden, self.dropout = hidden, dropout

    @classmethod
    def small(cls, hidden=8):
        return cls(hidden)

def explode(**kw):
    raise RuntimeError("boom in user code")

def pos_only(a, /, b=1):
    return a, b

def anything(**kw):
    return kw

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    """A fresh package ``u<hex>`` with module ``mod`` in a directory that is the config's
    (not the working directory); returns ``(package name, config path)``."""
    name = f"u{uuid.uuid4().hex[:10]}"
    proj = tmp_path / "proj"
    (proj / name).mkdir(parents=True)
    (proj / name / "__init__.py").write_text("")
    (proj / name / "mod.py").write_text(USER_CODE)
    (proj / name / "broken.py").write_text("import not_a_real_dependency_xyz\n")
    (proj / name / "raises.py").write_text("raise ValueError('user module failed at import')\n")
    cfg = proj / "run.toml"
    cfg.write_text("")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name, cfg
    for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[m]


def spec(target: str, **args) -> TargetSpec:
    return TargetSpec("model.target", target, args, "model.args")


def test_search_path_is_cwd_then_config_dir_and_goes_first(user_pkg, tmp_path):
    _, cfg = user_pkg
    assert search_path(cfg) == [os.getcwd(), str(cfg.parent)]
    assert search_path(None) == [os.getcwd()]
    install_search_path(cfg)
    assert sys.path[:2] == [os.getcwd(), str(cfg.parent)]
    install_search_path(cfg)  # idempotent: no duplicates
    assert sys.path.count(str(cfg.parent)) == 1


def test_child_env_puts_the_search_path_first_on_pythonpath(user_pkg):
    _, cfg = user_pkg
    env = child_env(cfg, {"PYTHONPATH": os.pathsep.join(["/elsewhere", str(cfg.parent)]), "X": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [os.getcwd(), str(cfg.parent), "/elsewhere"]
    assert env["X"] == "1"


def test_the_working_directory_shadows_the_config_directory(user_pkg, tmp_path):
    name, cfg = user_pkg
    (tmp_path / "work" / name).mkdir()
    (tmp_path / "work" / name / "__init__.py").write_text("")
    (tmp_path / "work" / name / "mod.py").write_text("def build(width):\n    return 'from cwd'\n")
    assert call(spec(f"{name}.mod:build", width=1), config_path=cfg) == "from cwd"


def test_call_passes_args_and_resolves_dotted_attributes(user_pkg):
    name, cfg = user_pkg
    assert call(spec(f"{name}.mod:build", width=3, act="gelu"), config_path=cfg) == {"width": 3, "depth": 4, "act": "gelu"}
    net = call(spec(f"{name}.mod:Net.small"), config_path=cfg)
    assert net.hidden == 8
    assert call(spec(f"{name}.mod:Net", hidden=5), config_path=cfg).dropout == 0.1


def test_pimm_passes_positional_and_provided_arguments(user_pkg):
    name, cfg = user_pkg
    assert call(spec(f"{name}.mod:build"), 7, config_path=cfg, depth=2) == {"width": 7, "depth": 2, "act": "relu"}
    with pytest.raises(ConfigError, match=r"^model.args.depth: pimm sets 'depth' itself"):
        call(spec(f"{name}.mod:build", depth=1), 7, config_path=cfg, depth=2)
    with pytest.raises(ConfigError, match=r"^model.args.width: pimm sets 'width' itself"):
        call(spec(f"{name}.mod:build", width=1), 7, config_path=cfg)


@pytest.mark.parametrize("target,args,message", [
    ("{p}.nope:build", {}, "model.target = \"{p}.nope:build\": module '{p}.nope' not found (searched "),
    ("{p}.mod:buidl", {}, "model.target = \"{p}.mod:buidl\": '{p}.mod' has no attribute 'buidl'; did you mean 'build'?"),
    ("{p}.mod:Net.large", {}, "model.target = \"{p}.mod:Net.large\": '{p}.mod.Net' has no attribute 'large'"),
    ("{p}.mod", {}, "model.target = \"{p}.mod\": not a target; write 'package.module:attr'"),
    ("{p}.mod:NOT_CALLABLE", {}, "model.target = \"{p}.mod:NOT_CALLABLE\": int object is not callable"),
    ("{p}.mod:build", {"widht": 2}, "model.args.widht: {p}.mod:build has no parameter 'widht'; did you mean 'width'?"),
    ("{p}.mod:build", {"zzz": 2, "width": 1}, "model.args.zzz: {p}.mod:build has no parameter 'zzz'"),
    ("{p}.mod:build", {"depth": 2}, "model.args: {p}.mod:build needs 'width'; set model.args.width"),
    ("{p}.mod:Net", {}, "model.args: {p}.mod:Net needs 'hidden'; set model.args.hidden"),
    ("{p}.mod:pos_only", {}, "model.target = \"{p}.mod:pos_only\": parameter 'a' is positional-only"),
])
def test_a_wrong_target_is_one_config_error_line_naming_the_key(user_pkg, target, args, message):
    name, cfg = user_pkg
    with pytest.raises(ConfigError) as e:
        call(spec(target.format(p=name), **args), config_path=cfg)
    text = str(e.value)
    assert text.startswith(message.format(p=name)) and "\n" not in text
    assert e.value.exit_code == 2
    if "did you mean" not in message:
        assert "did you mean" not in text


@pytest.mark.parametrize("key", ["objective", "train.blocks"])
def test_a_target_without_an_args_table_is_never_told_to_set_one(user_pkg, key):
    """``objective`` and ``train.blocks`` have no args table: a required parameter beyond
    pimm's positional arguments names the fix that exists (a default), not ``objective.width``."""
    name, cfg = user_pkg
    with pytest.raises(ConfigError) as e:
        call(TargetSpec(key, f"{name}.mod:Net"), config_path=cfg)
    text = str(e.value)
    assert text.startswith(f"{key} = \"{name}.mod:Net\": parameter 'hidden' has no default, but pimm calls it "
                           "with 0 positional argument(s) only") and "\n" not in text
    assert f"{key}.hidden" not in text and "give 'hidden' a default" in text
    assert call(TargetSpec(key, f"{name}.mod:build"), 3, config_path=cfg)["width"] == 3


def test_unknown_args_pass_through_var_keyword(user_pkg):
    name, cfg = user_pkg
    assert call(spec(f"{name}.mod:anything", a=1, b=[2]), config_path=cfg) == {"a": 1, "b": [2]}


def test_user_exceptions_propagate_unchanged(user_pkg):
    name, cfg = user_pkg
    with pytest.raises(RuntimeError, match="boom in user code") as e:
        call(spec(f"{name}.mod:explode"), config_path=cfg)
    assert any(f.name == "explode" for f in __import__("traceback").extract_tb(e.tb))  # the user's frame is kept
    with pytest.raises(ValueError, match="user module failed at import"):
        resolve(spec(f"{name}.raises:x"), cfg)
    # a package the user's module imports is missing: that is the user's error, not a wrong target
    with pytest.raises(ModuleNotFoundError, match="not_a_real_dependency_xyz"):
        resolve(spec(f"{name}.broken:x"), cfg)


def test_args_are_checked_before_the_call(user_pkg):
    """``check_args`` never runs the target: a wrong argument to ``explode``-like code is caught first."""
    calls = []

    def fn(a, b=2):
        calls.append(1)

    with pytest.raises(ConfigError):
        check_args(spec("x.y:fn", c=1), fn)
    check_args(spec("x.y:fn", a=1), fn)
    assert calls == []


def test_installed_packages_are_found_last(user_pkg):
    """A target in an installed package (here the standard library) resolves too."""
    _, cfg = user_pkg
    assert call(TargetSpec("data.target", "textwrap:dedent", {"text": "  a"}, "data.args"), config_path=cfg) == "a"
