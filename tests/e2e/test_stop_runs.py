"""Stopping real runs with real signals and ``pimm stop``, then resuming them bitwise exactly.

Every case launches ``python -m pimm_core.cli launch`` in its own session
(``start_new_session=True``) so a signal reaches the launcher (or one rank) alone, and
waits until ``status.json`` says the run is running and ``metrics.jsonl`` has a step past the
session's start before signalling.

To keep the suite short each world size runs one *chain* of sessions on one run
directory, each session ended a different way, and the last one resumed to the end:

- 1 rank:  ``pimm stop --reason`` -> SIGTERM to the launcher followed by a burst of
  SIGTERM/SIGINT while ``last`` is being saved -> (stale ``control/stop``) resume to the end.
- 2 ranks: SIGTERM to the launcher (torchrun forwards it) -> SIGTERM to rank 0 only ->
  SIGINT to rank 1 only -> resume to the end.

Each session's stop is checked on its own (exit 0, no process left, ``status.json``,
``model/last`` complete at the status step, provenance stop entry); the chain's final
weights must equal an uninterrupted run of the same config bit for bit, which holds only
if every stop in the chain paused at a window boundary and every resume continued exactly.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from _helpers import DIGITS, REPO, clean_env, describe, hang_s, launch, pimm, pimm_here, read_json, training_past
from pimm_core.launch.forward import live_processes
from pimm_core.checkpoint.select.selection import select_resume
from pimm_core.process.shell import program
from pimm_core.process.stop import stop_file, write_stop_file

# dropout on, two DataLoader workers per rank, a metrics.jsonl record every step (so the
# test can see progress); the reference runs use exactly the same overrides.
COMMON = ("model.dropout=0.3", "data.num_workers=2", "train.log_every_steps=1")
# 45 steps per epoch, 360 in all: about 3 s on an idle core, so that `pimm stop` (a CLI start
# plus the trainer's once-a-second poll of control/stop) lands mid-run (2 epochs ended first)
ONE_RANK = ("train.epochs=8", *COMMON)
TWO_RANKS = ("train.epochs=2", *COMMON)  # 23 steps per epoch per rank, 46 in all
# run names a shell would mangle unquoted: the printed resume command must quote them
NAME_1, NAME_2 = "c1 sweep[lr=0.1]", "c2 $HOME [x]"
LEAD = 3  # optimizer steps a session must have taken (since its start) before it is signalled
TIMEOUT = hang_s(180)


# ---------------------------------------------------------------- processes
def session_members(sids: set[int]) -> list[int]:
    """Live (non-zombie) processes whose session id is in ``sids``."""
    return [pid for pid, _, sid in live_processes() if sid in sids]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Session:
    """One ``pimm launch`` in its own process session, output to a file."""

    def __init__(self, root: Path, name: str, overrides: tuple[str, ...], *, nproc: int | None,
                 resume: bool, tag: str, shell: str | None = None, env: dict[str, str] | None = None):
        """``shell``: run this command line through ``bash -c`` instead (a command pimm printed);
        ``env``: variables added to the clean environment."""
        args = ["launch", "--train.config", str(DIGITS), "--run.root", str(root), "--run.name", name,
                "--run.no-timestamp"]
        if nproc:
            args += ["--nproc-per-node", str(nproc)]
        if resume:
            args.append("--train.resume")
        args += ["--", *overrides]
        self.run_dir = root / "digits" / name
        self.log_path = root / f"{tag}.out"
        self._out = open(self.log_path, "w")
        self.started = time.monotonic()
        argv = ["bash", "-c", shell] if shell is not None else [sys.executable, "-m", "pimm_core.cli", *args]
        self.proc = subprocess.Popen(argv, cwd=REPO, env={**clean_env(), **(env or {})},
                                     stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.log_path.read_text(errors="replace")

    def describe(self) -> str:
        log = self.run_dir / "train.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no train.log)"
        return (f"exit {self.proc.returncode}\n--- output\n{self.output()[-4000:]}\n--- train.log tail\n{tail}")

    def wait_training(self, min_step: int) -> dict[str, Any]:
        """Wait until status.json says ``running`` and metrics.jsonl has a train record at ``min_step``
        or later; returns the status with ``step`` the newest step logged."""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended before reaching step {min_step}:\n{self.describe()}")
            running = training_past(self.run_dir, min_step)  # (an earlier session's records end before min_step)
            if running is not None:
                return running
            time.sleep(0.02)
        self.kill()
        pytest.fail(f"no status 'running' at step >= {min_step} within {TIMEOUT} s:\n{self.describe()}")

    def wait(self) -> int:
        if self._out.closed:
            return self.proc.wait()
        try:
            return self.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the run did not exit within {TIMEOUT} s of the stop:\n{self.describe()}")
        finally:
            self._out.close()

    def kill(self) -> None:
        """Clean-up after a failure: the launcher's session and every rank (torchrun gives each its own)."""
        try:
            ranks = set(json.loads((self.run_dir / "status.json").read_text()).get("pids") or [])
        except (OSError, ValueError):
            ranks = set()
        for pid in session_members(ranks | {self.proc.pid}):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait()


