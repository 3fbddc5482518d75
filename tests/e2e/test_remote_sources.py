"""Remote weight sources and exports (``--train.weight s3://...``, ``pimm export`` to and from
``s3://``) against a real S3 server (moto on 127.0.0.1): every check a local source gets, refusals
of incomplete remote candidates, one-line errors for a missing key, an unreachable store and
missing credentials, and exports loaded back with safetensors."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _helpers import DIGITS, REPO, free_port, launch, read_json
from _s3 import BUCKET, pimm_here_s3, start_s3

SRC = "src"  # the shared run, uploaded to the remote: last at step 45, iter_20/iter_40, model_best.pth
RUN = ("train.epochs=1", "checkpoint.every_steps=20", "checkpoint.keep_iter=2")
# a warm-started run that cannot change the weights it loaded (lr 0, no batch norm): its `last`
# holds exactly what the warm start read
FROZEN = ("train.lr=0", "train.min_lr=0", "train.max_steps=2", "eval.every_epochs=0")


@pytest.fixture(scope="module")
def s3():
    server = start_s3()
    yield server
    server.server.stop()


@pytest.fixture(scope="module")
def src(s3, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("remote-src")
    r = launch(root, SRC, *RUN, f"checkpoint.remote={s3.url}", "checkpoint.remote_timeout=120", env=s3.env())
    assert r.returncode == 0, r.stdout + r.stderr
    return root / "digits" / SRC


def url(*parts: str) -> str:
    return "/".join([f"s3://{BUCKET}/exp/digits/{SRC}/model", *parts])


def env_with_tmp(s3, tmp: Path, **extra: str) -> dict[str, str]:
    """The S3 environment with TMPDIR of the test's own: the downloads' temporary directories land there."""
    tmp.mkdir(exist_ok=True)
    return {**s3.env(), "TMPDIR": str(tmp), **extra}


def pimm_temps(tmp: Path) -> list[str]:
    """pimm's temporary directories left in ``tmp`` (torch keeps its own compile cache there)."""
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("pimm-"))


