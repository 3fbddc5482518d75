"""Hostile checkpoint files run nothing, in every format and through every command (issue 13).

Each hostile file is a pickle whose ``__reduce__`` would run ``touch pwned-$RANK``, put in
place of a file pimm reads, with the manifest's (or sidecar's) size and sha256 updated so
checksum verification passes: the attack is a file someone wrote on purpose, not damage.

- Resume (``pimm launch --train.resume-from``) of a standard checkpoint whose
  ``trainer.dcp/.metadata``, a DCP shard's tensor record, its packed trainer state or
  ``weights.pth`` is hostile, also with 2 ranks; of a legacy ``model_last.pth`` and a single
  ``step_<N>.pth``: exit 2, one ``error:`` line naming the file, no marker, nothing trained.
- Warm start (``--train.weight``) from a standard ``last`` directory, ``model_best.pth``,
  ``iter_<N>.pth``, ``model_last.pth`` and ``step_<N>.pth``; ``pimm export`` of them: the same.
- ``pimm checkpoints verify/ls/diff`` and the console's reader on a run holding them: no marker.
- :func:`read_dcp_metadata` itself: refuses foreign globals, non-tensor items, paths out of
  the directory and garbage, with one line naming the file.

The 2-rank resume runs the console script in real processes (the launcher and both ranks);
the other cases run the same command in this process (``_helpers.pimm_here``), without a
subprocess importing torch: a pickle that ran would leave its marker either way.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from _helpers import DIGITS, describe, pimm, pimm_here
from conftest import SINGLE_OVERRIDES

# the session run's config with one more epoch: a resume that would train (a finished run is not loaded)
MORE = ("train.epochs=4", *SINGLE_OVERRIDES[1:])
from pimm_core.checkpoint.tensors.safe_read import read_dcp_metadata
from pimm_core.errors import CheckpointParseError

pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol")


class Evil:
    """Unpickling this runs a shell command that creates ``<marker>-<RANK>``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}-$RANK",))


def evil_pickle(marker: Path) -> bytes:
    """A plain pickle (what DCP's ``.metadata`` is) that runs code when loaded."""
    return pickle.dumps(Evil(marker))


def evil_torch(marker: Path, payload=None) -> bytes:
    """A ``torch.save`` zip file whose data pickle runs code when loaded (``weights_only=False``)."""
    buf = io.BytesIO()
    torch.save(payload if payload is not None else {"state_dict": {"w": Evil(marker)}}, buf)
    return buf.getvalue()


