#!/usr/bin/env python
"""Crash-consistency sweep: kill a real saving pimm run at every fail point of a save, then check.

For each checkpoint format (``standard``, ``legacy``, ``single``, ``standard`` with
``checkpoint.async``, and ``standard`` under ``train.strategy = "fsdp"``) and world
size (1; 2 through ``--nproc-per-node 2``), a traced
reference run lists every fail point (:mod:`pimm_core.faults`) a save passes through, with
the file it was about to touch. Every hit under ``model/`` is then a case (two-rank runs:
the hits of the second save, one file per point unless ``--ranks2 roles``): a fresh run
of ``configs/digits.toml`` (3 epochs, ``last`` saved every epoch, the last save being the
end of the run) is started with ``PIMM_FAILPOINT=<point>@<n>`` so that it SIGKILLs itself
exactly there, and after it died:

a. resume selection (``select_resume``, ``pimm checkpoints latest``) picks a complete
   candidate, or nothing, and then no save had completed;
b. ``pimm checkpoints ls --json`` reports every leftover temporary;
c. nothing under a final name is partial: every candidate that is not a temporary is
   complete, matches its manifest (``verify_candidate``) and its ``.pth`` zip archives pass
   their CRC check;
d. ``--train.resume`` (no fail point) exits 0, continues from the newest completed save or
   the one before (provenance ``checkpoint_step`` against the ``saved ... (step N`` lines of
   ``train.log`` and the steps earlier resumes loaded), finishes, and leaves no ``*.tmp``.

The I/O-error sweep injects ``=enospc`` and ``=eio`` at the same hits once the first save
completed (two ranks, ``standard``: ``=enospc`` at the second save's points): the launch exits 1 with one ``error:`` line naming the path, the previous
complete checkpoint stays selectable, temporaries are removed, and the same command as a
resume succeeds (no "already exists").

Single-process runs are forked from this process after it imported torch and pimm once
(``cli.main`` in a child that really dies by SIGKILL), which makes a case a few seconds;
two-rank runs are real ``python -m pimm_core.cli launch --nproc-per-node 2`` subprocesses
(torchrun). At most ``--jobs`` cases run at a time.

Usage::

    uv run python benchmarks/crash_points.py                       # full sweep, JSON table on stdout
    uv run python benchmarks/crash_points.py --out sweep.json      # table to a file, summary on stdout
    uv run python benchmarks/crash_points.py --variants legacy --no-io
    uv run python benchmarks/crash_points.py --case standard:1:rotate.renamed_to_prev:last.prev:1:kill

A ``--case`` is ``VARIANT:RANKS:POINT:ROLE:OCCURRENCE:ACTION``: ROLE is a substring of the
file the point touches (as listed in the table's ``role``), OCCURRENCE counts hits of that
(point, file) in the run. ``--chain NAME`` adds a built-in multi-kill case (see CHAINS).
With ``checkpoint.async`` only the points of the background publication that the main
thread never passes are used (``standard.*``, ``rotate.*``): ``file.*``/``atomic.*`` hit
counts race with the main thread's ``model_best.pth`` writes.

Each row of the JSON table: ``id``, ``variant``/``format``, ``ranks``, ``point``, ``n``
(the ``@n`` of the spec), ``role`` (the file the point touched in the traced run, pid and
step replaced by ``<pid>``/``<N>``), ``action``, ``first`` (how the faulted run ended),
``leftovers`` (temporaries it left), ``selected`` (what resume selection picked then),
``allowed_steps``, ``resumed_from`` (provenance ``checkpoint_step`` of the resume),
``outcome``, ``error`` (I/O cases: the ``error:`` line), ``problems`` (empty when it
passed), ``passed``, ``seconds``. Exit status: 0 when every case passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CONFIG = REPO / "configs" / "digits.toml"
GROUP = "digits"
# 3 epochs of 12 steps (batch 128; 6 per rank with 2 ranks), `last` at every epoch end, an
# improving `val/acc` (so `model_best.pth` / `best` is replaced too). A run is ~1 s of training.
RUN_OVERRIDES = ("train.epochs=3", "checkpoint.every_epochs=1", "data.batch_size=128", "model.hidden=64",
                 "train.warmup_steps=2", "train.lr=0.005", "train.log_every_steps=1000")
VARIANTS: dict[str, tuple[str, ...]] = {
    "standard": ('checkpoint_format="standard"',),
    "legacy": ('checkpoint_format="legacy"',),
    "single": ('checkpoint_format="single"',),
    "async": ('checkpoint_format="standard"', "checkpoint.async=true"),
    # FSDP2: every rank writes its shards of the model, optimizer and EMA; rank 0 the gathered weights.pth
    "fsdp": ('checkpoint_format="standard"', 'train.strategy="fsdp"', 'train.blocks=["Linear"]', "ema.enabled=true"),
}
FORMAT = {"standard": "standard", "legacy": "legacy", "single": "single", "async": "standard", "fsdp": "standard"}
# Multi-kill cases for the rotation's recovery paths: every spec but the last kills a run
# (the first a fresh one, the next ones resumes); the case's own point is the last spec.
CHAINS: dict[str, tuple[str, list[str]]] = {
    # last + last.prev both present (killed after the 2nd rename), then the next rotation
    # must remove the old last.prev first.
    "old_prev_removed": ("standard", ["rotate.renamed_into_place@2", "rotate.old_prev_removed@1"]),
    "old_prev_then_rename": ("standard", ["rotate.renamed_into_place@2", "rotate.renamed_to_prev@1"]),
    # only last.prev (killed between the renames), resumed from it; killed again while
    # publishing the next save with no `last` in place.
    "prev_only_into_place": ("standard", ["rotate.renamed_to_prev@1", "rotate.renamed_into_place@1"]),
    "prev_only_prepared": ("standard", ["rotate.renamed_to_prev@1", "standard.prepared@1"]),
}
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                 "PIMM_FAILPOINT", "PIMM_TRACE_DIR")
SAVED_RE = re.compile(r"\bsaved (\S+) \(step (\d+)")
STRERROR = {"enospc": os.strerror(28), "eio": os.strerror(5)}


# --------------------------------------------------------------------------- cases
@dataclass
class Case:
    variant: str
    ranks: int
    point: str
    n: int
    action: str = "kill"
    role: str = ""
    occurrence: int = 1
    pre: list[str] = field(default_factory=list)  # chained: specs of earlier kills
    chain: str | None = None

    @property
    def spec(self) -> str:
        return f"{self.point}@{self.n}" + ("" if self.action == "kill" else f"={self.action}")

    @property
    def id(self) -> str:
        head = f"chain-{self.chain}" if self.chain else f"{self.variant}-r{self.ranks}"
        return f"{head}-{self.point}@{self.n}-{self.action}"


def normalize(rel: str) -> str:
    """A touched path without the writer's pid and the step number, e.g. ``model/.step_<N>.pth.<pid>.tmp``."""
    return re.sub(r"step_\d+", "step_<N>", re.sub(r"\.\d+\.tmp$", ".<pid>.tmp", rel))