# ------------------------------------------------------------------- stages
@dataclass
class Stage:
    """What one session left behind, captured before the next session changes the run."""

    label: str
    run_dir: Path
    rc: int
    output: str
    status: dict[str, Any]
    running: dict[str, Any]  # the status seen just before the stop was requested
    survivors: list[int]
    chosen: Any  # Candidate selected for resume, or None
    candidates: list[Any]
    model_entries: list[str]
    last_entries: list[str]
    provenance: dict[str, Any]
    train_log: str
    control_stop_left: bool
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    def why(self) -> str:
        return f"[{self.label}] exit {self.rc}\n--- output\n{self.output[-4000:]}\n--- train.log tail\n{self.train_log[-2000:]}"


def finish_stage(sess: Session, label: str, running: dict[str, Any], **extra: Any) -> Stage:
    rc = sess.wait()
    run = sess.run_dir
    status = read_json(run / "status.json")
    pids = set(status.get("pids") or []) | set(running.get("pids") or []) | {sess.pid}
    deadline = time.monotonic() + hang_s(10)  # rank and DataLoader-worker processes must be gone (reaped or exited)
    while True:
        survivors = sorted(set(session_members(pids)) | {p for p in pids if alive(p)})
        if not survivors or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid in survivors:  # do not leave strays behind a failing test
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    model = run / "model"
    chosen, cands = select_resume(model)
    last = model / "last"
    if chosen is not None and chosen.name == "last" and status.get("state") == "stopped":
        extra["cursors"] = rank_cursors(last)
    return Stage(
        label=label, run_dir=run, rc=rc, output=sess.output(), status=status, running=running, survivors=survivors,
        chosen=chosen, candidates=cands, model_entries=sorted(p.name for p in model.iterdir()),
        last_entries=sorted(p.relative_to(last).as_posix() for p in last.rglob("*")) if last.is_dir() else [],
        provenance=read_json(run / "provenance.json"), train_log=(run / "train.log").read_text(errors="replace"),
        control_stop_left=stop_file(run).exists(), seconds=time.monotonic() - sess.started, extra=extra)


def signal_stage(root: Path, name: str, overrides: tuple[str, ...], *, nproc: int | None, resume: bool,
                 label: str, target: str, sig: signal.Signals, start_step: int) -> Stage:
    """Start a session, wait for training, send ``sig`` to ``target`` (launcher|rank0|rank1)."""
    sess = Session(root, name, overrides, nproc=nproc, resume=resume, tag=label)
    running = sess.wait_training(start_step + LEAD)
    pid = {"launcher": sess.pid, "rank0": running["pids"][0],
           "rank1": running["pids"][1]}[target]
    os.kill(pid, sig)
    return finish_stage(sess, label, running, target_pid=pid)


def pimm_stop_stage(root: Path, name: str, overrides: tuple[str, ...], *, label: str, reason: str, resume: bool,
                    start_step: int) -> Stage:
    sess = Session(root, name, overrides, nproc=None, resume=resume, tag=label)
    running = sess.wait_training(start_step + LEAD)
    cli = pimm("stop", sess.run_dir, "--reason", reason, timeout=60)
    return finish_stage(sess, label, running, cli=cli)


