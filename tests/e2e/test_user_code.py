"""A user's own model, data and objective (``tests/e2e/userpkg``), named by config targets
and passed through the Python API.

The package sits beside the config (a link in the test's directory), so the launch finds it
through the config's directory and torchrun's ranks through the ``PYTHONPATH`` the
launcher gives them. The model has BatchNorm and a tied head; the training split is
augmented per sample from ``(seed, epoch, index)`` in 2 workers per rank. A run stopped by
SIGTERM (sent by the user objective itself at a chosen step) and resumed ends with the
same weights, bit for bit, as an uninterrupted run, at 1 and 2 ranks and across a change of
per-rank workers at an epoch end.

The stopped runs and everything at two ranks are real processes (``USERPKG_SIGTERM_AT`` signals
the process itself); uninterrupted one-rank references and one-rank resumes run in this process
(``_helpers.pimm_here``, the user package imported anew), except the resume that is ``pimm resume``
in a fresh process finding the user code.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _helpers import REPO, clean_env, describe, hang_s, pimm_here, read_json

USERPKG = Path(__file__).resolve().parent / "userpkg"
STEPS = 12  # optimizer steps per epoch at 1 rank: 192 samples, batch 16

CONFIG = """\
objective = "userpkg.objective:smoothed_ce"

[train]
epochs = 2
lr = 0.01
warmup_steps = 2
log_every_steps = 1

[optimizer]
name = "AdamW"

[scheduler]
name = "cosine"

[data]
target = "userpkg.data:digits_aug"
batch_size = 16
num_workers = 2
[data.args]
train = 192
val = 61

[model]
target = "userpkg.nets:tied_bn"
[model.args]
width = 16

[ema]
enabled = true
decay = 0.9

[eval]
metric = "val/err"
mode = "min"
weights = "ema"
"""


def _config(tmp_path: Path, text: str = CONFIG) -> Path:
    (tmp_path / "userpkg").symlink_to(USERPKG)  # beside the config: found through its directory
    path = tmp_path / "user.toml"
    path.write_text(text)
    return path


def _launch(config: Path, root: Path, name: str, *args: str, nproc: int | None = None, env: dict | None = None,
            overrides: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(config), "--run.root", str(root),
           "--run.name", name, "--run.no-timestamp", *args]
    if nproc is not None:
        cmd += ["--nproc-per-node", str(nproc)]
    if overrides:
        cmd += ["--", *overrides]
    # run from the repository (not the config's directory): the config's directory must be searched
    return subprocess.run(cmd, cwd=REPO, env={**clean_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=hang_s(300))


def _launch_here(config: Path, root: Path, name: str, *args: str, nproc: int | None = None,
                 overrides: tuple[str, ...] = (), fresh: str | None = None) -> subprocess.CompletedProcess[str]:
    """:func:`_launch` in this process (``pimm_here``): refusals decided before any rank, one-rank runs
    (``fresh="userpkg"``: the user package imported anew, as in a fresh process)."""
    cmd = ["launch", "--train.config", str(config), "--run.root", str(root), "--run.name", name, "--run.no-timestamp",
           *args]
    if nproc is not None:
        cmd += ["--nproc-per-node", str(nproc)]
    if overrides:
        cmd += ["--", *overrides]
    return pimm_here(*cmd, fresh=fresh)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model" / "last" / "weights.pth", map_location="cpu", weights_only=True)["state_dict"]


def _equal(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """``full_run(nproc)``: the run directory of an uninterrupted run of CONFIG at ``nproc`` ranks
    (None: one rank, in this process), trained once per world size for the module's bitwise comparisons.
    Read only."""
    runs: dict[int | None, Path] = {}

    def get(nproc: int | None) -> Path:
        if nproc not in runs:
            where = tmp_path_factory.mktemp("full")
            if nproc is None:
                full = _launch_here(_config(where), where / "exp", "full", fresh="userpkg")
            else:
                full = _launch(_config(where), where / "exp", "full", nproc=nproc)
            assert full.returncode == 0, describe(full)
            runs[nproc] = where / "exp" / "default" / "full"
        return runs[nproc]
    return get


def _cut_and_resume(tmp_path: Path, nproc: int | None, stop_at: int, resume_workers: int,
                    how: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A run of CONFIG stopped by SIGTERM after step ``stop_at`` (a real process), then resumed with
    ``resume_workers`` workers per rank: ``how`` = "launch" (``--train.resume``, a real process), "here"
    (the same in this process, one rank) or "pimm resume" (``pimm resume RUN`` in a real process, from the
    repository: elsewhere than the user package). Returns the run directory and the resume's result."""
    config = _config(tmp_path)
    root = tmp_path / "exp"
    mark = tmp_path / "sigterm-sent"
    env = {"USERPKG_SIGTERM_AT": str(stop_at), "USERPKG_SIGTERM_MARK": str(mark)}
    cut = _launch(config, root, "cut", nproc=nproc, env=env)
    assert cut.returncode == 0, describe(cut)
    assert mark.exists() and "stopped" in cut.stdout, describe(cut)
    run_cut = root / "default" / "cut"
    assert read_json(run_cut / "status.json")["state"] == "stopped"
    workers = (f"data.num_workers={resume_workers}",)
    if how == "here":
        resumed = _launch_here(config, root, "cut", "--train.resume", overrides=workers, fresh="userpkg")
    elif how == "pimm resume":
        resumed = subprocess.run([sys.executable, "-m", "pimm_core.cli", "resume", str(run_cut), "--", *workers],
                                 cwd=REPO, env={**clean_env(), **env}, capture_output=True, text=True,
                                 timeout=hang_s(300))
    else:
        resumed = _launch(config, root, "cut", "--train.resume", nproc=nproc, env=env, overrides=workers)
    return run_cut, resumed