def env_clean(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def launch_argv(root: Path, name: str, variant: str, *, resume: bool = False) -> list[str]:
    argv = ["launch", "--train.config", str(CONFIG), "--run.root", str(root), "--run.name", name, "--run.no-timestamp"]
    if resume:
        argv.append("--train.resume")
    return [*argv, "--", *RUN_OVERRIDES, *VARIANTS[variant]]


# --------------------------------------------------------------------------- processes
@dataclass
class Proc:
    rc: int | None  # exit status, or None when killed by a signal
    signal: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False

    @property
    def sigkilled(self) -> bool:
        # one process: killed by SIGKILL; torchrun: `pimm launch` names the rank and the signal
        return self.signal == signal.SIGKILL or (
            self.rc not in (None, 0) and re.search(r"rank \d+ was killed by SIGKILL|exit(?: )?code:? -9\b",
                                                   self.stderr) is not None)

    def brief(self) -> str:
        return f"signal {self.signal}" if self.signal else f"exit {self.rc}"


def _wait(pid: int, timeout: float) -> tuple[int | None, int | None, bool]:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                return None, os.WTERMSIG(status), False
            return os.WEXITSTATUS(status), None, False
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None, signal.SIGKILL, True
        time.sleep(0.02)


def run_cli(argv: list[str], logs: Path, *, spec: str = "", ranks: int = 1, timeout: float = 300) -> Proc:
    """``pimm ARGV`` with ``PIMM_FAILPOINT=spec``: forked from this (pre-imported) process for one
    rank, a ``python -m pimm_core.cli`` subprocess (torchrun) for more."""
    logs.parent.mkdir(parents=True, exist_ok=True)
    out, err = logs.with_suffix(".out"), logs.with_suffix(".err")
    start = time.monotonic()
    if ranks > 1:
        env = env_clean(**({"PIMM_FAILPOINT": spec} if spec else {}))
        cmd = [sys.executable, "-m", "pimm_core.cli", *argv[:1], "--nproc-per-node", str(ranks), *argv[1:]]
        with open(out, "w") as fo, open(err, "w") as fe:
            p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fo, stderr=fe, start_new_session=True)
            try:
                rc, sig, timed_out = p.wait(timeout=timeout), None, False
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc, sig, timed_out = None, signal.SIGKILL, True
        if rc is not None and rc < 0:
            rc, sig = None, -rc
    else:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # child: become `pimm ARGV` with the fail point armed
            code = 1
            try:
                fo = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                fe = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fo, 1)
                os.dup2(fe, 2)
                for k in LAUNCHER_VARS:
                    os.environ.pop(k, None)
                if spec:
                    os.environ["PIMM_FAILPOINT"] = spec
                import pimm_core.faults as faults
                import torch

                faults._SPEC = spec
                faults._hits.clear()
                torch.set_num_threads(1)
                from pimm_core import cli

                code = cli.main(list(argv))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        rc, sig, timed_out = _wait(pid, timeout)
    return Proc(rc, sig, out.read_text(errors="replace"), err.read_text(errors="replace"),
                round(time.monotonic() - start, 2), timed_out)