def burst_stage(root: Path, name: str, overrides: tuple[str, ...], *, label: str, start_step: int) -> Stage:
    """SIGTERM to the launcher; then, while the save of ``last`` is seen in progress on disk
    (``last.tmp``/``last.prev``), more SIGTERM/SIGINT in quick succession (SIGINT to the whole
    process group, as a repeated Ctrl-C at a terminal sends it, DataLoader workers included)."""
    sess = Session(root, name, overrides, nproc=None, resume=True, tag=label)
    running = sess.wait_training(start_step + LEAD)
    model = sess.run_dir / "model"

    def saving() -> bool:
        return (model / "last.tmp").exists() or (model / "last.prev").exists()

    os.kill(sess.pid, signal.SIGTERM)
    saw_save = False
    deadline = time.monotonic() + hang_s(60)
    while sess.proc.poll() is None and time.monotonic() < deadline and not saw_save:
        saw_save = saving()
        time.sleep(0.0005)
    sent = []
    for sig, group in ((signal.SIGTERM, False), (signal.SIGINT, True), (signal.SIGTERM, False),
                       (signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGINT, True)):
        if sess.proc.poll() is not None or not saving():  # only while the save is in progress
            break
        (os.killpg if group else os.kill)(sess.pid, sig)
        sent.append(sig.name + (" (group)" if group else ""))
        time.sleep(0.002)
    return finish_stage(sess, label, running, saw_save=saw_save, extra_signals=sent)


def resume_to_end(root: Path, name: str, previous: Stage, *, label: str, stale_reason: str) -> Stage:
    """Resume to the end, with a stale ``control/stop`` written beforehand, by running the
    ``resume with:`` command the previous session printed, verbatim, in a shell."""
    run = root / "digits" / name
    write_stop_file(run, stale_reason)
    printed = [ln for ln in previous.output.splitlines() if ln.startswith("resume with: ")]
    assert len(printed) == 1, previous.why()
    sess = Session(root, name, (), nproc=None, resume=True, tag=label, shell=printed[0][len("resume with: "):])
    return finish_stage(sess, label, {}, printed=printed[0])


