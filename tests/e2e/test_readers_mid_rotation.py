"""Readers with a save landing at a chosen instant of their read: the reader is a real ``pimm``
process paused at one of its fail points (``PIMM_FAILPOINT=<point>=pause``, see
:mod:`pimm_core.faults`); while it waits, this test rotates ``last`` with the writer's own
:func:`~pimm_core.checkpoint.publish.rotation.rotate_into_place` (or a writer process paused between the
rotation's two renames), then lets it go on. Each answer must be right, or "changed while
reading; try again" with exit code 75: never "corrupt", "missing" or "nothing there".

The live counterpart (a real run saving every step, readers in a loop) is
``tests/e2e/test_live_readers.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from _helpers import REPO, clean_env, hang_s
from pimm_core.checkpoint.records.manifest import describe_files
from pimm_core.checkpoint.publish.rotation import rotate_into_place, wait_for_purges
from pimm_core.errors import CHANGED_EXIT_CODE


def _generation(path: Path, step: int) -> Path:
    """A complete standard checkpoint whose one tensor holds ``step`` (real weights.pth, manifest with sha256)."""
    (path / "trainer.dcp").mkdir(parents=True)
    torch.save({"state_dict": {"w": torch.full((4,), float(step))}}, path / "weights.pth")
    (path / "trainer.dcp" / ".metadata").write_bytes(f"meta {step}".encode())
    (path / "trainer.dcp" / ".complete").write_bytes(b"")
    (path / "manifest.json").write_text(json.dumps({"manifest_version": 1, "format": "standard", "kind": "last",
                                                    "step": step, "epoch": 0, "iter": step,
                                                    "files": describe_files(path)}))
    (path / ".complete").write_bytes(b"")
    return path


def _save(model: Path, step: int) -> None:
    """What a run's save does to `last`, with the writer's own rotation."""
    rotate_into_place(_generation(model / "last.tmp", step), model / "last")
    wait_for_purges()


class Paused:
    """A process started with ``PIMM_FAILPOINT`` pause points, and their ``.reached`` / ``.go`` files."""

    def __init__(self, args: list[str], points: str, sync: Path):
        self.sync = sync
        sync.mkdir(parents=True, exist_ok=True)
        env = {**clean_env(), "PIMM_FAILPOINT": points, "PIMM_FAILPOINT_DIR": str(sync)}
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)

    def reached(self, name: str, n: int = 1) -> bool:
        """Wait until the process is paused at hit ``n`` of ``name`` (True) or has exited (False)."""
        flag = self.sync / f"{name}.reached{'' if n == 1 else f'.{n}'}"
        deadline = time.monotonic() + hang_s(60)
        while not flag.exists():
            if self.proc.poll() is not None:
                return flag.exists()
            assert time.monotonic() < deadline, f"{name} (hit {n}) not reached"
            time.sleep(0.005)
        return True

    def go(self, name: str, n: int = 1) -> None:
        (self.sync / f"{name}.go{'' if n == 1 else f'.{n}'}").write_bytes(b"")

    def finish(self) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=hang_s(60))
        return self.proc.returncode, out, err


def _pimm(*args: object) -> list[str]:
    return [sys.executable, "-m", "pimm_core.cli", *map(str, args)]


def test_verify_of_last_caught_between_a_rotations_two_renames(tmp_path: Path) -> None:
    """`verify model/last` looks at `last` just as a save renames it to `last.prev` (and before
    `last.tmp` becomes `last`): it waits for the new `last` and verifies it (it used to exit 2,
    "does not exist", or take `last` for a model/ directory: "no checkpoint found")."""
    model = tmp_path / "run" / "model"
    _generation(model / "last", 10)
    _generation(model / "last.tmp", 11)
    reader = Paused(_pimm("checkpoints", "verify", model / "last"),
                    "checkpoints.verify.located=pause,generation.rotating=pause", tmp_path / "r")
    assert reader.reached("checkpoints.verify.located"), reader.finish()
    writer = Paused([sys.executable, "-c", "import sys; from pathlib import Path; "
                     "from pimm_core.checkpoint.publish.rotation import rotate_into_place, wait_for_purges; "
                     "rotate_into_place(Path(sys.argv[1]), Path(sys.argv[2])); wait_for_purges()",
                     str(model / "last.tmp"), str(model / "last")], "rotate.renamed_to_prev=pause", tmp_path / "w")
    assert writer.reached("rotate.renamed_to_prev"), writer.finish()
    assert not (model / "last").exists() and (model / "last.prev").is_dir()  # the instant between the renames
    reader.go("checkpoints.verify.located")
    assert reader.reached("generation.rotating"), reader.finish()  # it saw `last` absent, a rotation under way
    writer.go("rotate.renamed_to_prev")
    assert writer.finish()[0] == 0
    reader.go("generation.rotating")
    assert reader.finish() == (0, "last: ok\n", "")


def test_readers_overtaken_by_every_save_say_try_again(tmp_path: Path) -> None:
    """A save lands inside every try of `latest`, `verify` and `export`: each says the checkpoint
    changed while reading, exits 75 (a script's cue to retry), and calls nothing corrupt or
    missing (`latest` used to say "no complete checkpoint", exit 1; verify and export exit 1)."""
    model = tmp_path / "run" / "model"
    _generation(model / "last", 10)
    step = 10
    cases = ((("checkpoints", "latest", model), "selection.listed"),
             (("checkpoints", "verify", model / "last"), "checkpoints.verify.described"),
             (("export", model / "last", tmp_path / "out"), "generation.located"))
    for i, (args, point) in enumerate(cases):
        reader = Paused(_pimm(*args), f"{point}@1+=pause", tmp_path / f"s{i}")
        n = 1
        while reader.reached(point, n):
            step += 1
            _save(model, step)
            reader.go(point, n)
            n += 1
        code, out, err = reader.finish()
        assert code == CHANGED_EXIT_CODE, (args, code, out, err)
        assert "changed while reading" in out + err and "try again" in out + err, (out, err)
        assert not any(w in (out + err).lower() for w in ("corrupt", "failed", "no complete", "traceback")), (out, err)
        assert n > 2  # it was overtaken more than once before giving up
    assert not (tmp_path / "out" / "export.json").exists()


def test_verify_while_retention_removes_a_snapshot(tmp_path: Path) -> None:
    """A run with `checkpoint.keep_iter = 1` paused while it removes the older `iter_<step>.pth`:
    `verify RUN` at that instant says every checkpoint is ok. The snapshot goes before its sidecar
    manifest (a file found without its manifest was "cannot verify", exit 1)."""
    from _helpers import DIGITS

    root = tmp_path / "exp"
    run = root / "digits" / "keep1"
    writer = Paused(_pimm("launch", "--train.config", DIGITS, "--run.root", root, "--run.name", "keep1",
                          "--run.no-timestamp", "--", "train.epochs=1", "train.max_steps=3", "checkpoint.every_steps=1",
                          "checkpoint.keep_iter=1", "eval.every_epochs=0"),
                    "checkpoint.snapshot_pruning=pause", tmp_path / "w")
    assert writer.reached("checkpoint.snapshot_pruning"), writer.finish()
    verify = subprocess.run(_pimm("checkpoints", "verify", run), cwd=REPO, env=clean_env(), capture_output=True,
                            text=True, timeout=hang_s(60))
    writer.go("checkpoint.snapshot_pruning")
    code = writer.finish()[0]
    assert (verify.returncode, verify.stderr) == (0, ""), verify.stdout
    assert verify.stdout.splitlines() == ["last: ok", "iter_2.pth: ok"]
    assert code == 0
    assert sorted(p.name for p in (run / "model").glob("iter_*")) == ["iter_3.pth", "iter_3.pth.json"]


def test_verify_of_last_after_a_crash_between_the_renames_names_last_prev(tmp_path: Path) -> None:
    """A rotation that a crash cut between its renames leaves `last.prev` and no `last` for good:
    `verify model/last` says so and names `last.prev` (exit 2), not "try again" forever."""
    import os

    from pimm_core.cli import main

    model = tmp_path / "run" / "model"
    _generation(model / "last.prev", 10)
    old = time.time() - 120
    os.utime(model, (old, old))  # (the crash was two minutes ago)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["checkpoints", "verify", str(model / "last")])
    assert code == 2
    assert "interrupted between its two renames" in err.getvalue() and "last.prev" in err.getvalue()