# --------------------------------------------------------------------------- tracing
_TRACER = '''
import json, os
import pimm_core.faults as _f
_orig = _f.point
def _trace(name, path=None):
    with open(os.path.join(os.environ["PIMM_TRACE_DIR"], "trace.%d.jsonl" % os.getpid()), "a") as fh:
        fh.write(json.dumps([name, str(path)]) + "\\n")
    return _orig(name, path)
_f.point = _trace
'''


def trace(variant: str, ranks: int, work: Path) -> dict[str, Any]:
    """Run the reference run once with every fail point recording (name, path) in order.

    Returns:
        ``{"hits": [[name, n, role], ...] (rank 0, under model/), "saves": [step, ...],
        "boundary": index of the first hit after the first completed `last` save}``.
    """
    root = work / f"trace-{variant}-r{ranks}"
    shutil.rmtree(root, ignore_errors=True)
    tdir = root / "trace"
    tdir.mkdir(parents=True)
    (tdir / "sitecustomize.py").write_text(_TRACER)
    run_dir = root / GROUP / "t"
    argv = launch_argv(root, "t", variant)
    if ranks > 1:
        env = env_clean(PIMM_TRACE_DIR=str(tdir), PYTHONPATH=os.pathsep.join(
            [str(tdir), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        cmd = [sys.executable, "-m", "pimm_core.cli", "launch", "--nproc-per-node", str(ranks), *argv[1:]]
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        ok, detail = p.returncode == 0, p.stderr[-2000:]
    else:
        os.environ["PIMM_TRACE_DIR"] = str(tdir)
        import pimm_core.faults as faults

        orig = faults.point

        def tracer(name: str, path: object = None) -> None:
            with open(tdir / f"trace.{os.getpid()}.jsonl", "a") as fh:
                fh.write(json.dumps([name, str(path)]) + "\n")

        patched = [m for m in list(sys.modules.values())
                   if getattr(m, "__name__", "").startswith("pimm_core.") and m is not faults
                   and getattr(m, "point", None) is orig]
        for m in patched:
            m.point = tracer
        try:
            p = run_cli(argv, root / "logs" / "trace")
        finally:
            for m in patched:
                m.point = orig
            os.environ.pop("PIMM_TRACE_DIR", None)
        ok, detail = p.rc == 0, p.stderr[-2000:]
    if not ok:
        raise RuntimeError(f"trace run {variant} r{ranks} failed: {detail}")
    files = sorted(tdir.glob("trace.*.jsonl"), key=lambda f: -len(f.read_text().splitlines()))
    raw = [json.loads(line) for line in files[0].read_text().splitlines()]
    counts: dict[str, int] = {}
    hits, boundary = [], None
    publish = {"standard": ("rotate.renamed_into_place", "model/last"), "async": ("rotate.renamed_into_place", "model/last"),
               "fsdp": ("rotate.renamed_into_place", "model/last"),
               "legacy": ("file_format.sidecar_written", "model/model_last.pth"),
               "single": ("pointer.replaced", "model/last")}[variant]
    for name, path in raw:
        counts[name] = counts.get(name, 0) + 1
        try:
            rel = Path(path).relative_to(run_dir).as_posix()
        except ValueError:
            continue
        if not rel.startswith("model"):
            continue  # config.toml, provenance.json: not part of a save
        role = normalize(rel)
        hits.append([name, counts[name], role])
        if boundary is None and (name, role) == publish:
            boundary = len(hits)
    saves = []
    for m in SAVED_RE.finditer((run_dir / "train.log").read_text()):
        if int(m.group(2)) not in saves:
            saves.append(int(m.group(2)))
    return {"hits": hits, "saves": saves, "boundary": boundary if boundary is not None else len(hits)}


def cases_from_trace(variant: str, ranks: int, tr: dict[str, Any], *, actions: tuple[str, ...],
                     occurrences: tuple[int, ...] = (), one_role_per_point: bool = False,
                     after_first_save: bool = False) -> list[Case]:
    out, seen, occ = [], set(), {}
    for i, (name, n, role) in enumerate(tr["hits"]):
        if variant == "async" and name.split(".")[0] in ("file", "atomic"):
            continue  # shared by the background publication and the main thread's best writes: racy hit counts
        occ[(name, role)] = occ.get((name, role), 0) + 1
        k = occ[(name, role)]
        if after_first_save and i < tr["boundary"]:  # I/O errors: once a complete save exists
            continue
        if occurrences and k not in occurrences:
            continue
        if one_role_per_point:
            if (name, k) in seen:
                continue
            seen.add((name, k))
        for action in actions:
            out.append(Case(variant, ranks, name, n, action, role, k))
    return out


def resolve_case(text: str, traces: dict[tuple[str, int], dict[str, Any]], work: Path) -> Case:
    variant, ranks, point, role, occurrence, action = text.split(":")
    key = (variant, int(ranks))
    if key not in traces:
        traces[key] = trace(variant, int(ranks), work)
    k = 0
    for name, n, r in traces[key]["hits"]:
        if name == point and role in r:
            k += 1
            if k == int(occurrence):
                return Case(variant, int(ranks), point, n, action, r, k)
    raise SystemExit(f"error: no hit {point} on a path containing {role!r} (occurrence {occurrence}) "
                     f"in the {variant} r{ranks} trace")


# --------------------------------------------------------------------------- checks
def is_temporary(name: str) -> bool:
    return name.endswith(".tmp") or (name.startswith(".") and ".tmp" in name)


def leftovers(model_dir: Path) -> list[str]:
    return sorted(p.name for p in model_dir.iterdir() if is_temporary(p.name)) if model_dir.is_dir() else []


def saved_steps(run_dir: Path) -> list[int]:
    try:
        text = (run_dir / "train.log").read_text()
    except OSError:
        return []
    return [int(m.group(2)) for m in SAVED_RE.finditer(text)]


def provenance_starts(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return json.loads((run_dir / "provenance.json").read_text()).get("starts", [])
    except (OSError, ValueError):
        return []


def completed_steps(run_dir: Path, variant: str) -> list[int]:
    """Steps known to have been saved: logged ``saved`` lines and what earlier resumes loaded.

    With ``checkpoint.async`` the trainer logs ``saved`` when the background write starts,
    so the newest logged step may still have been in flight (published only once the next
    save or the end waits for it).
    """
    logged = saved_steps(run_dir)
    steps = set(logged[:-1] if variant == "async" else logged)
    steps |= {s["checkpoint_step"] for s in provenance_starts(run_dir)
              if s.get("kind") == "resume" and s.get("checkpoint_step") is not None}
    return sorted(steps)


def allowed_steps(done: list[int], logged: list[int], schedule: list[int]) -> set[int]:
    """The newest completed save, the one before, or a save in flight (if it got published):
    a scheduled step after the newest completed one, up to the first one after the newest logged."""
    allowed = set(done[-2:])
    newest = done[-1] if done else 0
    last_logged = max([newest, *logged])
    later = [s for s in schedule if s > last_logged]
    allowed |= {s for s in schedule if newest < s <= (later[0] if later else last_logged)}
    return allowed


def final_name_problems(model_dir: Path) -> list[str]:
    """Anything under a final name that is not a complete, intact checkpoint."""
    from pimm_core.checkpoint.select.selection import list_candidates, verify_candidate

    problems = []
    for c in list_candidates(model_dir):
        if c.kind == "tmp":
            continue
        if not c.complete:
            problems.append(f"{c.name}: incomplete under a final name ({c.reason})")
            continue
        bad = verify_candidate(c)
        if bad:
            problems.append(f"{c.name}: fails verification ({'; '.join(bad)})")
    pths = [p for p in model_dir.glob("*.pth") if not is_temporary(p.name)]
    # a standard checkpoint's weights.pth has no zip CRCs (its sha256 is checked above): the
    # zip structure (central directory at the end, so a truncation shows) is checked alone
    in_standard = [p for d in ("last", "last.prev") for p in [model_dir / d / "weights.pth"] if p.is_file()]
    for p in pths + in_standard:
        try:
            with zipfile.ZipFile(p) as z:
                broken = None if p in in_standard else z.testzip()
            if broken:
                problems.append(f"{p.relative_to(model_dir)}: CRC error in {broken}")
        except (zipfile.BadZipFile, OSError) as e:
            problems.append(f"{p.relative_to(model_dir)}: not a complete zip archive ({e})")
    return problems


def cli_json(argv: list[str], logs: Path) -> tuple[Proc, Any]:
    p = run_cli(argv, logs, timeout=300)
    try:
        return p, json.loads(p.stdout)
    except ValueError:
        return p, None


def error_lines(p: Proc) -> list[str]:
    return [line for line in p.stderr.splitlines() if line.startswith("error:")]


def check_state(case: Case, run_dir: Path, schedule: list[int], work: Path, tag: str,
                problems: list[str]) -> tuple[Any, set[int]]:
    """(a)-(c) on a run that just died or failed; returns (chosen candidate, allowed steps)."""
    from pimm_core.checkpoint.select.selection import select_resume, select_verified

    model_dir = run_dir / "model"
    chosen, cands = select_resume(model_dir)
    verified, _warn = select_verified(model_dir)
    done = completed_steps(run_dir, case.variant)
    allowed = allowed_steps(done, saved_steps(run_dir), schedule)
    if chosen is None:
        resumable = [c.name for c in cands if c.resumable and c.complete]
        if done:
            problems.append(f"{tag}: no candidate selected although saves completed at steps {done}")
        if resumable:
            problems.append(f"{tag}: no candidate selected although {resumable} are complete")
    else:
        if chosen.step is not None and chosen.step not in allowed:  # None: no sidecar; the resume checks it
            problems.append(f"{tag}: selected {chosen.name} at step {chosen.step}, expected one of {sorted(allowed)} "
                            f"(completed saves {done})")
        if verified is None or verified.path != chosen.path:
            problems.append(f"{tag}: selected {chosen.name} but the trainer would load "
                            f"{verified.name if verified else 'nothing'} (verification)")
    # (b) leftovers are reported by `pimm checkpoints ls --json`
    tmp = leftovers(model_dir)
    p, ls = cli_json(["checkpoints", "ls", str(run_dir), "--json"], work / "logs" / f"{tag}-ls")
    if ls is None:
        if model_dir.is_dir():
            problems.append(f"{tag}: pimm checkpoints ls --json failed ({p.brief()}): {p.stderr.strip()[-300:]}")
    else:
        listed = {c["name"] for c in ls["candidates"] if c["kind"] == "tmp"}
        if set(tmp) - listed:
            problems.append(f"{tag}: leftovers {sorted(set(tmp) - listed)} not reported by pimm checkpoints ls")
        if ls["selected"] != (chosen.name if chosen else None):
            problems.append(f"{tag}: pimm checkpoints ls selected {ls['selected']}, select_resume {chosen and chosen.name}")
    p = run_cli(["checkpoints", "latest", str(model_dir)], work / "logs" / f"{tag}-latest", timeout=300)
    want = chosen.path if chosen else None
    got = p.stdout.strip() if p.rc == 0 else None
    if model_dir.is_dir() and got != want:
        problems.append(f"{tag}: pimm checkpoints latest printed {got!r} (exit {p.rc}), expected {want!r}")
    # (c) nothing under a final name is partial
    problems += [f"{tag}: {x}" for x in final_name_problems(model_dir)] if model_dir.is_dir() else []
    return chosen, allowed


def check_finished(run_dir: Path, schedule: list[int], tag: str, problems: list[str]) -> None:
    from pimm_core.checkpoint.select.selection import select_resume

    model_dir = run_dir / "model"
    status = {}
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        pass
    if status.get("state") != "finished":
        problems.append(f"{tag}: status {status.get('state')!r}, expected finished")
    steps = saved_steps(run_dir)
    if not steps or steps[-1] != schedule[-1]:
        problems.append(f"{tag}: last saved step {steps[-1] if steps else None}, expected {schedule[-1]}")
    tmp = leftovers(model_dir)
    if tmp:
        problems.append(f"{tag}: temporaries left after a successful save: {tmp}")
    problems += [f"{tag}: {x}" for x in final_name_problems(model_dir)]
    chosen, _ = select_resume(model_dir)
    if chosen is None or chosen.step != schedule[-1]:
        problems.append(f"{tag}: resume would now select {chosen and chosen.name} at step {chosen and chosen.step}, "
                        f"expected step {schedule[-1]}")


def describe(c: Any) -> str | None:
    return None if c is None else f"{c.name} (step {c.step})"


def run_case(case: Case, schedule: list[int], work: Path) -> dict[str, Any]:
    start = time.monotonic()
    name = re.sub(r"[^A-Za-z0-9_.@-]", "_", case.id)
    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    run_dir = root / GROUP / "r"
    logs = root / "logs"
    problems: list[str] = []
    row: dict[str, Any] = {"id": case.id, "variant": case.variant, "format": FORMAT[case.variant],
                           "ranks": case.ranks, "point": case.point, "n": case.n, "role": case.role,
                           "occurrence": case.occurrence, "action": case.action, "chain": case.chain}
    # limits that only catch a hang: a loaded machine is several times slower (the 2-rank
    # ENOSPC case took 142 s of its former 300 s limit beside other jobs at load 15)
    t = 900 if case.ranks > 1 else 600
    # earlier kills of a chained case
    for i, spec in enumerate(case.pre):
        p = run_cli(launch_argv(root, "r", case.variant, resume=i > 0), logs / f"pre{i}", spec=spec,
                    ranks=case.ranks, timeout=t)
        if not p.sigkilled:
            problems.append(f"pre-kill {spec}: the run was not killed ({p.brief()})")
    p = run_cli(launch_argv(root, "r", case.variant, resume=bool(case.pre)), logs / "first", spec=case.spec,
                ranks=case.ranks, timeout=t)
    row["first"] = p.brief()
    tmp_before = leftovers(run_dir / "model")
    row["leftovers"] = tmp_before
    if case.action == "kill":
        if not p.sigkilled:
            problems.append(f"the run was not killed at {case.spec} ({p.brief()}): {p.stderr.strip()[-500:]}")
    else:
        errs = error_lines(p)
        if p.rc != 1:
            problems.append(f"expected exit 1 after {case.spec}, got {p.brief()}: {p.stderr.strip()[-500:]}")
        if len(errs) != 1:
            problems.append(f"expected one error: line, got {errs or p.stderr.strip()[-500:]}")
        elif str(run_dir / "model") not in errs[0] or STRERROR[case.action] not in errs[0]:
            problems.append(f"error line does not name the path and the OS error: {errs[0]}")
        if "Traceback" in p.stderr:
            problems.append("a traceback was printed")
        row["error"] = errs[0] if errs else None
        if tmp_before:
            problems.append(f"temporaries not removed after the failed save: {tmp_before}")
    chosen, allowed = check_state(case, run_dir, schedule, root, "after", problems)
    row["selected"] = describe(chosen)
    row["allowed_steps"] = sorted(allowed)
    # (d) resume
    if chosen is None:
        r = run_cli(launch_argv(root, "r", case.variant, resume=True), logs / "resume", ranks=case.ranks, timeout=t)
        errs = error_lines(r)
        ok = r.rc == 2 and len(errs) == 1 and "no complete checkpoint" in errs[0]
        if not ok:
            problems.append(f"resume with nothing saved: expected exit 2 and one 'no complete checkpoint' error "
                            f"line, got {r.brief()}: {r.stderr.strip()[-400:]}")
        row["resumed_from"] = None
        row["outcome"] = "nothing saved yet; resume refused (exit 2: no complete checkpoint)"
        # not a guarantee under test: whether the same fresh launch may start over
        f = run_cli(launch_argv(root, "r", case.variant), logs / "fresh", ranks=case.ranks, timeout=t)
        row["fresh_relaunch"] = "ok" if f.rc == 0 else (error_lines(f) or [f.brief()])[0][:200]
    else:
        r = run_cli(launch_argv(root, "r", case.variant, resume=True), logs / "resume", ranks=case.ranks, timeout=t)
        starts = provenance_starts(run_dir)
        resumes = [s for s in starts if s.get("kind") == "resume"]
        step = resumes[-1].get("checkpoint_step") if resumes else None
        row["resumed_from"] = step
        if r.rc != 0:
            problems.append(f"resume failed ({r.brief()}): {(r.stderr.strip() or r.stdout.strip())[-600:]}")
        else:
            if step not in allowed:
                problems.append(f"resume continued from step {step}, expected one of {sorted(allowed)}")
            if "already exists" in r.stdout + r.stderr:
                problems.append("'already exists' in the resume's output")
            check_finished(run_dir, schedule, "after resume", problems)
        row["outcome"] = (f"resumed from step {step}, finished at {saved_steps(run_dir)[-1:] or '?'}"
                          if r.rc == 0 else f"resume failed ({r.brief()})")
    row["problems"] = problems
    row["passed"] = not problems
    row["seconds"] = round(time.monotonic() - start, 1)
    if row["passed"]:
        shutil.rmtree(root, ignore_errors=True)
    return row


# --------------------------------------------------------------------------- driver
def preload() -> None:
    """Import what a run needs once, so forked runs start in a fraction of a second."""
    import pimm_core.data.loaders  # noqa: F401  (the digits are read without importing scikit-learn)
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (imported lazily by the optimizer)
    import torch.distributed.checkpoint  # noqa: F401

    import pimm_core.checkpoint.formats.files  # noqa: F401
    import pimm_core.cli  # noqa: F401
    import pimm_core.launch  # noqa: F401
    import pimm_core.trainer  # noqa: F401


def run_all(cases: list[Case], schedules: dict[tuple[str, int], list[int]], work: Path, jobs: int,
            quiet: bool = False) -> list[dict[str, Any]]:
    """Run ``cases`` in forked workers, at most ``jobs`` at a time; rows in case order."""
    results = work / "results"
    results.mkdir(parents=True, exist_ok=True)
    pending = list(enumerate(cases))
    running: dict[int, tuple[int, Case, float]] = {}
    rows: dict[int, dict[str, Any]] = {}
    while pending or running:
        while pending and len(running) < jobs:
            i, case = pending.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    row = run_case(case, schedules[(case.variant, case.ranks)], work)
                    (results / f"{i}.json").write_text(json.dumps(row))
                except BaseException:
                    (results / f"{i}.err").write_text(traceback.format_exc())
                    code = 1
                finally:
                    os._exit(code)
            running[pid] = (i, case, time.monotonic())
        pid, _status = os.wait()
        if pid not in running:
            continue
        i, case, t0 = running.pop(pid)
        f = results / f"{i}.json"
        if f.exists():
            row = json.loads(f.read_text())
        else:
            err = (results / f"{i}.err").read_text() if (results / f"{i}.err").exists() else "worker died"
            row = {"id": case.id, "variant": case.variant, "ranks": case.ranks, "point": case.point, "n": case.n,
                   "action": case.action, "role": case.role, "passed": False, "problems": [f"harness error: {err}"],
                   "seconds": round(time.monotonic() - t0, 1)}
        rows[i] = row
        if not quiet:
            mark = "ok  " if row["passed"] else "FAIL"
            print(f"[{len(rows)}/{len(cases)}] {mark} {row['id']:<58} {row.get('role', ''):<42} "
                  f"-> {row.get('selected')} | {row.get('outcome', '')} ({row['seconds']} s)", file=sys.stderr, flush=True)
            for prob in row["problems"]:
                print(f"        {prob}", file=sys.stderr, flush=True)
    return [rows[i] for i in range(len(cases))]


def summarize(rows: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    kills = [r for r in rows if r["action"] == "kill"]
    io = [r for r in rows if r["action"] != "kill"]
    by: dict[str, dict[str, int]] = {}
    for r in rows:
        key = f"{r['variant']} r{r['ranks']} {r['action']}" + (" (chain)" if r.get("chain") else "")
        b = by.setdefault(key, {"cases": 0, "passed": 0})
        b["cases"] += 1
        b["passed"] += bool(r["passed"])
    return {
        "cases": len(rows), "passed": sum(r["passed"] for r in rows), "failed": sum(not r["passed"] for r in rows),
        "kill_cases": len(kills),
        "distinct_kill_points": len({(r["variant"], r["ranks"], r["point"], r["n"], r.get("chain")) for r in kills}),
        "distinct_point_names": len({r["point"] for r in rows}),
        "io_cases": len(io), "by_group": by, "seconds": round(seconds, 1),
        "failed_ids": [r["id"] for r in rows if not r["passed"]],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="standard,legacy,single,async,fsdp", help="comma-separated: " + ",".join(VARIANTS))
    ap.add_argument("--ranks", default="1,2", help="world sizes (2: torchrun, standard, single and fsdp only)")
    ap.add_argument("--ranks2", choices=("roles", "points", "none"), default="points",
                    help="two-rank cases: every (point, file) at both occurrences, or one file per point (default)")
    ap.add_argument("--no-io", action="store_true", help="skip the ENOSPC/EIO sweep")
    ap.add_argument("--io-only", action="store_true", help="only the ENOSPC/EIO sweep")
    ap.add_argument("--no-chains", action="store_true", help="skip the multi-kill rotation cases")
    ap.add_argument("--case", action="append", default=[], help="only these cases (VARIANT:RANKS:POINT:ROLE:OCC:ACTION)")
    ap.add_argument("--chain", action="append", default=[], help="only these chained cases (names in CHAINS)")
    ap.add_argument("--jobs", type=int, default=2, help="cases at a time (default 2)")
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (failed cases are kept anyway)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON table here (default: stdout)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="pimm-crash-"))
    work.mkdir(parents=True, exist_ok=True)
    preload()
    traces: dict[tuple[str, int], dict[str, Any]] = {}
    cases: list[Case] = []
    if args.case or args.chain:
        cases += [resolve_case(text, traces, work) for text in args.case]
        names = args.chain
    else:
        variants = [v for v in args.variants.split(",") if v]
        ranks = [int(r) for r in args.ranks.split(",") if r]
        for v in variants:
            for r in ranks:
                if r > 1 and (v not in ("standard", "single", "fsdp") or args.ranks2 == "none"):
                    continue
                traces[(v, r)] = trace(v, r, work)
                if not args.io_only:
                    cases += cases_from_trace(v, r, traces[(v, r)], actions=("kill",),
                                              one_role_per_point=r > 1 and args.ranks2 == "points",
                                              occurrences=() if r == 1 or args.ranks2 == "roles" else (2,))
                if not args.no_io and r == 1:
                    cases += cases_from_trace(v, r, traces[(v, r)], actions=("enospc", "eio"), after_first_save=True)
                elif not args.no_io and v == "standard":  # two ranks: ENOSPC at the second save's points
                    cases += cases_from_trace(v, r, traces[(v, r)], actions=("enospc",), after_first_save=True,
                                              one_role_per_point=args.ranks2 == "points", occurrences=(2,))
        names = [] if args.no_chains or args.io_only else [c for c, (v, _) in CHAINS.items() if v in variants]
    for cname in names:
        variant, specs = CHAINS[cname]
        if (variant, 1) not in traces:
            traces[(variant, 1)] = trace(variant, 1, work)
        point, _, n = specs[-1].partition("@")
        cases.append(Case(variant, 1, point, int(n), "kill", "", 1, specs[:-1], cname))
    schedules = {k: tr["saves"] for k, tr in traces.items()}
    if args.list:
        for c in cases:
            print(f"{c.id:<60} {c.role}")
        print(f"{len(cases)} cases", file=sys.stderr)
        return 0
    print(f"{len(cases)} cases, {args.jobs} at a time, work {work}", file=sys.stderr, flush=True)
    rows = run_all(cases, schedules, work, args.jobs, args.quiet)
    summary = summarize(rows, time.monotonic() - t0)
    table = {"summary": summary, "config_overrides": list(RUN_OVERRIDES), "save_steps": {f"{v} r{r}": s for (v, r), s in schedules.items()},
             "cases": rows}
    text = json.dumps(table, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
        print(json.dumps(summary, indent=2))
    else:
        print(text)
    if not args.keep and not summary["failed"] and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    elif summary["failed"]:
        print(f"failed cases kept under {work}", file=sys.stderr)
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
