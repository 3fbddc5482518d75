"""Resumes where the world under the run changed between its save and its resume (issue 27):
the training data (its length or fingerprint); the disk (a previous generation that cannot be removed);
the optimizer a load fills (never stepped by the load).

Real launches of a user package (``tests/e2e/userpkg``): the data's items carry their index and
the objective records, per rank, every index it trained, so a test reads the samples trained.
Runs stopped by a signal and runs at two ranks are real processes; dry runs and one-rank resumes
run in this process (``_helpers.pimm_here``: the same code without a subprocess importing torch).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import REPO, TORCHRUN, clean_env, describe, hang_s, pimm, pimm_here, read_json, release, undeletable
from _resume_driver import run_job
from conftest import STOPPED_AT, STOPPED_OVERRIDES

USERPKG = Path(__file__).resolve().parent / "userpkg"

CONFIG = """\
objective = "userpkg.objective:seen_ce"

[train]
epochs = 2
lr = 0.01
warmup_steps = 2
log_every_steps = 1

[data]
target = "userpkg.data:indexed"
batch_size = 10
num_workers = 0
[data.args]
train = 100
val = 20

[model]
name = "mlp"
hidden = 16

[eval]
metric = "val/loss"
mode = "min"
"""


def _config(tmp_path: Path) -> Path:
    (tmp_path / "userpkg").symlink_to(USERPKG)  # beside the config: found through its directory
    path = tmp_path / "user.toml"
    path.write_text(CONFIG)
    return path


def _launch(config: Path, root: Path, *args: str, env: dict | None = None, overrides: tuple[str, ...] = (),
            nproc: int | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(config), "--run.root", str(root),
           "--run.name", "run", "--run.no-timestamp", *args]
    if nproc is not None:
        cmd += ["--nproc-per-node", str(nproc)]
    if overrides:
        cmd += ["--", *overrides]
    return subprocess.run(cmd, cwd=REPO, env={**clean_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=hang_s(300))


def _here(config: Path, root: Path, *args: str, env: dict | None = None, overrides: tuple[str, ...] = (),
          nproc: int | None = None) -> subprocess.CompletedProcess[str]:
    """:func:`_launch` in this process (a dry run, or a one-rank launch), the user package imported anew."""
    cmd = ["launch", "--train.config", str(config), "--run.root", str(root), "--run.name", "run", "--run.no-timestamp",
           *args]
    if nproc is not None:
        cmd += ["--nproc-per-node", str(nproc)]
    if overrides:
        cmd += ["--", *overrides]
    return pimm_here(*cmd, env=env, fresh="userpkg")


def _seen(path: Path) -> list[list[int]]:
    """The batches rank 0 trained, in order (one list of indices each)."""
    return [list(map(int, line.split())) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> tuple[Path, Path]:
    """A run of 100 samples (10 batches an epoch) stopped by SIGTERM after its 6th step: 60 of 100 samples
    of epoch 0 trained, ``model/last`` holds the loader cursor."""
    tmp = tmp_path_factory.mktemp("data-changed")
    config = _config(tmp)
    env = {"USERPKG_SIGTERM_AT": "6", "USERPKG_SIGTERM_MARK": str(tmp / "sigterm-sent"),
           "USERPKG_SEEN": str(tmp / "seen-before")}
    cut = _launch(config, tmp / "exp", env=env)
    assert cut.returncode == 0, describe(cut)
    run = tmp / "exp" / "default" / "run"
    m = read_json(run / "model" / "last" / "manifest.json")
    assert (m["step"], m["epoch"], m["iter"], m["has_loader_state"]) == (6, 0, 6, True)
    assert m["data_length"] == 100
    assert len({i for b in _seen(tmp / "seen-before.rank0") for i in b}) == 60
    return config, tmp / "exp"


@pytest.mark.parametrize("n", [40, 200])
def test_changed_length_restarts_the_epoch_over_the_new_data(stopped, tmp_path, n):
    """Seen: 40 items, a torchdata traceback (exit 1) after a dry run promising exact continuation;
    200 items, exit 0 with the old cursor applied to the new permutation (60 samples skipped, exact: true)."""
    config, base = stopped
    root = tmp_path / "exp"
    shutil.copytree(base, root)
    (tmp_path / "userpkg").symlink_to(USERPKG)
    ovr = (f"data.args.train={n}",)
    dry = _here(config, root, "--train.resume", "--dry-run", overrides=ovr)
    assert dry.returncode == 0, describe(dry)
    assert "policy: the training data changed (its length or fingerprint)" in dry.stdout, dry.stdout
    assert "continue at: step 0, epoch 0, iter 0 (replay boundary: epoch 0 start, step 0; 6 batches replay)" \
        in dry.stdout, dry.stdout
    assert f"train samples 100 -> {n}" in dry.stdout
    seen = tmp_path / "seen"
    res = _here(config, root, "--train.resume", env={"USERPKG_SEEN": str(seen)}, overrides=ovr)
    assert res.returncode == 0, describe(res)
    assert "Traceback" not in res.stdout + res.stderr
    run = root / "default" / "run"
    assert read_json(run / "status.json")["state"] == "finished"
    entry = read_json(run / "provenance.json")["starts"][-1]
    assert (entry["kind"], entry["policy"], entry["exact"]) == ("resume", "data", False)
    assert (entry["step"], entry["epoch"], entry["iter"]) == (0, 0, 0)  # what the dry run said
    assert entry["replay_boundary"] == {"epoch": 0, "step": 0, "from_iter": 6}
    assert (entry["topology"]["saved_data_length"], entry["topology"]["data_length"]) == (100, n)
    assert any(f"train samples 100 -> {n}" in w for w in entry["warnings"])
    # both epochs over the new data, each sample once per epoch: nothing skipped, nothing past the end
    batches = _seen(seen.with_name("seen.rank0"))
    per_epoch = n // 10
    assert len(batches) == 2 * per_epoch
    for e in range(2):
        assert sorted(i for b in batches[e * per_epoch:(e + 1) * per_epoch] for i in b) == list(range(n))
    assert read_json(run / "model" / "last" / "manifest.json")["data_length"] == n


def test_same_data_continues_exactly(stopped, tmp_path):
    """The recorded length and fingerprint match: the cursor is applied, the 40 samples left train."""
    config, base = stopped
    root = tmp_path / "exp"
    shutil.copytree(base, root)
    (tmp_path / "userpkg").symlink_to(USERPKG)
    dry = _here(config, root, "--train.resume", "--dry-run")
    assert "(exact continuation)" in dry.stdout, describe(dry)
    seen = tmp_path / "seen"
    res = _here(config, root, "--train.resume", env={"USERPKG_SEEN": str(seen)})
    assert res.returncode == 0, describe(res)
    entry = read_json(root / "default" / "run" / "provenance.json")["starts"][-1]
    assert (entry["policy"], entry["exact"], entry["step"], entry["iter"]) == ("same", True, 6, 6)
    batches = _seen(seen.with_name("seen.rank0"))
    assert len(batches) == 4 + 10  # the rest of epoch 0, then epoch 1


# ------------------------------------------------------------------- the disk refuses
def test_an_undeletable_previous_generation_never_stops_the_saves(stopped_run, tmp_path):
    """Seen: with ``last.prev`` undeletable (a file kept immutable, as under an uploader on NFS) every save
    after the rotation failed ("checkpoint save failed: weights.pth: Operation not permitted"), stopping
    the run, the message naming the new checkpoint's file. Right: a warning naming the path that could not
    be removed, saves go on under names that do not collide, and a later save retries the removal."""
    run = tmp_path / "digits" / "base"
    shutil.copytree(stopped_run, run)
    model = run / "model"
    first = None
    try:
        with undeletable(model / "last") as stuck:  # the step-50 checkpoint: last.prev after the next save
            rel = stuck.relative_to(model / "last")
            dry = pimm_here("resume", run, "--dry-run", "--", "checkpoint.every_steps=10")
            assert dry.returncode == 0 and "(exact continuation)" in dry.stdout, describe(dry)
            first = pimm_here("resume", run, "--", "checkpoint.every_steps=10")
        assert first.returncode == 0, describe(first)
        assert read_json(run / "status.json")["state"] == "finished"
        m = read_json(model / "last" / "manifest.json")
        assert m["step"] == 90  # the saves at steps 60, 70, 80 and the final one all went on
        assert "save failed" not in first.stdout + first.stderr
        warned = [line for line in first.stdout.splitlines() if "could not remove" in line]
        assert len(warned) == 1, describe(first)
        assert str(model / "last.prev" / rel) in warned[0] and str(model / "last.stale-1") in warned[0], warned
        assert str(model / "last.stale-1") in (run / "train.log").read_text()
        assert sorted(p.name for p in model.iterdir() if p.name.startswith("last")) == ["last", "last.stale-1"]
        assert (model / "last.stale-1" / rel).exists()  # what is left of the tree, set aside
        ok = pimm_here("checkpoints", "verify", run)
        assert ok.returncode == 0 and "last.stale" not in ok.stdout, describe(ok)
    finally:
        release(model / "last.stale-1")
    # removable again: the next run's first save removes it
    again = pimm_here("resume", run, "--", "train.epochs=3", "checkpoint.every_steps=0")
    assert again.returncode == 0, describe(again)
    assert sorted(p.name for p in model.iterdir() if p.name.startswith("last")) == ["last"]
    assert "could not remove" not in again.stdout


# ------------------------------------------------------------------- loading never trains
USER_OPT = ('optimizer.target="userpkg.optim:counting_adamw"', *STOPPED_OVERRIDES)


@pytest.fixture(scope="module")
def user_optimizer_runs(tmp_path_factory) -> tuple[Path, Path, int]:
    """The user optimizer run uninterrupted (90 steps) and stopped after step STOPPED_AT (in this process),
    and how often its hook fires per step (twice once torch has wrapped AdamW.step too, which the subclass's
    super().step() then also goes through: that depends on what this process built before)."""
    base = tmp_path_factory.mktemp("user-optim")
    full, cut = base / "digits" / "full", base / "digits" / "cut"
    trainer = run_job(full, USER_OPT)
    per_step, rest = divmod(trainer.optimizer.hook_calls, 90)
    assert trainer.optimizer.steps == 90 and per_step >= 1 and rest == 0
    trainer = run_job(cut, USER_OPT, stop_at=STOPPED_AT)
    assert (trainer.optimizer.steps, trainer.state.global_step) == (STOPPED_AT, STOPPED_AT)
    return full, cut, per_step


def test_a_load_never_steps_the_users_optimizer(user_optimizer_runs, tmp_path):
    """Seen: to create the state it loads into, DCP called a real zero-gradient step() of the trainer's
    optimizer (a user subclass it could not copy): its step hook fired and its counter moved, also in a
    load that trains nothing."""
    from pimm_core.checkpoint.tensors.state import unwrap

    full, cut, per_step = user_optimizer_runs
    load_only = tmp_path / "digits" / "load"
    shutil.copytree(cut, load_only)
    trainer = run_job(load_only, USER_OPT, resume_from=load_only / "model" / "last", max_steps=1, checkpoint=False)
    assert trainer.state.global_step == STOPPED_AT  # restored, nothing trained
    assert (trainer.optimizer.steps, trainer.optimizer.hook_calls) == (0, 0)
    assert trainer.optimizer.state  # the state was loaded all the same
    resumed = tmp_path / "digits" / "cut"
    shutil.copytree(cut, resumed)
    trainer = run_job(resumed, USER_OPT, resume_from=resumed / "model" / "last")
    assert trainer.state.global_step == 90
    assert (trainer.optimizer.steps, trainer.optimizer.hook_calls) == (90 - STOPPED_AT, per_step * (90 - STOPPED_AT))
    # bitwise: the same weights as the uninterrupted run
    import torch

    uninterrupted = torch.load(full / "model" / "last" / "weights.pth", weights_only=True)["state_dict"]
    now = unwrap(trainer.model).state_dict()
    assert [k for k in uninterrupted if not torch.equal(uninterrupted[k], now[k])] == []


def test_a_load_fires_no_global_step_hook(stopped_run, tmp_path):
    """Seen: with the default AdamW a global step hook fired once during the load, on a throwaway copy."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    run = tmp_path / "digits" / "base"
    shutil.copytree(stopped_run, run)
    calls = []
    handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: calls.append(opt))
    try:
        trainer = run_job(run, STOPPED_OVERRIDES, resume_from=run / "model" / "last", max_steps=1, checkpoint=False)
    finally:
        handle.remove()
    assert trainer.state.global_step == STOPPED_AT and trainer.optimizer.state
    assert calls == []