def pimm(*args: str, env: dict[str, str], here: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``pimm ARGS`` with the environment ``env``: in this process by default (``pimm_here``: no
    ~3-20 s of ``import torch`` per call, and most calls here are refusals or 2-step warm starts);
    ``here=False`` in a real subprocess, kept for the console-script wiring, fail points and torchrun."""
    if not here:
        return subprocess.run([sys.executable, "-m", "pimm_core.cli", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout)
    return pimm_here_s3(*args, env=env)


def warm_launch(root: Path, name: str, weight: str, env: dict[str, str], *extra: str, here: bool = True):
    return pimm("launch", "--train.config", str(DIGITS), "--run.root", str(root), "--run.name", name,
                "--run.no-timestamp", "--train.weight", weight, *extra, "--", *FROZEN, env=env, here=here)


def state_dict(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def one_error_line(r: subprocess.CompletedProcess[str]) -> str:
    """The failed command's one ``error:`` line (nothing else on stderr, no traceback)."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def test_warm_start_from_a_remote_step_checkpoint_loads_its_weights_and_cleans_up(tmp_path, s3, src):
    tmp = tmp_path / "tmp"
    env = env_with_tmp(s3, tmp)
    dry = warm_launch(tmp_path, "dry", url("step_45"), env, "--dry-run", here=False)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "standard checkpoint step_45 (step 45)" in dry.stdout and "checked against manifest.json" in dry.stdout
    assert not (tmp_path / "digits" / "dry").exists() and pimm_temps(tmp) == []  # nothing downloaded

    # the warm start itself in this process (its console-script path is the 2-rank launch's below)
    r = warm_launch(tmp_path, "w", url("step_45"), env)
    assert r.returncode == 0, r.stdout + r.stderr
    run = tmp_path / "digits" / "w"
    start = read_json(run / "provenance.json")["starts"][0]
    ws = start["warm_start"]
    assert ws["source"] == url("step_45") and ws["resolved"] == url("step_45", "weights.pth"), ws
    assert ws["loaded_params"] == ws["model_params"] > 0 and ws["missing"] == 0
    # lr 0: the run's weights are exactly those of the remote checkpoint
    assert_same(state_dict(run / "model" / "last" / "weights.pth"), state_dict(src / "model" / "last" / "weights.pth"))
    assert pimm_temps(tmp) == []  # the download's temporary directory is gone


@pytest.mark.parametrize("name", ["model_best.pth", "iter_40.pth"])
def test_warm_start_from_a_remote_weights_file_checked_against_its_sidecar(tmp_path, s3, src, name):
    tmp = tmp_path / "tmp"
    r = warm_launch(tmp_path, "w", url(name), env_with_tmp(s3, tmp))
    assert r.returncode == 0, r.stdout + r.stderr
    assert_same(state_dict(tmp_path / "digits" / "w" / "model" / "last" / "weights.pth"),
                state_dict(src / "model" / name))
    assert pimm_temps(tmp) == []


def test_warm_start_api_from_a_plain_remote_safetensors_file(tmp_path, s3, src, monkeypatch):
    from safetensors.torch import save_file

    from _s3 import aws_env
    from pimm_core.checkpoint.weights.warm_start import warm_start
    from pimm_core.models import MLP

    sd = state_dict(src / "model" / "last" / "weights.pth")
    save_file(sd, str(tmp_path / "plain.safetensors"))
    s3.fs.put_file(str(tmp_path / "plain.safetensors"), f"{BUCKET}/plain/model.safetensors")
    for k, v in aws_env(s3.endpoint).items():
        monkeypatch.setenv(k, v)
    model = MLP(64, 10, hidden=128, dropout=0.1)
    for source in (f"s3://{BUCKET}/plain/model.safetensors", f"s3://{BUCKET}/plain"):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        report = warm_start(model, source)
        assert report.resolved == f"s3://{BUCKET}/plain/model.safetensors"
        assert_same(model.state_dict(), sd)


def test_remote_candidates_without_their_marker_are_refused_in_one_line(tmp_path, s3, src):
    prefix = f"{BUCKET}/exp/digits/{SRC}/model"
    s3.fs.copy(f"{prefix}/step_45", f"{prefix}/step_99", recursive=True)
    s3.fs.rm_file(f"{prefix}/step_99/.complete")  # an upload cut short before its marker
    s3.fs.copy(f"{prefix}/iter_40.pth", f"{prefix}/iter_99.pth")  # no sidecar
    try:
        env = env_with_tmp(s3, tmp_path / "tmp")
        for source, what in ((url("step_99"), "missing .complete"), (url("step_99", "weights.pth"), ".complete"),
                             (url("iter_99.pth"), "sidecar iter_99.pth.json")):
            for dry in ((), ("--dry-run",)) if source == url("step_99") else ((),):
                r = warm_launch(tmp_path, "w", source, env, *dry)
                assert r.returncode == 2, r.stdout + r.stderr
                line = one_error_line(r)
                assert "Incomplete remote checkpoint" in line and what in line, line
                assert not (tmp_path / "digits" / "w").exists()
        r = pimm("export", url("step_99"), str(tmp_path / "out"), env=env)
        assert r.returncode == 2 and "Incomplete remote checkpoint" in one_error_line(r)
        assert not (tmp_path / "out").exists()
        # the run's model/ prefix: the newest *complete* step, not step_99
        r = warm_launch(tmp_path, "p", url(), env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert read_json(tmp_path / "digits" / "p" / "provenance.json")["starts"][0]["warm_start"]["resolved"] == \
            url("step_45", "weights.pth")
    finally:
        s3.fs.rm(f"{prefix}/step_99", recursive=True)
        s3.fs.rm_file(f"{prefix}/iter_99.pth")



def test_store_errors_are_one_line(tmp_path, s3, src):
    env = env_with_tmp(s3, tmp_path / "tmp")
    s3.fs.pipe_file(f"{BUCKET}/notes.pth", b"these are my notes, not weights\n")
    cases = [
        (env, url("step_7"), 2, "No weight found"),  # no such key
        (env, f"s3://{BUCKET}/notes.pth", 2, "is not a PyTorch checkpoint"),
        ({**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}, url("step_45"), 1, "cannot"),
        ({k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
         | {"AWS_EC2_METADATA_DISABLED": "true"}, url("step_45"), 1, "credentials"),
        (env, "nosuchscheme://bucket/x", 2, "nosuchscheme"),
    ]
    for e, source, code, text in cases:
        r = warm_launch(tmp_path, "w", source, e)
        assert r.returncode == code, (source, r.stdout + r.stderr)
        line = one_error_line(r)
        assert text in line and source in line, line
        assert not (tmp_path / "digits" / "w").exists()
        if code == 1 or "No weight" in text:  # the same checks as a warm start's; three of them here
            r = pimm("export", source, str(tmp_path / "out"), env=e)
            assert r.returncode == code, (source, r.stdout + r.stderr)
            assert text in one_error_line(r)
            assert not (tmp_path / "out").exists()
    # exporting to an unreachable store fails before anything is read
    bad = {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    r = pimm("export", "--run-dir", str(src), "last", f"s3://{BUCKET}/out-x", env=bad, here=False)
    assert r.returncode == 1 and "cannot" in one_error_line(r)
    assert pimm_temps(tmp_path / "tmp") == []


def remote_weights(s3, prefix: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(s3.fs.cat_file(f"{BUCKET}/{prefix}/model.safetensors"))


def test_export_to_a_remote_prefix_is_complete_only_with_export_json_and_force_replaces_only_exports(
        tmp_path, s3, src):
    env = env_with_tmp(s3, tmp_path / "tmp")
    out = f"s3://{BUCKET}/exports/a"
    r = pimm("export", "--run-dir", str(src), "last", out, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert out in r.stdout
    assert s3.ls("exports/a") == ["config.json", "export.json", "model.safetensors"]
    assert_same(remote_weights(s3, "exports/a"), state_dict(src / "model" / "last" / "weights.pth"))
    rec = json.loads(s3.fs.cat_file(f"{BUCKET}/exports/a/export.json"))
    assert rec["step"] == 45 and rec["files"]["model.safetensors"]["size"] == s3.fs.size(
        f"{BUCKET}/exports/a/model.safetensors")
    assert pimm_temps(tmp_path / "tmp") == []

    r = pimm("export", "--run-dir", str(src), "best", out, env=env)  # not empty, no --force
    assert r.returncode == 2 and "--force" in one_error_line(r)
    r = pimm("export", "--run-dir", str(src), "best", out, "--force", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_same(remote_weights(s3, "exports/a"), state_dict(src / "model" / "model_best.pth"))
    # --force never replaces what is not a previous export: here the run's own checkpoints
    r = pimm("export", "--run-dir", str(src), "last", url(), "--force", env=env)
    assert r.returncode == 2 and "is not one" in one_error_line(r)

    # killed once every file of a --force replacement is uploaded, before its export.json: the
    # previous export's export.json went first, so what is there is an incomplete export, never a mix
    r = pimm("export", "--run-dir", str(src), "last", out, "--force",
             env={**env, "PIMM_FAILPOINT": "remote.export_files=kill"}, here=False)
    assert r.returncode == -9, r.stdout + r.stderr
    assert s3.ls("exports/a") == ["config.json", "model.safetensors"]
    r = warm_launch(tmp_path, "w", out, env)
    assert r.returncode == 2 and "Incomplete export" in one_error_line(r)
    assert not (tmp_path / "digits" / "w").exists()
    r = pimm("export", "--run-dir", str(src), "last", out, "--force", env=env)  # not taken for an export
    assert r.returncode == 2 and "no export.json" in one_error_line(r)
    assert s3.ls("exports/a") == ["config.json", "model.safetensors"]  # untouched


def test_export_from_a_remote_checkpoint_to_local_and_to_remote(tmp_path, s3, src):
    env = env_with_tmp(s3, tmp_path / "tmp")
    want = state_dict(src / "model" / "last" / "weights.pth")
    local = tmp_path / "out"
    r = pimm("export", url("step_45"), str(local), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    from safetensors.torch import load_file

    assert_same(load_file(str(local / "model.safetensors")), want)
    rec = read_json(local / "export.json")
    assert rec["source"] == url("step_45", "weights.pth") and rec["step"] == 45

    r = pimm("export", url("model_best.pth"), f"s3://{BUCKET}/exports/b", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_same(remote_weights(s3, "exports/b"), state_dict(src / "model" / "model_best.pth"))
    # a remote export is itself a weight source: checked against its export.json
    r = warm_launch(tmp_path, "w", f"s3://{BUCKET}/exports/b", env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_same(state_dict(tmp_path / "digits" / "w" / "model" / "last" / "weights.pth"),
                state_dict(src / "model" / "model_best.pth"))
    assert pimm_temps(tmp_path / "tmp") == []


class _Requests(logging.Handler):
    """The S3 server's request lines (moto runs on werkzeug, which logs each request)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_two_ranks_warm_start_from_one_download_per_node(tmp_path, s3, src):
    requests = _Requests()
    logging.getLogger("werkzeug").addHandler(requests)
    try:
        r = warm_launch(tmp_path, "w", url("step_45"), env_with_tmp(s3, tmp_path / "tmp"), "--nproc-per-node", "2",
                        here=False)
    finally:
        logging.getLogger("werkzeug").removeHandler(requests)
    assert r.returncode == 0, r.stdout + r.stderr
    run = tmp_path / "digits" / "w"
    assert read_json(run / "provenance.json")["starts"][0]["warm_start"]["resolved"] == url("step_45", "weights.pth")
    assert_same(state_dict(run / "model" / "last" / "weights.pth"), state_dict(src / "model" / "last" / "weights.pth"))
    # one whole download (200) for the node's two ranks; the launch's checks read only the file's
    # first bytes (206, a ranged read: the launcher's and each rank's)
    gets = [line for line in requests.lines if f"GET /{BUCKET}/exp/digits/{SRC}/model/step_45/weights.pth" in line]
    whole = [line for line in gets if '" 200 ' in line]
    assert len(whole) == 1 and all('" 206 ' in line for line in gets if line not in whole), gets
    assert pimm_temps(tmp_path / "tmp") == []


def test_temporary_directories_of_killed_downloads_and_exports_are_removed_by_the_next_command(tmp_path, s3, src):
    import tempfile

    from pimm_core.checkpoint.records.scratch import make_owned_dir, release

    tmp = tmp_path / "tmp"
    env = env_with_tmp(s3, tmp)
    # SIGKILL mid-download: after the first file of the warm start's source is on disk
    r = warm_launch(tmp_path, "w", url("step_45"), {**env, "PIMM_FAILPOINT": "remote.file_downloaded=kill"},
                    here=False)
    assert r.returncode == -9, r.stdout + r.stderr
    left = [p for p in tmp.iterdir() if p.name.startswith("pimm-remote-") and p.is_dir()]
    assert len(left) == 1 and (left[0] / "step_45" / "weights.pth").is_file(), pimm_temps(tmp)  # cut short there
    # the next command that writes there (a remote export, itself killed after its files were
    # uploaded, before its export.json) removes it first; its own directory is left
    r = pimm("export", "--run-dir", str(src), "last", f"s3://{BUCKET}/exports/killed",
             env={**env, "PIMM_FAILPOINT": "remote.export_files=kill"}, here=False)
    assert r.returncode == -9, r.stdout + r.stderr
    stale = pimm_temps(tmp)
    assert len(stale) == 2 and all(n.startswith("pimm-export-") for n in stale), stale  # directory, owner file

    saved, tempfile.tempdir = tempfile.tempdir, str(tmp)
    try:
        live, lock = make_owned_dir("pimm-remote-")  # a live process's download (this process's)
    finally:
        tempfile.tempdir = saved
    try:
        # a download removes what the dead export left, and not what a live process holds
        r = pimm("export", url("step_45"), str(tmp_path / "out"), env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert pimm_temps(tmp) == [live.name, f"{live.name}.lock"]
    finally:
        release(live, lock)
    assert pimm_temps(tmp) == []
