"""Run directory naming (resolve_run_dir) and the refusal to start over a run that has checkpoints."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from _helpers import DIGITS, describe, hang_s, pimm, pimm_here, snapshot
from pimm_core.config import load_config
from pimm_core.launch import resolve_run_dir

STAMP = re.compile(r"-\d{8}-\d{6}$")


def test_default_name_is_config_stem_plus_timestamp():
    cfg = load_config(DIGITS)
    run_dir = resolve_run_dir(cfg, DIGITS)
    assert run_dir.parent == Path("exp") / "digits"
    assert run_dir.name.startswith("digits-")
    assert STAMP.search(run_dir.name), run_dir.name


def test_timestamp_is_local_time_of_when():
    when = time.mktime((2026, 11, 29, 11, 41, 30, 0, 0, -1))
    run_dir = resolve_run_dir(load_config(DIGITS), DIGITS, when=when)
    assert run_dir.name == "digits-20261129-114130"


def test_config_stem_names_the_run(tmp_path):
    path = tmp_path / "my_exp.toml"
    path.write_text("[train]\nepochs = 1\n")
    cfg = load_config(path, ["run.no_timestamp=true"])
    assert resolve_run_dir(cfg, path) == Path("exp") / "default" / "my_exp"


def test_run_name_and_no_timestamp():
    cfg = load_config(DIGITS, extra={"run.name": "baseline", "run.no_timestamp": True})
    assert resolve_run_dir(cfg, DIGITS) == Path("exp") / "digits" / "baseline"


def test_run_name_with_timestamp():
    cfg = load_config(DIGITS, extra={"run.name": "baseline"})
    name = resolve_run_dir(cfg, DIGITS).name
    assert name.startswith("baseline-") and STAMP.search(name) and len(name) == len("baseline-YYYYmmdd-HHMMSS")


def test_root_and_group(tmp_path):
    cfg = load_config(DIGITS, ['run.group="ablation"'], {"run.root": str(tmp_path), "run.name": "a", "run.no_timestamp": True})
    assert resolve_run_dir(cfg, DIGITS) == tmp_path / "ablation" / "a"


def test_no_config_file_names_run_run():
    cfg = load_config(None, extra={"run.no_timestamp": True})
    assert resolve_run_dir(cfg, None) == Path("exp") / "default" / "run"


# --------------------------------------------------------------------------- refusal
def _refused(result, run_dir: Path) -> str:
    assert result.returncode == 2, describe(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), describe(result)
    assert "Traceback" not in result.stderr
    assert str(run_dir) in lines[0] and "already has checkpoints" in lines[0] and "--train.resume" in lines[0]
    return lines[0]


def test_fresh_launch_refuses_run_with_checkpoints(trained_run, tmp_path):
    run_dir = trained_run.copy_to(tmp_path)
    before = snapshot(run_dir)
    # in this process (the distributed launch below refuses in a real one): the same check, no torch import
    result = pimm_here("launch", "--train.config", DIGITS, "--run.root", tmp_path, "--run.name", "t",
                       "--run.no-timestamp", "--", "train.epochs=1")
    _refused(result, run_dir)
    assert snapshot(run_dir) == before  # same files, bytes and mtimes


def test_a_fresh_launch_on_a_live_run_with_checkpoints_says_stop_it_not_resume_it(trained_run, tmp_path):
    """Seen by a newcomer: launching again under the name of a run still training (it has checkpoints)
    answered "continue it with: pimm resume ...", and that command, pasted, was refused: the run is in
    use. The refusal now says so and names the command that stops it; it writes nothing."""
    from pimm_core.process.lock import RunLock

    run_dir = trained_run.copy_to(tmp_path)
    with RunLock(run_dir):  # held as a live launch holds it
        before = snapshot(run_dir)
        for extra in ([], ["--train.resume"]):
            result = pimm_here("launch", "--train.config", DIGITS, "--run.root", tmp_path, "--run.name", "t",
                               "--run.no-timestamp", *extra, "--", "train.epochs=1")
            assert result.returncode == 2 and "Traceback" not in result.stderr, describe(result)
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"error: {run_dir} is in use by pid "), describe(result)
            assert "pimm stop" in lines[0] and "resume" not in lines[0], lines[0]
        assert snapshot(run_dir) == before
    assert "already has checkpoints" in _refused(pimm_here(  # (and once it is not live, the checkpoints' refusal)
        "launch", "--train.config", DIGITS, "--run.root", tmp_path, "--run.name", "t", "--run.no-timestamp", "--",
        "train.epochs=1"), run_dir)


def test_distributed_launch_refuses_before_spawning(trained_run, tmp_path):
    run_dir = trained_run.copy_to(tmp_path)
    before = snapshot(run_dir)
    result = pimm("launch", "--train.config", DIGITS, "--run.root", tmp_path, "--run.name", "t", "--run.no-timestamp",
                  "--nproc-per-node", "2", "--", "train.epochs=1", timeout=120)
    _refused(result, run_dir)
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("leftover", ["last.tmp", "last"])
def test_only_an_interrupted_first_save_is_refused_with_a_way_out(tmp_path, leftover):
    """A run killed during its first save (a ``last.tmp``, or a ``last/`` without ``.complete``)
    has nothing to resume. The leftover still belongs to that run, so a fresh launch refuses,
    but not by pointing at --train.resume (which would fail in turn): both commands name the
    directory to move away, and neither touches anything."""
    run_dir = tmp_path / "digits" / "t"
    (run_dir / "model" / leftover / "trainer.dcp").mkdir(parents=True)
    (run_dir / "model" / leftover / "weights.pth").write_bytes(b"partial")
    before = snapshot(tmp_path)
    # both in this process: refusals decided by the launcher before any rank (its console path and the
    # "before spawning" at two ranks: test_distributed_launch_refuses_before_spawning)
    fresh = pimm_here("launch", "--train.config", DIGITS, "--run.root", tmp_path, "--run.name", "t",
                      "--run.no-timestamp", "--nproc-per-node", "2")
    resume = pimm_here("launch", "--train.config", DIGITS, "--run.root", tmp_path, "--run.name", "t",
                       "--run.no-timestamp", "--train.resume")
    for result in (fresh, resume):
        assert result.returncode == 2, describe(result)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in result.stderr, describe(result)
        assert leftover in lines[0] and f"move or remove {run_dir / 'model'}" in lines[0], lines[0]
    assert "--train.resume to continue" not in fresh.stderr
    after = snapshot(tmp_path)
    after.pop("digits/t/.lock", None)  # the (empty) lock file the resume took before looking
    assert after == before


def test_run_root_that_is_a_file_is_refused(tmp_path):
    root = tmp_path / "root"
    root.write_text("not a directory")
    result = pimm_here("launch", "--train.config", DIGITS, "--run.root", root, "--nproc-per-node", "2")  # (no rank)
    assert result.returncode == 2, describe(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "is a file" in lines[0], describe(result)
    assert root.read_text() == "not a directory"


# --------------------------------------------------------------------------- same-second launches
def test_claim_numbers_a_taken_timestamped_name(tmp_path):
    from pimm_core.run import claim_run_dir

    base = tmp_path / "exp" / "digits" / "digits-20261129-114130"
    first = claim_run_dir(base, numbered_names=True)
    second = claim_run_dir(base, numbered_names=True)
    third = claim_run_dir(base, numbered_names=True)
    assert [c.path for c in (first, second, third)] == [base, base.with_name(base.name + "-2"),
                                                        base.with_name(base.name + "-3")]
    assert all(c.created for c in (first, second, third))
    again = claim_run_dir(base, numbered_names=False)  # --run.no-timestamp, a resume: the name as given
    assert again.path == base and not again.created


def _claim_in_child(base: str, queue) -> None:
    from pimm_core.run import claim_run_dir

    queue.put(str(claim_run_dir(Path(base), numbered_names=True).path))


def test_concurrent_claims_never_share_a_directory(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    base = tmp_path / "g" / "run-20261129-114130"
    procs = [ctx.Process(target=_claim_in_child, args=(str(base), queue)) for _ in range(6)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=hang_s(60)) for _ in procs)
    for p in procs:
        p.join(60)
    assert len(set(got)) == 6 and sorted(Path(g).name for g in got) == sorted(
        [base.name] + [f"{base.name}-{n}" for n in range(2, 7)])


def test_unstarted_claim_is_discarded_with_the_parents_it_made(tmp_path):
    from pimm_core.run import claim_run_dir

    claim = claim_run_dir(tmp_path / "root" / "g" / "r", numbered_names=False)
    (claim.path / ".lock").touch()
    (claim.path / "train.log").write_text("12:00:00 warm start from x\n")
    (claim.path / "model").mkdir()
    assert claim.discard_if_unstarted() and not (tmp_path / "root").exists()
    kept = claim_run_dir(tmp_path / "root" / "g" / "r", numbered_names=False)
    (kept.path / "config.toml").write_text("")  # the run started: it stays
    assert not kept.discard_if_unstarted() and kept.path.is_dir()


def _taken_seconds(parent: Path, base: str, seconds: int = 120) -> set[str]:
    """Directories for every timestamp from now on (a launch in each of those seconds already exists)."""
    now = time.time()
    names = {f"{base}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now + i))}" for i in range(seconds)}
    for n in names:
        (parent / n / "model").mkdir(parents=True)
    return names


@pytest.mark.parametrize("nproc", [None, 2])
def test_launch_in_a_taken_second_gets_a_numbered_directory(tmp_path, nproc):
    """Whatever second the launch starts in, a directory of that name exists (an earlier launch in
    the same second): the launch trains in ``<name>-2``; with two ranks the launcher chooses the
    name once and both ranks train there."""
    parent = tmp_path / "digits"
    taken = _taken_seconds(parent, "digits")
    args = ["launch", "--train.config", DIGITS, "--run.root", tmp_path]
    if nproc:
        args += ["--nproc-per-node", str(nproc)]
    # one rank in this process (no torch import), two through torchrun
    result = (pimm if nproc else pimm_here)(*args, "--", "train.epochs=1", "train.max_steps=2", "eval.every_epochs=0",
                                            timeout=240)
    assert result.returncode == 0, describe(result)
    new = sorted(p.name for p in parent.iterdir() if p.name not in taken)
    assert len(new) == 1 and new[0].endswith("-2") and STAMP.search(new[0][:-2]), new
    run_dir = parent / new[0]
    assert str(run_dir) in result.stdout
    prov = json.loads((run_dir / "provenance.json").read_text())
    assert prov["world_size"] == (nproc or 1)
    assert all(not any((parent / n / "model").iterdir()) for n in taken)  # the others untouched


def test_overrides_written_without_dashdash_reach_every_rank(tmp_path):
    """Seen: ``pimm launch ... --nproc-per-node 2 train.max_steps=3`` (overrides with no ``--``, which one
    rank takes) failed in each rank with "override '--run.name' is not key=value": the launcher put the
    ranks' own flags after the overrides."""
    result = pimm("launch", "--train.config", DIGITS, "--run.root", tmp_path, "--run.name", "bare",
                  "--run.no-timestamp", "--nproc-per-node", "2", "train.max_steps=2", "eval.every_epochs=0",
                  timeout=240)
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "digits" / "bare"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 2, status
    assert json.loads((run_dir / "provenance.json").read_text())["world_size"] == 2