# ------------------------------------------------------------------- what cannot be loaded is not saved as if it could
STREAM_CONFIG = """\
objective = "userpkg.objective:smoothed_ce"

[train]
epochs = 2
lr = 0.01
warmup_steps = 2
log_every_steps = 1

[data]
target = "userpkg.stream:phased_stream"
batch_size = 16
num_workers = 0
[data.args]
train = 192
val = 61
registered = {registered}

[model]
name = "mlp"
hidden = 16

[eval]
metric = "val/loss"
mode = "min"
"""


@pytest.mark.parametrize("registered", [False, True], ids=["enum", "enum-registered"])
def test_a_cursor_a_resume_cannot_load_is_not_saved_as_if_it_could(tmp_path, registered):
    """Seen: a stream whose state_dict() holds an enum saved without a word, `checkpoints verify` said ok,
    and every resume was refused ("Unsupported global ..."). At 2 ranks (each saves its own cursor)."""
    (tmp_path / "userpkg").symlink_to(USERPKG)
    config = tmp_path / "stream.toml"
    config.write_text(STREAM_CONFIG.format(registered="true" if registered else "false"))
    root = tmp_path / "exp"
    env = {"USERPKG_SIGTERM_AT": "4", "USERPKG_SIGTERM_MARK": str(tmp_path / "sigterm-sent")}
    cut = _launch(config, root, env=env, nproc=2)  # 96 samples per rank: 6 batches an epoch
    assert cut.returncode == 0, describe(cut)
    run = root / "default" / "run"
    m = read_json(run / "model" / "last" / "manifest.json")
    assert m["epoch"] == 0 and 0 < m["iter"] < 6, m
    warned = [line for line in cut.stdout.splitlines() if "loader cursor cannot be saved" in line]
    dry = _here(config, root, "--train.resume", "--dry-run", nproc=2)  # decided before any rank
    assert dry.returncode == 0, describe(dry)
    if registered:  # add_safe_globals: the cursor is saved and the resume is exact
        assert warned == [] and m["has_loader_state"] is True and "loader_state_problem" not in m
        assert "(exact continuation)" in dry.stdout, dry.stdout
    else:  # saved without the cursor, the fix named once; the resume replays the epoch
        assert len(warned) == 1, describe(cut)
        assert "userpkg.stream.Phase" in warned[0] and "torch.serialization.add_safe_globals([Phase])" in warned[0]
        assert m["has_loader_state"] is False and "add_safe_globals" in m["loader_state_problem"]
        assert "policy: checkpoint has no loader state: restart the saved epoch" in dry.stdout, dry.stdout
        assert "saved without its loader cursor" in dry.stdout
    ok = pimm("checkpoints", "verify", run)
    assert ok.returncode == 0, describe(ok)
    res = _launch(config, root, "--train.resume", nproc=2)
    assert res.returncode == 0, describe(res)
    assert read_json(run / "status.json")["state"] == "finished"
    entry = read_json(run / "provenance.json")["starts"][-1]
    if registered:
        assert (entry["policy"], entry["exact"], entry["iter"]) == ("same", True, m["iter"])
    else:
        assert (entry["policy"], entry["iter"], entry["replay_boundary"]) == (
            "no_loader_state", 0, {"epoch": 0, "step": 0, "from_iter": m["iter"]})