# ----------------------------------------------------------------- fixtures
class SharedReference:
    """The uninterrupted 2-rank run of TWO_RANKS, trained once per test session for test_stop_runs,
    test_scheduler_stop and test_slurm, whose chains all end where it ends (their stop settings do not
    change what trains). Under xdist these files run in different workers: the first to ask starts it in
    the background in a directory the workers share, and a thread writes ``done`` (or ``failed``) there
    when its launcher exits; the others wait for that file. One 2-rank run of 46 steps instead of three."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory):
        from filelock import FileLock

        worker = os.environ.get("PYTEST_XDIST_WORKER")
        base = tmp_path_factory.getbasetemp()
        self.dir = (base.parent if worker else base) / "shared-ref2"  # (the session's, never an earlier one's)
        self.dir.mkdir(exist_ok=True)
        self.run_dir = self.dir / "digits" / "ref"
        self.sess: Session | None = None
        with FileLock(self.dir / "claim.lock"):
            owner = self.dir / "owner"
            if not owner.exists():
                owner.write_text(worker or "this process")
                self.sess = Session(self.dir, "ref", TWO_RANKS, nproc=2, resume=False, tag="ref")
                threading.Thread(target=self._mark_end, args=(self.sess,), daemon=True).start()

    def _mark_end(self, sess: Session) -> None:
        rc = sess.proc.wait()
        (self.dir / ("done" if rc == 0 else "failed")).write_text(f"exit {rc}\n")

    def result(self) -> Path:
        """The run directory once the run finished (asserts it did)."""
        if self.sess is not None:
            return _reference(self.sess)
        deadline = time.monotonic() + TIMEOUT
        while not (self.dir / "done").exists():
            assert not (self.dir / "failed").exists(), \
                f"the shared reference run failed:\n{(self.dir / 'ref.out').read_text(errors='replace')[-4000:]}"
            assert time.monotonic() < deadline, f"the shared reference run did not end within {TIMEOUT} s"
            time.sleep(0.2)
        assert read_json(self.run_dir / "status.json")["state"] == "finished"
        return self.run_dir

    def close(self) -> None:
        """At the end of the module that started it: let it end (another worker may wait for it), killed
        only past the hang bound; stragglers are killed."""
        if self.sess is None:
            return
        try:
            self.sess.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        self.sess.kill()


@pytest.fixture(scope="module", autouse=True)
def _references(tmp_path_factory):
    """The uninterrupted reference runs, as soon as this module starts: the 2-rank one in the background
    (:class:`SharedReference`), the 1-rank one meanwhile in this process (``pimm_here``: it is a reference,
    not a stop, so it needs no process of its own; it saves a start importing torch)."""
    two = SharedReference(tmp_path_factory)
    try:
        root = tmp_path_factory.mktemp("stop-ref1")
        yield {"1": (launch(root, "ref", *ONE_RANK, here=True), root / "digits" / "ref"), "2": two}
    finally:
        two.close()


@pytest.fixture(scope="module")
def reference_1(_references) -> Path:
    """An uninterrupted 1-rank run of ONE_RANK."""
    result, run = _references["1"]
    assert result.returncode == 0, describe(result)
    assert read_json(run / "status.json")["state"] == "finished"
    return run


def _reference(sess: Session) -> Path:
    """The run directory of the uninterrupted reference ``sess`` once it finished."""
    rc = sess.wait()
    assert rc == 0, sess.describe()
    assert read_json(sess.run_dir / "status.json")["state"] == "finished"
    return sess.run_dir


@pytest.fixture(scope="module")
def reference_2(_references) -> Path:
    """An uninterrupted 2-rank run of TWO_RANKS."""
    return _references["2"].result()


@pytest.fixture(scope="module")
def chain_1(tmp_path_factory) -> dict[str, Stage]:
    root = tmp_path_factory.mktemp("stop-chain1")
    stages: dict[str, Stage] = {}
    a = pimm_stop_stage(root, NAME_1, ONE_RANK, label="pimm-stop", reason="maintenance window", resume=False,
                        start_step=0)
    stages[a.label] = a
    _require_resumable(a)
    b = burst_stage(root, NAME_1, ONE_RANK, label="sigterm-launcher+burst", start_step=a.status["step"])
    stages[b.label] = b
    _require_resumable(b)
    stages["end"] = resume_to_end(root, NAME_1, b, label="end", stale_reason="stale from before")
    return stages


@pytest.fixture(scope="module")
def chain_2(tmp_path_factory) -> dict[str, Stage]:
    root = tmp_path_factory.mktemp("stop-chain2")
    stages: dict[str, Stage] = {}
    start = 0
    for label, target, sig in (("sigterm-launcher", "launcher", signal.SIGTERM),
                               ("sigterm-rank0", "rank0", signal.SIGTERM),
                               ("sigint-rank1", "rank1", signal.SIGINT)):
        st = signal_stage(root, NAME_2, TWO_RANKS, nproc=2, resume=bool(stages), label=label, target=target,
                          sig=sig, start_step=start)
        stages[label] = st
        _require_resumable(st)
        start = st.status["step"]
    stages["end"] = resume_to_end(root, NAME_2, st, label="end", stale_reason="stale from before")
    return stages


def _require_resumable(st: Stage) -> None:
    if st.chosen is None or st.status.get("state") not in ("stopped", "finished"):
        pytest.fail(f"cannot continue the chain after this session:\n{st.why()}")


# -------------------------------------------------------------------- checks
def check_stopped(st: Stage, reason: str, world_size: int) -> None:
    assert st.rc == 0, st.why()
    assert st.survivors == [], f"processes still alive after the launcher exited: {st.survivors}\n{st.why()}"
    assert len(st.status["pids"]) == world_size, st.status
    assert st.status["state"] == "stopped", st.status
    assert st.status["stop_reason"] == reason, st.status
    # last is complete and is what a resume picks, at the very step the run reports
    assert st.chosen is not None and st.chosen.name == "last" and st.chosen.complete, st.candidates
    manifest = st.chosen.manifest
    assert manifest["step"] == st.status["step"], (manifest, st.status)
    assert (manifest["epoch"], manifest["iter"]) == (st.status["epoch"], st.status["iter"]), (manifest, st.status)
    assert manifest["world_size"] == world_size
    assert st.status["step"] >= st.running["step"]  # it stopped after we saw it training
    assert not [n for n in st.model_entries if n.endswith((".tmp", ".prev"))], st.model_entries
    assert not [n for n in st.last_entries if ".tmp" in n], st.last_entries
    # every rank's state is in the checkpoint (the save is collective: all ranks reached it)
    assert {f"trainer.dcp/__{r}_0.distcp" for r in range(world_size)} <= set(st.last_entries), st.last_entries
    # provenance: this session's entry, then its stop, at the checkpoint's step
    stop = st.provenance["starts"][-1]
    assert stop["kind"] == "stop" and stop["reason"] == reason, stop
    assert (stop["step"], stop["epoch"], stop["iter"]) == (manifest["step"], manifest["epoch"], manifest["iter"])
    assert st.provenance["starts"][-2]["kind"] in ("start", "resume")
    # each rank's own loader cursor: every rank consumed the same batches (grad_accum 1: iter)
    assert len(set(st.status["pids"])) == world_size
    expected = manifest["iter"] if manifest["iter"] else None
    assert st.extra["cursors"] == {r: expected for r in range(world_size)}, (st.extra["cursors"], manifest)
    # the log says why and where it ended, and that the final evaluation was skipped
    said = [ln for ln in st.train_log.splitlines() if f"stopped ({reason}) at step {manifest['step']}," in ln]
    assert len(said) == 1, st.train_log[-2000:]
    # a stop at an epoch's end lets that epoch's evaluation run first; mid-epoch, evaluation is skipped
    assert ("final evaluation skipped" in said[0]) == (manifest["iter"] != 0), st.train_log[-2000:]
    assert not st.control_stop_left


def rank_cursors(ckpt: Path) -> dict[int, int | None]:
    """Micro-batches each rank's saved loader cursor has consumed in the epoch (None: epoch boundary).

    Reads every ``rank_state/<r>`` entry of ``trainer.dcp`` (torchdata's StatefulDataLoader
    state with workers: a snapshot step plus the steps since that snapshot).
    """
    import torch
    import torch.distributed.checkpoint as dcp

    from pimm_core.checkpoint.tensors.state import unpack

    reader = dcp.FileSystemReader(ckpt / "trainer.dcp")
    meta = reader.read_metadata().state_dict_metadata
    request = {k: torch.empty(meta[k].size, dtype=torch.uint8) for k in meta if k.startswith("rank_state/")}
    dcp.load(request, storage_reader=reader, no_dist=True)
    out = {}
    for key, packed in request.items():
        loader = unpack(packed)["loader"]
        out[int(key.split("/")[1])] = (None if loader is None else
                                       loader["_snapshot"]["_snapshot_step"] + loader["_steps_since_snapshot"])
    return out


def assert_same_weights(ref: Path, run: Path) -> None:
    import torch

    a = torch.load(ref / "model" / "last" / "weights.pth", map_location="cpu", weights_only=True)
    b = torch.load(run / "model" / "last" / "weights.pth", map_location="cpu", weights_only=True)
    assert set(a) == set(b)
    for group in a:
        assert a[group].keys() == b[group].keys()
        different = [k for k in a[group] if not torch.equal(a[group][k], b[group][k])]
        assert not different, f"{group}: tensors differ from the uninterrupted run: {different}"


def check_end(st: Stage, ref: Path, world_size: int) -> None:
    assert st.rc == 0, st.why()
    assert st.survivors == [], st.survivors
    assert st.status["state"] == "finished" and st.status["stop_reason"] is None, st.status
    ref_manifest = read_json(ref / "model" / "last" / "manifest.json")
    assert st.chosen.manifest["step"] == ref_manifest["step"] == st.status["step"]
    assert st.chosen.manifest["world_size"] == world_size
    assert_same_weights(ref, st.run_dir)


# ------------------------------------------------------------------ 1 rank
def test_one_rank_pimm_stop(chain_1):
    st = chain_1["pimm-stop"]
    cli = st.extra["cli"]
    assert cli.returncode == 0, describe(cli)
    assert cli.stdout.count("\n") == 1 and "stop requested" in cli.stdout, describe(cli)
    check_stopped(st, "maintenance window", 1)  # the file's reason, and the file was consumed


def test_one_rank_sigterm_to_launcher(chain_1):
    st = chain_1["sigterm-launcher+burst"]
    check_stopped(st, "signal:SIGTERM", 1)
    assert st.provenance["starts"][-2]["kind"] == "resume"


def test_one_rank_second_signals_during_save(chain_1):
    """More signals while `last` is being rotated in: the stop in progress is unaffected, the
    previous `last` was replaced atomically, exit 0, first reason kept."""
    st = chain_1["sigterm-launcher+burst"]
    assert st.extra["saw_save"], "the save of last was never seen on disk"
    assert st.extra["extra_signals"], "the run exited before any further signal could be sent"
    check_stopped(st, "signal:SIGTERM", 1)
    assert st.status["step"] > chain_1["pimm-stop"].status["step"]  # the new last replaced the previous one


def test_one_rank_stale_stop_file_ignored_on_resume(chain_1):
    st = chain_1["end"]
    assert st.rc == 0, st.why()
    assert st.status["state"] == "finished", st.status
    lines = [ln for ln in st.train_log.splitlines() if "stop request" in ln and "earlier session" in ln]
    assert len(lines) == 1 and "ignor" in lines[0] and "removed" in lines[0], st.train_log[-3000:]
    assert "stale from before" in lines[0]
    assert not st.control_stop_left
    assert st.provenance["starts"][-1]["kind"] == "resume"  # no stop entry after the last resume


def test_one_rank_chain_resumes_bitwise(chain_1, reference_1):
    check_end(chain_1["end"], reference_1, 1)


# ------------------------------------------------------------------ 2 ranks
def test_two_ranks_sigterm_to_launcher(chain_2):
    st = chain_2["sigterm-launcher"]
    check_stopped(st, "signal:SIGTERM", 2)


def test_two_ranks_sigterm_to_rank0_only(chain_2):
    st = chain_2["sigterm-rank0"]
    assert st.extra["target_pid"] == st.running["pids"][0] != st.running["pids"][1]
    check_stopped(st, "signal:SIGTERM", 2)


def test_two_ranks_sigint_to_rank1_only(chain_2):
    st = chain_2["sigint-rank1"]
    assert st.extra["target_pid"] == st.running["pids"][1] != st.running["pids"][0]
    check_stopped(st, "signal:SIGINT", 2)


def test_two_ranks_chain_resumes_bitwise(chain_2, reference_2):
    st = chain_2["end"]
    # the printed command, run verbatim, resumed at the recorded world size with the run's own config
    assert st.extra["printed"] == f"resume with: {shlex.join([*program(), 'resume', str(st.run_dir)])}"
    assert read_json(st.run_dir / "provenance.json")["starts"][-1]["launch"]["nproc_per_node"] == 2
    lines = [ln for ln in st.train_log.splitlines() if "stop request" in ln and "earlier session" in ln]
    assert len(lines) == 1, st.train_log[-3000:]
    check_end(st, reference_2, 2)


# ------------------------------------------------------- pimm stop refusals
def test_pimm_stop_on_finished_run_is_refused(reference_1):
    before = sorted(p.relative_to(reference_1).as_posix() for p in reference_1.rglob("*"))
    result = pimm_here("stop", reference_1)
    assert result.returncode == 1, describe(result)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "not live" in lines[0], describe(result)
    assert sorted(p.relative_to(reference_1).as_posix() for p in reference_1.rglob("*")) == before  # no control/stop


def test_pimm_stop_on_non_run_directory_is_usage_error(tmp_path):
    (tmp_path / "notes.txt").write_text("not a run")
    for target in (tmp_path, tmp_path / "missing"):
        result = pimm_here("stop", target)
        assert result.returncode == 2, describe(result)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), describe(result)
    assert not (tmp_path / "control").exists()
