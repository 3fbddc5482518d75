"""Multi-node ``pimm launch``, tested on one machine: two agents (``--nnodes 2``, one rank
each, c10d rendezvous on 127.0.0.1) train one run in one shared run directory.

One chain of sessions on one run, each ended another way:

1. a fresh launch on two nodes; while it trains, a third agent is refused (the run is in
   use); SIGTERM to node 1's agent stops both;
2. resumed on two nodes with ``--train.auto-resume``; SIGTERM to node 0's agent stops both;
3. resumed on two nodes with ``pimm resume RUN --nnodes 2 --node-rank I``; ``pimm stop RUN``;
4. resumed on one node: ``pimm resume RUN --nnodes 1 --nproc-per-node 2`` to the end, whose
   final weights equal an uninterrupted 2-rank run on one node bit for bit (each stop paused
   at a window boundary, each resume continued exactly, two nodes trained as one); and a copy
   resumed by one process (``pimm launch --train.resume``, world size 2 -> 1) to the end.

Each agent runs in its own process session with its output in a file; every wait has a
timeout, so a rendezvous that never completes fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from _helpers import DIGITS, REPO, clean_env, describe, free_port, hang_s, pimm, pimm_here, read_json, read_jsonl, training_past
from pimm_core.checkpoint.records.manifest import verify_files

OVERRIDES = ("train.epochs=3", "train.log_every_steps=1")  # 23 steps per epoch at world size 2
TOTAL = 69
NAME = "mn"
LEAD = 3  # optimizer steps a session takes (since its start) before it is stopped
TIMEOUT = hang_s(180)



def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rendezvous(node: int, port: int) -> list[str]:
    return ["--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}"]


def launch_args(root: Path, *flags: str) -> list[str]:
    return ["launch", "--train.config", str(DIGITS), "--run.root", str(root), "--run.name", NAME,
            "--run.no-timestamp", *flags]


class Agent:
    """One ``python -m pimm_core.cli ARGS`` in its own process session, output to a file."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "pimm_core.cli", *map(str, args)], cwd=REPO,
                                     env=clean_env(), stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def output(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if still running after ``timeout`` seconds."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._out.close()
        return code

    def kill(self) -> None:
        """SIGKILL, if still running (the ranks of ``pimm launch`` die with it: lock.py ``die_with_parent``)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._out.close()


class TwoNodes:
    """Two agents of one multi-node launch; ``node_args(node, port)`` is each one's command line.

    As a context manager: kills both if the block raises (no strays behind a failing test)."""

    def __init__(self, root: Path, label: str, node_args):
        port = free_port()
        self.root, self.label = root, label
        self.run_dir = root / "digits" / NAME
        self.agents = [Agent(node_args(node, port), root / f"{label}-node{node}.out") for node in (0, 1)]

    def describe(self) -> str:
        log = self.run_dir / "train.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no train.log)"
        out = "".join(f"--- node {i} (exit {a.proc.returncode})\n{a.output()[-3000:]}\n"
                      for i, a in enumerate(self.agents))
        return f"[{self.label}]\n{out}--- train.log tail\n{tail}"

    def __enter__(self) -> "TwoNodes":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            for a in self.agents:
                a.kill()

    def wait_training(self, min_step: int) -> dict[str, Any]:
        """Wait until status.json says ``running`` and metrics.jsonl has a train record at
        ``min_step`` or later; returns the status with ``step`` the newest step logged."""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if any(a.proc.poll() is not None for a in self.agents):
                self.fail(f"an agent ended before step {min_step}")
            running = training_past(self.run_dir, min_step)
            if running is not None:
                return running
            time.sleep(0.05)
        self.fail(f"no status 'running' at step >= {min_step} within {TIMEOUT} s")

    def wait(self) -> list[int]:
        """Both agents' exit codes (the test fails if either is still running after TIMEOUT s)."""
        deadline = time.monotonic() + TIMEOUT
        codes = [a.wait(max(1.0, deadline - time.monotonic())) for a in self.agents]
        if None in codes:
            self.fail(f"an agent did not exit within {TIMEOUT} s")
        return codes

    def fail(self, why: str) -> None:
        for a in self.agents:
            a.kill()
        pytest.fail(f"{why}:\n{self.describe()}")


@dataclass
class Stage:
    """What one two-node session left behind, captured before the next one changes the run."""

    label: str
    codes: list[int]
    outputs: list[str]
    running: dict[str, Any]  # status.json just before the stop
    status: dict[str, Any]
    manifest: dict[str, Any]
    last_files: list[str]
    last_problems: list[str]  # files of `last` that do not match its manifest
    run_files: list[str]
    provenance: dict[str, Any]
    ranks_left: list[int]
    why: str
    extra: dict[str, Any]


def finish(session: TwoNodes, running: dict[str, Any], **extra: Any) -> Stage:
    codes = session.wait()
    run = session.run_dir
    deadline = time.monotonic() + hang_s(10)
    while [p for p in running["pids"] if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in running["pids"] if alive(p)]
    for pid in left:  # no strays behind a failing test
        os.kill(pid, signal.SIGKILL)
    last = run / "model" / "last"
    manifest = read_json(last / "manifest.json") if (last / "manifest.json").exists() else {}
    return Stage(session.label, codes, [a.output() for a in session.agents], running,
                 read_json(run / "status.json"), manifest,
                 sorted(p.relative_to(last).as_posix() for p in last.rglob("*") if p.is_file()),
                 verify_files(last, manifest.get("files") or {}) if manifest else ["no manifest"],
                 sorted(p.name for p in run.iterdir()), read_json(run / "provenance.json"), left,
                 session.describe(), extra)


def _pause(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        os.kill(pid, sig)


def two_node_launch(root: Path, *flags: str):
    """Each node's ``pimm launch`` command line (one rank per node, c10d rendezvous)."""
    return lambda node, port: launch_args(root, *rendezvous(node, port), "--nproc-per-node", "1", "--rdzv-backend",
                                          "c10d", *flags, "--", *OVERRIDES)


# ----------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 2-rank run on one node, started at once so its start-up overlaps the chain."""
    root = tmp_path_factory.mktemp("mn-ref")
    ref = Agent(launch_args(root, "--nproc-per-node", "2", "--", *OVERRIDES), root / "ref.out")
    yield ref, root / "digits" / NAME
    ref.kill()


@dataclass
class Chain:
    root: Path  # --run.root of the chain's run
    run_dir: Path
    copy: Path  # the copy resumed by one process
    stages: dict[str, Stage]
    one_node: subprocess.CompletedProcess  # pimm resume RUN --nnodes 1 --nproc-per-node 2 (its output in stdout)
    one_process: tuple[int | None, str]  # exit code and output of the copy's resume


@pytest.fixture(scope="module")
def chain(tmp_path_factory, reference) -> Chain:
    root = tmp_path_factory.mktemp("mn")
    run_dir = root / "digits" / NAME
    stages: dict[str, Stage] = {}

    # 1. fresh, on two nodes; a third agent is refused while it trains; SIGTERM to node 1's agent
    with TwoNodes(root, "sigterm-node1", two_node_launch(root)) as s:
        running = s.wait_training(LEAD)
        _pause(running["pids"], signal.SIGSTOP)  # keep the run live (it would end in seconds) while refused
        try:
            intruder = pimm(*two_node_launch(root, "--train.resume")(0, free_port()), timeout=60)
        finally:
            _pause(running["pids"], signal.SIGCONT)
        os.kill(s.agents[1].proc.pid, signal.SIGTERM)
        stages["sigterm-node1"] = st = finish(s, running, intruder=intruder)
    _require_stopped(st)

    # 2. two nodes again, through --train.auto-resume; SIGTERM to node 0's agent
    with TwoNodes(root, "sigterm-node0", two_node_launch(root, "--train.auto-resume")) as s:
        running = s.wait_training(st.status["step"] + LEAD)
        os.kill(s.agents[0].proc.pid, signal.SIGTERM)
        stages["sigterm-node0"] = st = finish(s, running)
    _require_stopped(st)

    # 3. two nodes, `pimm resume RUN` (ranks per node and the backend as recorded); `pimm stop RUN`
    with TwoNodes(root, "pimm-stop", lambda node, port: ["resume", run_dir, *rendezvous(node, port)]) as s:
        running = s.wait_training(st.status["step"] + LEAD)
        _pause(running["pids"], signal.SIGSTOP)  # the run would end before `pimm stop` has started
        try:
            cli = pimm("stop", s.run_dir, timeout=60)
            # rank 0 polls control/stop at most once a second: paused that long, its next step polls
            # (on an idle machine the ~30 steps left take about a second, less than one poll interval)
            time.sleep(1.2)
        finally:
            _pause(running["pids"], signal.SIGCONT)
        stages["pimm-stop"] = st = finish(s, running, cli=cli)
    _require_stopped(st)

    # 4. one node: the run itself by two ranks (same world size), meanwhile a copy by one process
    # (world size 2 -> 1), in this process (pimm_here: no process start for what is a plain resume)
    copy_root = root / "copy"
    shutil.copytree(root / "digits", copy_root / "digits", symlinks=True)
    two = Agent(["resume", run_dir, "--nnodes", "1", "--nproc-per-node", "2"], root / "one-node.out")
    try:
        one = pimm_here(*launch_args(copy_root, "--train.resume", "--", *OVERRIDES))
        rc = two.wait(TIMEOUT)
    finally:
        two.kill()
    one_node = subprocess.CompletedProcess(two.proc.args, rc, two.output(), "")
    return Chain(root, run_dir, copy_root / "digits" / NAME, stages, one_node,
                 (one.returncode, one.stdout + one.stderr))


def _require_stopped(st: Stage) -> None:
    if st.codes != [0, 0] or (st.status or {}).get("state") != "stopped":
        pytest.fail(f"[{st.label}] did not stop cleanly (exit codes {st.codes}), the chain cannot go on:\n{st.why}")


# ------------------------------------------------------------------- tests
STOPS = [("sigterm-node1", "signal:SIGTERM"), ("sigterm-node0", "signal:SIGTERM"), ("pimm-stop", "operator")]


@pytest.mark.parametrize("label,reason", STOPS)
def test_both_agents_stop_together_with_last_saved(chain, label, reason):
    st = chain.stages[label]
    if "cli" in st.extra:
        assert st.extra["cli"].returncode == 0, describe(st.extra["cli"])  # `pimm stop RUN` wrote the request
    assert st.codes == [0, 0], st.why
    assert st.ranks_left == [], st.why
    assert (st.status["state"], st.status["stop_reason"], st.status["world_size"]) == ("stopped", reason, 2)
    # `last` is the standard format as two ranks write it (one DCP shard each), intact, at the stop step
    assert st.manifest["step"] == st.status["step"] >= st.running["step"]
    assert st.manifest["world_size"] == 2
    for name in ("weights.pth", "manifest.json", ".complete", "trainer.dcp/.metadata", "trainer.dcp/.complete",
                 "trainer.dcp/__0_0.distcp", "trainer.dcp/__1_0.distcp"):
        assert name in st.last_files, (name, st.last_files)
    assert st.last_problems == []
    # the summary and the resume command come once, from the agent whose node ran rank 0; no tracebacks
    both = "\n".join(st.outputs)
    assert both.count(f"stopped ({reason}): last saved at step {st.status['step']} ") == 1, st.why
    assert both.count("resume with: ") == 1, st.why
    assert "Traceback" not in both and "error" not in both.lower(), st.why


def test_two_agents_train_one_run(chain):
    st = chain.stages["sigterm-node1"]
    # one run directory, whose run files rank 0 alone writes; rank 0 holds .lock (there is no
    # one-node launcher holding it, so no .ranks.lock either); ranks/ holds each rank's own heartbeat
    assert st.run_files == [".lock", "config.toml", "metrics.jsonl", "model", "provenance.json", "ranks",
                            "status.json", "train.log"]
    prov = st.provenance
    assert prov["world_size"] == 2
    start = prov["starts"][0]
    assert (start["kind"], start["world_size"]) == ("start", 2)
    assert {k: start["launch"].get(k) for k in ("nproc_per_node", "nnodes", "rdzv_backend")} == {
        "nproc_per_node": 1, "nnodes": "2", "rdzv_backend": "c10d"}
    assert "node_rank" not in start["launch"]  # it differs per node
    # across the whole chain every optimizer step is logged once: one writer, each resume from the saved step
    train = [r["step"] for r in read_jsonl(chain.run_dir / "metrics.jsonl") if r["split"] == "train"]
    assert train == list(range(1, TOTAL + 1))


def test_a_live_multinode_run_refuses_another_launch(chain):
    intruder = chain.stages["sigterm-node1"].extra["intruder"]
    assert intruder.returncode == 2, describe(intruder)
    assert "is in use by" in intruder.stderr and "stop that run first" in intruder.stderr, describe(intruder)


@pytest.mark.parametrize("before,label", [("sigterm-node1", "sigterm-node0"), ("sigterm-node0", "pimm-stop")])
def test_resumes_on_two_nodes_continue_from_the_saved_step(chain, before, label):
    st, saved = chain.stages[label], chain.stages[before].status["step"]
    resume = [s for s in st.provenance["starts"] if s["kind"] == "resume"][-1]
    assert (resume["checkpoint_step"], resume["world_size"]) == (saved, 2), st.why
    assert resume["launch"]["nnodes"] == "2"
    assert st.running["step"] > saved


def test_resume_on_one_node_ends_equal_to_an_uninterrupted_run(chain, reference):
    assert chain.one_node.returncode == 0, describe(chain.one_node)
    status = read_json(chain.run_dir / "status.json")
    assert (status["state"], status["step"], status["world_size"]) == ("finished", TOTAL, 2)
    resume = [s for s in read_json(chain.run_dir / "provenance.json")["starts"] if s["kind"] == "resume"][-1]
    assert resume["checkpoint_step"] == chain.stages["pimm-stop"].status["step"]
    # on one node the two-node launch's recorded rendezvous is not reused
    assert resume["launch"] == {"launcher": "pimm", "nproc_per_node": 2, "nnodes": "1"}
    ref, ref_run = reference
    assert ref.wait(TIMEOUT) == 0, ref.output()
    got = torch.load(chain.run_dir / "model" / "last" / "weights.pth", weights_only=True)["state_dict"]
    want = torch.load(ref_run / "model" / "last" / "weights.pth", weights_only=True)["state_dict"]
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_resume_by_one_process_continues_at_world_size_one(chain):
    rc, output = chain.one_process
    assert rc == 0, output
    saved = chain.stages["pimm-stop"].status["step"]
    status = read_json(chain.copy / "status.json")
    assert (status["state"], status["world_size"]) == ("finished", 1)
    resume = [s for s in read_json(chain.copy / "provenance.json")["starts"] if s["kind"] == "resume"][-1]
    assert (resume["checkpoint_step"], resume["world_size"]) == (saved, 1)
    train = [r["step"] for r in read_jsonl(chain.copy / "metrics.jsonl") if r["split"] == "train"]
    assert train[:saved] == list(range(1, saved + 1)) and train[-1] > saved


def test_a_fresh_two_node_launch_refuses_a_run_with_checkpoints(chain, tmp_path):
    """Both agents refuse at once, before the rendezvous (neither waits for the other node)."""
    before = sorted(p.name for p in chain.run_dir.iterdir())
    port = free_port()
    agents = [Agent(two_node_launch(chain.root)(node, port), tmp_path / f"node{node}.out") for node in (0, 1)]
    codes = [a.wait(hang_s(60)) for a in agents]
    outs = [a.output() for a in agents]
    for a in agents:
        a.kill()
    assert codes == [2, 2], outs
    assert all("already has checkpoints" in out for out in outs), outs
    assert sorted(p.name for p in chain.run_dir.iterdir()) == before


def test_a_multinode_launch_needs_a_fixed_run_name(tmp_path):
    result = pimm("launch", "--train.config", DIGITS, "--run.root", tmp_path, "--run.name", "t",
                  "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", timeout=60)
    assert result.returncode == 2, describe(result)
    assert "--run.no-timestamp" in result.stderr
    assert list(tmp_path.iterdir()) == []