# ------------------------------------------------------------------- freezing a layer mid-run
DRIVER = Path(__file__).with_name("_resume_driver.py")
FREEZE_OVERRIDES = ["train.epochs=2", "data.num_workers=0", "train.find_unused_parameters=true"]
FREEZE_AT, STOP_AT = 10, 30  # 23 steps an epoch at 2 ranks: frozen in epoch 0, stopped in epoch 1


def _ranks(jobs: list[dict], jobs_file: Path) -> subprocess.CompletedProcess[str]:
    import json

    jobs_file.write_text(json.dumps(jobs))
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(DRIVER),
           str(jobs_file)]
    return subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=hang_s(600))


@pytest.fixture(scope="module")
def freeze_runs(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One torchrun job (2 ranks) for both tests below: with train.find_unused_parameters, an uninterrupted
    run freezing a layer at step FREEZE_AT, the same stopped after STOP_AT and resumed; then, last (it fails
    the job), the same freeze under DDP's default in ``digits/run``. The job's output is returned."""
    tmp = tmp_path_factory.mktemp("freeze")
    full, cut = tmp / "digits" / "full", tmp / "digits" / "cut"
    freeze = ["net.0", FREEZE_AT]
    jobs = [{"run_dir": str(full), "overrides": FREEZE_OVERRIDES, "freeze": freeze, "full_dump": str(tmp / "full")},
            {"run_dir": str(cut), "overrides": FREEZE_OVERRIDES, "freeze": freeze, "stop_at": STOP_AT},
            {"run_dir": str(cut), "overrides": FREEZE_OVERRIDES, "freeze": freeze, "freeze_now": True,
             "resume_from": str(cut / "model" / "last"), "full_dump": str(tmp / "cut")},
            {"run_dir": str(tmp / "digits" / "run"), "overrides": FREEZE_OVERRIDES[:2], "freeze": ["net.0", 3]}]
    return tmp, _ranks(jobs, tmp / "jobs.json")


def test_freezing_a_layer_mid_run_at_two_ranks_resumes_bitwise(freeze_runs):
    """Seen: a callback freezing a layer (requires_grad = False) at 2 ranks crashed at the next step
    ("Expected to have finished reduction in the prior iteration"): DDP was built with no way to allow
    unused parameters. With train.find_unused_parameters, the run goes on, and a stop + resume keeps the
    frozen layer's optimizer state and step count: bitwise the uninterrupted run."""
    import torch

    tmp_path, r = freeze_runs
    cut = tmp_path / "digits" / "cut"
    why = f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    # the three jobs before the failing one ended: both dumps written, the resume finished
    assert (tmp_path / "full.pt").is_file() and (tmp_path / "cut.pt").is_file(), why
    assert read_json(cut / "status.json")["state"] == "finished", why
    a, b = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("full", "cut"))
    assert a["state"]["global_step"] == b["state"]["global_step"] == 46
    assert [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])] == []
    # the frozen layer kept the optimizer state of its last trained step, in both runs
    for name in ("net.0.weight", "net.0.bias"):
        assert float(a["optim"]["state"][name]["step"]) == float(b["optim"]["state"][name]["step"]) == FREEZE_AT
        assert torch.equal(a["optim"]["state"][name]["exp_avg"], b["optim"]["state"][name]["exp_avg"])
    assert float(b["optim"]["state"]["net.3.weight"]["step"]) == 46
    entry = read_json(cut / "provenance.json")["starts"][-1]
    assert (entry["kind"], entry["policy"], entry["exact"]) == ("resume", "same", True)