def _digest(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def rehash(manifest: Path, root: Path, *rels: str) -> None:
    """Make ``manifest`` vouch for the current bytes of ``rels`` (paths under ``root``)."""
    record = json.loads(manifest.read_text())
    for rel in rels:
        record["files"][rel] = _digest((root / rel).read_bytes())
    manifest.write_text(json.dumps(record, indent=2))


def plant(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``, updating its sidecar ``<name>.json`` when it has one."""
    path.write_bytes(data)
    sidecar = path.with_name(path.name + ".json")
    if sidecar.exists():
        rehash(sidecar, path.parent, path.name)


def plant_file_checkpoint(path: Path, data: bytes, fmt: str, step: int = 7) -> None:
    """A legacy/single file with a sidecar manifest vouching for ``data``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.with_name(path.name + ".json").write_text(json.dumps({
        "manifest_version": 1, "format": fmt, "step": step, "epoch": 0, "iter": step, "world_size": 1,
        "workers_per_rank": 0, "files": {path.name: _digest(data)}}))


def rewrite_dcp_item(dcp_dir: Path, fqn: str, record: bytes, numel: int | None = None) -> None:
    """Replace the stored record of DCP item ``fqn`` with ``record`` (shards and .metadata rewritten).

    ``numel``: the item's new size (a 1-D uint8 item such as ``meta``). The test reads its own
    checkpoint's ``.metadata`` with plain pickle: it wrote it.
    """
    md = pickle.loads((dcp_dir / ".metadata").read_bytes())
    shards: dict[str, bytearray] = {}
    for index, info in sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        with open(dcp_dir / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if index.fqn == fqn:
            data = record
        buf = shards.setdefault(info.relative_path, bytearray())
        info.offset, info.length = len(buf), len(data)
        buf += data
    for rel, buf in shards.items():
        (dcp_dir / rel).write_bytes(bytes(buf))
    if numel is not None:
        item = md.state_dict_metadata[fqn]
        item.size = torch.Size([numel])
        item.chunks[0].sizes = torch.Size([numel])
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(md))


def poison_standard(last: Path, where: str, marker: Path) -> Path:
    """Make one file of a standard checkpoint hostile, manifest updated; returns that file."""
    dcp_dir = last / "trainer.dcp"
    if where == "metadata":
        (dcp_dir / ".metadata").write_bytes(evil_pickle(marker))
        target = dcp_dir / ".metadata"
    elif where == "weights":
        (last / "weights.pth").write_bytes(evil_torch(marker))
        target = last / "weights.pth"
    elif where == "shard-record":  # a tensor record of a shard is a torch.save zip that runs code
        rewrite_dcp_item(dcp_dir, "meta", evil_torch(marker, Evil(marker)))
        target = dcp_dir / "__0_0.distcp"
    else:  # "packed-state": the uint8 tensor of packed trainer state holds such a zip
        evil = evil_torch(marker, {"trainer": Evil(marker)})
        record = io.BytesIO()
        torch.save(torch.frombuffer(bytearray(evil), dtype=torch.uint8), record)
        rewrite_dcp_item(dcp_dir, "meta", record.getvalue(), numel=len(evil))
        target = dcp_dir / "__0_0.distcp"
    rels = [p.relative_to(last).as_posix() for p in last.rglob("*") if p.is_file() and p.name != "manifest.json"]
    rehash(last / "manifest.json", last, *rels)
    return target


def launch(root: Path, name: str, *extra: str, overrides: tuple[str, ...] = ("train.epochs=1",), here: bool = True):
    """``pimm launch``; in this process unless ``here`` is false (see the module's docstring)."""
    return (pimm_here if here else pimm)("launch", "--train.config", DIGITS, "--run.root", root, "--run.name", name,
                                         "--run.no-timestamp", *extra, "--", *overrides, timeout=240)


def assert_refused(result, path: Path, marker: Path) -> str:
    """Exit 2, one ``error:`` line naming ``path``, no traceback, and nothing ran."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, describe(result)
    assert len(errors) == 1 and "Traceback" not in result.stderr + result.stdout, describe(result)
    assert str(path) in errors[0], errors[0]
    assert not list(marker.parent.glob(marker.name + "*")), "the hostile pickle ran"
    return errors[0]


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    """A private copy of the session's standard run (3 epochs, last at step 135, model_best, iter_*)."""
    return trained_run.copy_to(tmp_path)


# ------------------------------------------------------------------------ resume
@pytest.mark.parametrize("where", ["metadata", "weights", "shard-record", "packed-state"])
def test_resume_from_a_hostile_standard_checkpoint_runs_nothing(run_copy, tmp_path, where):
    marker = tmp_path / "pwned"
    last = run_copy / "model" / "last"
    target = poison_standard(last, where, marker)
    assert pimm("checkpoints", "verify", run_copy, timeout=60).returncode == 0  # checksums vouch for it
    metrics = (run_copy / "metrics.jsonl").read_bytes()
    result = launch(run_copy.parents[1], run_copy.name, "--train.resume-from", last, overrides=MORE)
    line = assert_refused(result, target, marker)
    if where in ("shard-record", "packed-state"):
        assert "weights_only" in line and "'meta'" in line, line
    else:
        assert "refusing to load" in line, line
    assert (run_copy / "metrics.jsonl").read_bytes() == metrics  # nothing trained


def test_two_ranks_resume_from_hostile_metadata_runs_nothing(run_copy, tmp_path):
    """Every rank reads ``.metadata`` (rank 0 only verifies checksums): none runs it."""
    marker = tmp_path / "pwned"
    last = run_copy / "model" / "last"
    target = poison_standard(last, "metadata", marker)
    result = launch(run_copy.parents[1], run_copy.name, "--train.resume-from", last, "--nproc-per-node", "2",
                    overrides=MORE, here=False)
    assert_refused(result, target, marker)


@pytest.mark.parametrize("name, fmt", [("model_last.pth", "legacy"), ("step_7.pth", "single")])
def test_resume_from_a_hostile_file_checkpoint_runs_nothing(tmp_path, name, fmt):
    marker = tmp_path / "pwned"
    path = tmp_path / "exp" / "digits" / "h" / "model" / name
    plant_file_checkpoint(path, evil_torch(marker, {"format": fmt, "weights": Evil(marker)}), fmt)
    result = launch(tmp_path / "exp", "h", "--train.resume-from", path)
    line = assert_refused(result, path, marker)
    assert "weights_only" in line, line
    assert not (path.parents[1] / "metrics.jsonl").exists()


# -------------------------------------------------------------- warm start, export
def _hostile_weight_sources(run: Path, tmp_path: Path, marker: Path) -> dict[str, tuple[Path, Path]]:
    """kind -> (the source to pass, the hostile file it reads)."""
    model = run / "model"
    out: dict[str, tuple[Path, Path]] = {}
    poison_standard(model / "last", "weights", marker)
    out["standard-last"] = (model / "last", model / "last" / "weights.pth")
    plant(model / "model_best.pth", evil_torch(marker))
    out["model_best"] = (model / "model_best.pth", model / "model_best.pth")
    it = sorted(model.glob("iter_*.pth"))[-1]
    plant(it, evil_torch(marker))
    out["iter"] = (it, it)
    for name, fmt in (("model_last.pth", "legacy"), ("step_7.pth", "single")):
        path = tmp_path / "files" / name
        plant_file_checkpoint(path, evil_torch(marker, {"format": fmt, "weights": {"raw": Evil(marker)}}), fmt)
        out[fmt] = (path, path)
    return out


KINDS = ["standard-last", "model_best", "iter", "legacy", "single"]


@pytest.mark.parametrize("kind", KINDS)
def test_warm_start_from_a_hostile_file_runs_nothing(run_copy, tmp_path, kind):
    marker = tmp_path / "pwned"
    source, target = _hostile_weight_sources(run_copy, tmp_path, marker)[kind]
    result = launch(tmp_path / "exp", "w", "--train.weight", source)
    line = assert_refused(result, target, marker)
    assert "weights_only" in line, line
    assert not (tmp_path / "exp" / "digits" / "w" / "metrics.jsonl").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_export_of_a_hostile_file_runs_nothing(run_copy, tmp_path, kind):
    marker = tmp_path / "pwned"
    source, target = _hostile_weight_sources(run_copy, tmp_path, marker)[kind]
    result = pimm_here("export", source, tmp_path / "out")
    line = assert_refused(result, target, marker)
    assert "weights_only" in line, line
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------ readers that only look
def test_checkpoint_commands_and_the_console_reader_run_nothing(run_copy, tmp_path):
    from pimm_core.watch.candidates import candidate_problems
    from pimm_core.watch.resume_diff import resume_diff
    from pimm_core.watch.snapshot import RunReader

    marker = tmp_path / "pwned"
    model = run_copy / "model"
    poison_standard(model / "last", "metadata", marker)
    plant(model / "model_best.pth", evil_torch(marker))
    for args in (("verify", run_copy), ("ls", run_copy), ("ls", run_copy, "--json"), ("diff", run_copy),
                 ("latest", model)):
        result = pimm("checkpoints", *args, timeout=60)
        assert result.returncode == 0 and "Traceback" not in result.stderr, describe(result)
    snap = RunReader(run_copy).poll(force_checkpoints=True)
    for cand in snap.candidates:
        assert candidate_problems(cand) == [], cand
    resume_diff(run_copy)
    assert not list(tmp_path.glob("pwned*"))


# ------------------------------------------------------------------ the DCP reader
@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory) -> Path:
    import torch.distributed.checkpoint as dcp

    out = tmp_path_factory.mktemp("dcp") / "trainer.dcp"
    dcp.save({"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.ones(2, 2)},
             storage_writer=dcp.FileSystemWriter(out), no_dist=True)
    return out


def test_real_dcp_metadata_reads(dcp_dir):
    md = read_dcp_metadata(dcp_dir / ".metadata")
    assert md.state_dict_metadata["a"].properties.dtype == torch.bfloat16
    assert tuple(md.state_dict_metadata["b"].size) == (2, 2)


def _tampered(dcp_dir: Path, tmp_path: Path, change) -> Path:
    md = pickle.loads((dcp_dir / ".metadata").read_bytes())
    change(md)
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(md))
    return path


def _bytes_item(md):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md.state_dict_metadata["a"] = BytesStorageMetadata()  # DCP would torch.load(weights_only=False) it


def _escape(md):
    next(iter(md.storage_data.values())).relative_path = "../../weights.pth"


def _foreign(md):
    md.planner_data = {"x": Evil(Path("/nonexistent/pwned"))}


@pytest.mark.parametrize("change, words", [(_bytes_item, "BytesStorageMetadata"), (_escape, "../../weights.pth"),
                                           (_foreign, "posix.system")])
def test_dcp_metadata_that_is_not_dcp_metadata_of_tensors_is_refused(dcp_dir, tmp_path, change, words):
    path = _tampered(dcp_dir, tmp_path, change)
    with pytest.raises(CheckpointParseError) as e:
        read_dcp_metadata(path)
    assert str(path) in str(e.value) and words in str(e.value) and "\n" not in str(e.value)
    assert e.value.exit_code == 2


@pytest.mark.parametrize("data", [b"", b"garbage", pickle.dumps([1, 2, 3]), pickle.dumps({"x": 1})[:-3]])
def test_dcp_metadata_garbage_is_one_line(tmp_path, data):
    path = tmp_path / ".metadata"
    path.write_bytes(data)
    with pytest.raises(CheckpointParseError, match="refusing to load") as e:
        read_dcp_metadata(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_no_pimm_code_unpickles_outside_the_safe_readers():
    """Every ``torch.load`` passes ``weights_only=True``; nothing calls ``pickle.load(s)``, ``pickle.Unpickler``
    or builds a DCP ``FileSystemReader`` but :mod:`~pimm_core.checkpoint.formats.mapped_reader`, whose
    ``read_metadata`` is the restricted one."""
    import ast

    import pimm_core

    root = Path(pimm_core.__file__).parent.parent
    offenders = []
    for py in sorted([*(root / "pimm_core").rglob("*.py"), *(root / "pimm_tui").rglob("*.py")]):
        for node in ast.walk(ast.parse(py.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            where = f"{py.relative_to(root)}:{node.lineno}: {name}"
            if name == "torch.load" and not any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                                                and k.value.value is True for k in node.keywords):
                offenders.append(where)
            elif name.split(".")[-1] in ("FileSystemReader", "Unpickler") or name in ("pickle.load", "pickle.loads"):
                offenders.append(where)
    assert not offenders, offenders