@pytest.fixture(scope="module")
def resumed_by_pimm_resume(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
    """The 1rank-mid case below, resumed by ``pimm resume RUN``: the test's directory, the run, the resume."""
    tmp = tmp_path_factory.mktemp("pimm-resume")
    return (tmp, *_cut_and_resume(tmp, None, 7, 2, "pimm resume"))


@pytest.mark.parametrize("nproc,stop_at,resume_workers", [(None, 7, 2), (None, STEPS, 0), (2, 4, 2)],
                         ids=["1rank-mid", "1rank-epoch-end-workers-2to0", "2ranks-mid"])
def test_sigterm_then_resume_is_bitwise_equal(request, tmp_path, full_run, nproc, stop_at, resume_workers):
    if (nproc, stop_at) == (None, 7):
        _, run_cut, resumed = request.getfixturevalue("resumed_by_pimm_resume")
    else:
        run_cut, resumed = _cut_and_resume(tmp_path, nproc, stop_at, resume_workers,
                                           "launch" if nproc else "here")
    assert resumed.returncode == 0, describe(resumed)
    assert read_json(run_cut / "status.json")["state"] == "finished"
    start = read_json(run_cut / "provenance.json")["starts"][-1]
    assert start["kind"] == "resume" and start["checkpoint_step"] == stop_at
    _equal(full_run(nproc), run_cut)
    # the user objective's metrics, reduced over every validation sample once
    val = [r for r in map(__import__("json").loads, (run_cut / "metrics.jsonl").read_text().splitlines())
           if r["split"] == "val"]
    assert val and set(val[-1]) >= {"loss", "err"}


_WRONG = [
    ("model.target=\"userpkg.nope:tied_bn\"", "model.target", "module 'userpkg.nope' not found"),
    ("model.target=\"userpkg.nets:tied\"", "model.target", "has no attribute 'tied'"),
    ("model.args.widht=3", "model.args.widht", "did you mean 'width'"),
    ("objective=\"userpkg.objective:nothing\"", "objective", "has no attribute 'nothing'"),
]


@pytest.mark.parametrize("override,key,words", _WRONG)
def test_wrong_targets_are_one_error_line_before_any_rank(tmp_path, override, key, words):
    """The first case's launch through the console script in a subprocess (the wiring); its dry run and
    the other cases are the same refusal, decided before any rank, so they run in this process (no
    ``import torch`` each; the user package imported anew each time, as in a fresh process)."""
    config = _config(tmp_path)
    for args in ((), ("--dry-run",)):
        if override == _WRONG[0][0] and not args:
            r = _launch(config, tmp_path / "exp", "bad", *args, nproc=2, overrides=(override,))
        else:
            r = _launch_here(config, tmp_path / "exp", "bad", *args, nproc=2, overrides=(override,), fresh="userpkg")
        assert r.returncode == 2, describe(r)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and key in errors[0] and words in errors[0], describe(r)
        assert "Traceback" not in r.stderr
        assert not (tmp_path / "exp" / "default" / "bad").exists()  # refused before the run directory


def test_python_api_overrides_what_the_config_names(tmp_path, monkeypatch):
    from pimm_core import Trainer, TrainConfig, load_config

    monkeypatch.syspath_prepend(str(USERPKG.parent))
    from userpkg.data import digits_aug
    from userpkg.nets import tied_bn

    seen = []

    def objective(model, batch):
        seen.append(len(batch[0]))
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        return loss, {"loss": loss.detach()}

    cfg = load_config(None, ["data.batch_size=32", "eval.metric=\"val/loss\"", "eval.mode=\"min\""])
    trainer = Trainer(cfg, model=tied_bn(8), datasets=digits_aug(64, 40), objective=objective)
    state = trainer.train(TrainConfig(epochs=1, lr=0.01), checkpoint_dir=tmp_path / "ckpt")
    assert state.global_step == 2 and state.finished
    assert seen[:2] == [32, 32] and sum(seen[2:]) == 40  # training, then every validation sample once
    assert trainer.state.last_eval.keys() == {"val/loss"}
    saved = torch.load(tmp_path / "ckpt" / "last" / "weights.pth", weights_only=True)["state_dict"]
    assert "body.1.running_mean" in saved  # the user model's buffers are in the checkpoint


def test_tensorboard_without_the_package_is_one_error_line(tmp_path, monkeypatch):
    # tensorboard absent, the way Python itself blocks an import (a None entry in sys.modules: importing it
    # raises ModuleNotFoundError), in this process for the call; torch's module that imports it, anew
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    r = _launch_here(_config(tmp_path), tmp_path / "exp", "tb", overrides=("log.tensorboard=true",), fresh="userpkg")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1, describe(r)
    assert "log.tensorboard" in errors[0] and "pip install tensorboard" in errors[0]


def test_stateful_stream_in_two_workers_resumes_bitwise(tmp_path):
    """A streaming train split with its own state_dict/load_state_dict, read by 2 workers,
    stopped mid-epoch by SIGTERM and resumed: the same weights as an uninterrupted run."""
    config = _config(tmp_path)
    root = tmp_path / "exp"
    stream = ("data.target=\"userpkg.stream:digits_stream\"",)
    full = _launch_here(config, root, "full", overrides=stream, fresh="userpkg")  # the reference, in this process
    assert full.returncode == 0, describe(full)
    mark = tmp_path / "sigterm-sent"
    env = {"USERPKG_SIGTERM_AT": "7", "USERPKG_SIGTERM_MARK": str(mark)}
    cut = _launch(config, root, "cut", env=env, overrides=stream)
    assert cut.returncode == 0 and mark.exists(), describe(cut)
    resumed = _launch_here(config, root, "cut", "--train.resume", overrides=stream, fresh="userpkg")
    assert resumed.returncode == 0, describe(resumed)
    start = read_json(root / "default" / "cut" / "provenance.json")["starts"][-1]
    assert start["checkpoint_step"] == 7 and start["exact"] and start["data_resume"] == "exact"
    _equal(root / "default" / "full", root / "default" / "cut")


def test_pimm_resume_finds_the_user_code_beside_the_original_config(resumed_by_pimm_resume):
    """`pimm resume RUN` reads config.toml from the run directory, elsewhere than the user
    package: it imports the package from the directories the run recorded (the 1rank-mid case
    above, resumed so in a fresh process started from the repository)."""
    tmp_path, run, resumed = resumed_by_pimm_resume
    first = read_json(run / "provenance.json")["starts"][0]
    assert first["kind"] == "start" and str(tmp_path) in first["code_search_path"]
    assert resumed.returncode == 0, describe(resumed)
    assert read_json(run / "status.json")["state"] == "finished"
    assert [e["kind"] for e in read_json(run / "provenance.json")["starts"] if "checkpoint" in e] == ["resume"]