def test_freezing_a_layer_without_the_option_names_it(freeze_runs):
    """The same freeze under DDP's default: one line naming train.find_unused_parameters, not DDP's riddle."""
    tmp_path, r = freeze_runs
    run = tmp_path / "digits" / "run"
    assert (tmp_path / "cut.pt").is_file(), r.stderr[-3000:]  # the job got as far as this run
    assert r.returncode != 0
    assert "set train.find_unused_parameters = true" in r.stderr, r.stderr[-3000:]
    assert read_json(run / "status.json")["state"] == "failed"


# ------------------------------------------------------------------- going back to an earlier point
KEEP_OVERRIDES = ("train.epochs=2", "data.num_workers=0", "checkpoint.every_steps=10", "checkpoint.keep_full=3")


def test_going_back_to_an_earlier_point_branches_the_run(tmp_path):
    """Seen: in the standard format only `last` could resume (`last.prev` is gone after a save), so "go back
    to before the loss spike at step 30" could not be expressed. With checkpoint.keep_full = 3, last and the
    two newest superseded checkpoints are kept; resuming from one branches the run, continues exactly (the
    same weights as the uninterrupted run), and from then on resume picks the branch's newest, also when a
    checkpoint of the branch is damaged, never a higher step of the abandoned line."""
    import torch

    from pimm_core.checkpoint.select.selection import select_resume
    from pimm_core.checkpoint.tensors.state import unwrap

    full = tmp_path / "digits" / "full"
    run_job(full, KEEP_OVERRIDES)  # uninterrupted: 90 steps
    run = tmp_path / "digits" / "run"
    run_job(run, KEEP_OVERRIDES, stop_at=45)  # saves at steps 10..40, stopped at 45
    model = run / "model"
    assert sorted(p.name for p in model.iterdir() if p.is_dir()) == ["full_30", "full_40", "last"]
    assert read_json(model / "full_30" / "manifest.json")["step"] == 30
    # the dry run says what the resume does: the branch, and an exact continuation at step 30
    dry = pimm_here("launch", "--train.config", REPO / "configs" / "digits.toml", "--run.root", tmp_path,
               "--run.name", "run", "--run.no-timestamp", "--train.resume-from", model / "full_30", "--dry-run",
               "--", "model.dropout=0.3", "train.log_every_steps=1", *KEEP_OVERRIDES)
    assert dry.returncode == 0, describe(dry)
    assert "branch: resuming from full_30 (step 30) branches the run: the later checkpoints " in dry.stdout
    assert "last (step 45)" in dry.stdout and "full_40 (step 40)" in dry.stdout
    assert "continue at: step 30, epoch 0, iter 30 (exact continuation)" in dry.stdout, dry.stdout
    trainer = run_job(run, KEEP_OVERRIDES, resume_from=model / "full_30")
    entry = read_json(run / "provenance.json")["starts"][-1]
    assert (entry["policy"], entry["exact"], entry["step"], entry["iter"]) == ("same", True, 30, 30)
    assert any("branches the run" in w for w in entry["warnings"])
    # exact: the branch from step 30 ends with the uninterrupted run's weights
    want = torch.load(full / "model" / "last" / "weights.pth", weights_only=True)["state_dict"]
    now = unwrap(trainer.model).state_dict()
    assert [k for k in want if not torch.equal(want[k], now[k])] == []
    # the abandoned line is kept whole, aside; the branch's checkpoints are the candidates
    aside = [p for p in model.iterdir() if p.name.startswith("abandoned-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["full_40", "last"]
    assert read_json(aside[0] / "last" / "manifest.json")["step"] == 45
    assert sorted(p.name for p in model.iterdir() if p.name.startswith(("full_", "last"))) == [
        "full_70", "full_80", "last"]
    chosen, _ = select_resume(model)
    assert (chosen.name, chosen.step) == ("last", 90)
    # a damaged checkpoint of the branch: the fallback is the branch's newest intact one
    w = model / "last" / "weights.pth"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 0xFF
    w.write_bytes(bytes(data))
    latest = pimm("checkpoints", "latest", model)
    assert latest.returncode == 0 and latest.stdout.strip() == str(model / "full_80"), describe(latest)
