"""Weight sets: resolving sources, reading every layout, key rules, warm start, strict load.

Checkpoints are written here with torch.save in the documented layouts (no trainer run).
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from pimm_core.checkpoint.export.model_dir import export_weights
from pimm_core.checkpoint.weights.key_rules import DEFAULT_KEY_RULES, apply_key_rules
from pimm_core.checkpoint.weights.sources import resolve_weight_source
from pimm_core.checkpoint.weights.strict_load import load_weights
from pimm_core.checkpoint.weights.warm_start import WarmStartReport, warm_start
from pimm_core.checkpoint.weights.read import read_weight_sets
from pimm_core.errors import CheckpointError, IncompleteCheckpointError, UsageError, WeightNotFoundError


class Net(nn.Module):
    """Linear body, BatchNorm (buffers incl. int64 num_batches_tracked), linear head."""

    def __init__(self, classes: int = 3, hidden: int = 8):
        super().__init__()
        self.body = nn.Linear(4, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.body(x))))


class CompileLike(nn.Module):
    """Holds the model as ``_orig_mod`` like torch.compile's OptimizedModule (same state_dict keys),
    without importing torch._dynamo (seconds of test time)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self._orig_mod = model


def make_net(seed: int, **kw) -> Net:
    torch.manual_seed(seed)
    net = Net(**kw)
    with torch.no_grad():
        net.norm.running_mean.uniform_()
        net.norm.num_batches_tracked.fill_(seed + 1)
    return net


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def standard_dir(root: Path, sd: dict, *, ema: dict | None = None, complete: bool = True) -> Path:
    """model/last in the standard layout (weights.pth, trainer.dcp/, manifest.json, .complete)."""
    d = root / "model" / "last"
    (d / "trainer.dcp").mkdir(parents=True)
    obj = {"state_dict": sd} if ema is None else {"state_dict": sd, "ema_state_dict": ema}
    torch.save(obj, d / "weights.pth")
    (d / "manifest.json").write_text('{"format": "standard", "step": 7}')
    if complete:
        (d / ".complete").write_text("")
    return d


# ----------------------------------------------------------------- layouts
def test_reads_every_layout(tmp_path: Path) -> None:
    raw, ema = make_net(0).state_dict(), make_net(1).state_dict()
    files = {
        "weights.pth": {"state_dict": raw, "ema_state_dict": ema},
        "model_last.pth": {"state_dict": raw, "ema_state_dict": ema, "optimizer": {"state": {}, "param_groups": []},
                           "epoch": 3, "global_step": 30},
        "ckpt_000030.pth": {"format": "single", "weights": {"raw": raw, "ema": ema}, "step": 30,
                            "rng": {"torch": torch.get_rng_state()}},
        "flat.pt": raw,
        "wrapped.pt": {"model": raw},
    }
    for name, obj in files.items():
        torch.save(obj, tmp_path / name)
        sets = read_weight_sets(tmp_path / name)
        assert_same(sets["raw"], raw)
        if name in ("weights.pth", "model_last.pth", "ckpt_000030.pth"):
            assert_same(sets["ema"], ema)
        else:
            assert set(sets) == {"raw"}


def test_reads_safetensors_and_bin(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    raw = make_net(0).state_dict()
    save_file({k: v.contiguous() for k, v in raw.items()}, tmp_path / "model.safetensors")
    torch.save(raw, tmp_path / "model.bin")
    assert_same(read_weight_sets(tmp_path / "model.safetensors")["raw"], raw)
    assert_same(read_weight_sets(tmp_path / "model.bin")["raw"], raw)
    # an export directory resolves to model.safetensors first
    assert resolve_weight_source(tmp_path) == (tmp_path / "model.safetensors").resolve()


@pytest.mark.parametrize("obj", [[1, 2, 3], {"epoch": 3, "lr": 0.1}, {"state_dict": {"w": "not a tensor"}}])
def test_rejects_non_state_dicts(tmp_path: Path, obj) -> None:
    torch.save(obj, tmp_path / "x.pth")
    with pytest.raises(CheckpointError, match="state dict"):
        read_weight_sets(tmp_path / "x.pth")


class Evil:
    """Unpickling this would run a shell command that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_malicious_pickle_is_rejected_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"state_dict": {"w": Evil(marker)}}, tmp_path / "evil.pth")
    with open(tmp_path / "evil.pkl", "wb") as f:
        pickle.dump(Evil(marker), f)
    for name in ("evil.pth", "evil.pkl"):
        with pytest.raises(CheckpointError, match=r"refusing to load .*weights_only=True"):
            read_weight_sets(tmp_path / name)
        with pytest.raises(CheckpointError, match="refusing"):
            warm_start(Net(), str(tmp_path / name))
        with pytest.raises(CheckpointError, match="refusing"):
            load_weights(Net(), tmp_path / name)
    assert not marker.exists()


# ---------------------------------------------------------------- resolving
def test_resolve_standard_dir_run_dir_and_keywords(tmp_path: Path) -> None:
    d = standard_dir(tmp_path, make_net(0).state_dict())
    (tmp_path / "config.toml").write_text("")
    torch.save({"state_dict": make_net(0).state_dict()}, tmp_path / "model" / "model_best.pth")
    torch.save({"state_dict": make_net(0).state_dict()}, tmp_path / "model" / "iter_20.pth")
    want = (d / "weights.pth").resolve()
    assert resolve_weight_source(str(d)) == want
    assert resolve_weight_source(str(tmp_path)) == want  # a run directory: what resume would pick
    assert resolve_weight_source(str(tmp_path / "model")) == want
    assert resolve_weight_source("last", run_dir=tmp_path) == want
    assert resolve_weight_source("best", run_dir=tmp_path) == (tmp_path / "model" / "model_best.pth").resolve()
    assert resolve_weight_source("iter_20", run_dir=tmp_path).name == "iter_20.pth"
    assert resolve_weight_source("model/last", run_dir=tmp_path) == want  # relative to the run
    with pytest.raises(WeightNotFoundError, match="has not finished"):
        resolve_weight_source("final", run_dir=tmp_path)
    (tmp_path / "status.json").write_text('{"state": "finished"}')
    assert resolve_weight_source("final", run_dir=tmp_path) == want
    with pytest.raises(UsageError, match="--run-dir"):
        resolve_weight_source("last")


def test_resolve_single_format_pointers(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    sd = make_net(0).state_dict()
    for step in (10, 20):
        torch.save({"format": "single", "weights": {"raw": sd}, "step": step}, model / f"ckpt_{step:06d}.pth")
    (model / "last").symlink_to("ckpt_000020.pth")
    (model / "best").symlink_to("ckpt_000010.pth")
    (model / "final").symlink_to("ckpt_000020.pth")
    assert resolve_weight_source("last", run_dir=tmp_path).name == "ckpt_000020.pth"
    assert resolve_weight_source("best", run_dir=tmp_path).name == "ckpt_000010.pth"
    assert resolve_weight_source(str(model / "final")).name == "ckpt_000020.pth"
    assert resolve_weight_source(str(tmp_path)).name == "ckpt_000020.pth"
    (model / "ckpt_000010.pth").unlink()
    with pytest.raises(WeightNotFoundError, match=r"^No weight found: .*best.* does not exist"):
        resolve_weight_source(str(model / "best"))


def test_resolve_legacy(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    torch.save({"state_dict": make_net(0).state_dict(), "optimizer": {}}, model / "model_last.pth")
    assert resolve_weight_source("last", run_dir=tmp_path).name == "model_last.pth"


def test_no_weight_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "weights.pth"
    with pytest.raises(WeightNotFoundError) as e:
        resolve_weight_source(str(missing))
    assert str(e.value).startswith("No weight found:") and str(missing) in str(e.value)
    assert e.value.exit_code == 2 and isinstance(e.value, CheckpointError)
    with pytest.raises(WeightNotFoundError, match="^No weight found:"):
        warm_start(Net(), str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightNotFoundError, match="^No weight found:"):
        resolve_weight_source(str(tmp_path / "empty"))
    with pytest.raises(UsageError, match="empty"):
        resolve_weight_source("")


def test_incomplete_standard_directory(tmp_path: Path) -> None:
    d = standard_dir(tmp_path, make_net(0).state_dict(), complete=False)
    with pytest.raises(IncompleteCheckpointError, match=r"^Incomplete checkpoint directory .*missing \.complete"):
        resolve_weight_source(str(d))
    (d / "weights.pth").unlink()
    (d / ".complete").write_text("")
    with pytest.raises(IncompleteCheckpointError, match=r"^Incomplete checkpoint directory .*missing weights\.pth"):
        resolve_weight_source(str(d))
    tmp = tmp_path / "model" / "last.tmp"
    tmp.mkdir()
    torch.save({"state_dict": make_net(0).state_dict()}, tmp / "weights.pth")
    with pytest.raises(IncompleteCheckpointError, match="temporary leftover"):
        resolve_weight_source(str(tmp))


# ------------------------------------------------------------------ key rules
def test_apply_key_rules() -> None:
    sd = {"module.a": 1, "_orig_mod.b": 2, "module._orig_mod.c": 3, "_orig_mod.module.d": 4, "enc._orig_mod.e": 5}
    assert apply_key_rules(sd) == {"a": 1, "b": 2, "c": 3, "d": 4, "enc.e": 5}
    assert apply_key_rules(sd, []) == sd
    # ordered: the second rule sees the first one's output
    assert apply_key_rules({"backbone.x": 1}, [(r"^backbone\.", "encoder."), (r"^encoder\.x$", "encoder.y")]) == \
        {"encoder.y": 1}
    with pytest.raises(CheckpointError, match="map both"):
        apply_key_rules({"module.a": 1, "a": 2})
    with pytest.raises(UsageError, match="invalid"):
        apply_key_rules({"a": 1}, [("(", "")])


# ----------------------------------------------------------------- warm start
def test_warm_start_from_ddp_and_compile_prefixes(tmp_path: Path, caplog) -> None:
    src = make_net(0)
    compiled = CompileLike(src)
    prefixed = {
        "ddp.pth": {"state_dict": {f"module.{k}": v for k, v in src.state_dict().items()}},
        "compiled.pth": {"state_dict": compiled.state_dict()},
        "ddp_compiled.pth": {"state_dict": {f"module.{k}": v for k, v in compiled.state_dict().items()}},
    }
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    for name, obj in prefixed.items():
        torch.save(obj, tmp_path / name)
        dst = make_net(5)
        with caplog.at_level(logging.INFO, logger="pimm"):
            report = warm_start(dst, str(tmp_path / name))
        assert isinstance(report, WarmStartReport)
        assert_same(dst.state_dict(), src.state_dict())
        assert len(report.loaded) == len(src.state_dict()) and report.renamed == len(src.state_dict())
        assert not report.missing and not report.unexpected and not report.mismatched
    text = caplog.text
    assert "key rules: '^module\\\\.' -> ''" in text
    assert "optimizer, schedule, step, RNG and loader cursor are not restored" in text


def test_warm_start_downstream_head_mismatch(tmp_path: Path) -> None:
    src = make_net(0, classes=10)
    sd = dict(src.state_dict(), **{"aux.weight": torch.ones(2)})
    torch.save({"state_dict": sd}, tmp_path / "weights.pth")
    dst = make_net(7, classes=5)
    head_before = dst.head.weight.detach().clone()
    logs: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record):
            logs.append(record.getMessage())

    logger = logging.getLogger("test.warm")
    logger.setLevel(logging.INFO)
    logger.addHandler(Capture())
    report = warm_start(dst, str(tmp_path / "weights.pth"), logger=logger)
    assert [k for k, _, _ in report.mismatched] == ["head.bias", "head.weight"]
    assert report.mismatched[1] == ("head.weight", (10, 8), (5, 8))
    assert report.unexpected == ["aux.weight"] and report.missing == []
    assert report.loaded_params == 4 and report.model_params == 6  # body.*, norm.weight/bias
    assert torch.equal(dst.head.weight, head_before)
    assert torch.equal(dst.body.weight, src.body.weight) and torch.equal(dst.norm.running_mean, src.norm.running_mean)
    joined = "\n".join(logs)
    assert "shape-mismatched 2: head.bias [10] in checkpoint vs [5] in model" in joined
    assert "unexpected 1: aux.weight" in joined and "missing 0" in joined
    assert report.to_json()["mismatched"] == 2


def test_warm_start_names_at_most_five() -> None:
    r = WarmStartReport("s", "f", "raw", DEFAULT_KEY_RULES, missing=[f"k{i}" for i in range(8)])
    line = next(ln for ln in r.lines() if "missing" in ln)
    assert line.endswith("missing 8: k0, k1, k2, k3, k4 (+3 more)")


def test_warm_start_zero_match_raises(tmp_path: Path) -> None:
    torch.save({"state_dict": {"encoder.w": torch.zeros(3)}}, tmp_path / "w.pth")
    dst = make_net(3)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(CheckpointError, match="no parameters matched") as e:
        warm_start(dst, str(tmp_path / "w.pth"))
    assert e.value.exit_code == 2
    assert_same(dst.state_dict(), before)
    # buffers alone are not enough: 0 parameters selected
    buffers = {k: v for k, v in make_net(0).state_dict().items() if k.startswith("norm.running")}
    torch.save(buffers, tmp_path / "buffers.pth")
    with pytest.raises(CheckpointError, match="no parameters matched"):
        warm_start(dst, str(tmp_path / "buffers.pth"))


def test_warm_start_custom_rules(tmp_path: Path) -> None:
    src = make_net(0)
    torch.save({f"backbone.{k}": v for k, v in src.state_dict().items()}, tmp_path / "w.pt")
    dst = make_net(1)
    report = warm_start(dst, str(tmp_path / "w.pt"), rules=[(r"^backbone\.", "")])
    assert report.rules == [(r"^backbone\.", "")]
    assert_same(dst.state_dict(), src.state_dict())


def test_ema_weight_set(tmp_path: Path) -> None:
    raw, ema = make_net(0), make_net(1)
    ema_params = {k: v for k, v in ema.state_dict().items() if not k.startswith("norm.running")
                  and k != "norm.num_batches_tracked"}
    d = standard_dir(tmp_path, raw.state_dict(), ema=ema_params)
    dst = make_net(2)
    warm_start(dst, str(d), weight_set="ema")
    assert torch.equal(dst.body.weight, ema.body.weight)
    assert torch.equal(dst.norm.running_mean, raw.norm.running_mean)  # raw buffers at checkpoint time
    load_weights(dst, d, weights="raw")
    assert torch.equal(dst.body.weight, raw.body.weight)
    torch.save({"state_dict": raw.state_dict()}, tmp_path / "plain.pth")
    with pytest.raises(CheckpointError, match="has no ema weights"):
        warm_start(make_net(0), str(tmp_path / "plain.pth"), weight_set="ema")
    with pytest.raises(CheckpointError, match="has no ema weights"):
        load_weights(make_net(0), tmp_path / "plain.pth", weights="ema")
    with pytest.raises(UsageError, match="not a weight set"):
        load_weights(make_net(0), tmp_path / "plain.pth", weights="swa")


def test_hf_source_through_local_fake(tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    repo = tmp_path / "hub" / "org" / "repo"
    (repo / "sub").mkdir(parents=True)
    src = make_net(0)
    torch.save({"state_dict": src.state_dict()}, repo / "weights.pth")
    torch.save({"state_dict": src.state_dict()}, repo / "sub" / "w.pth")
    calls: list[tuple[str, str, str | None]] = []

    def fake_download(repo_id: str, filename: str, *, revision: str | None = None, **_kw) -> str:
        calls.append((repo_id, filename, revision))
        path = tmp_path / "hub" / repo_id / filename
        if not path.is_file():
            raise EntryNotFoundError(f"{filename} not in {repo_id}")
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    from pimm_core.checkpoint.weights import hub

    monkeypatch.setattr(hub, "hub_unreachable", lambda: None)  # the fake Hub answers
    assert resolve_weight_source("hf://org/repo") == (repo / "weights.pth").resolve()
    assert [c[1] for c in calls] == ["model.safetensors", "model.bin", "weights.pth"]
    assert resolve_weight_source("hf://org/repo@v1/sub/w.pth") == (repo / "sub" / "w.pth").resolve()
    assert calls[-1] == ("org/repo", "sub/w.pth", "v1")
    dst = make_net(4)
    report = warm_start(dst, "hf://org/repo")
    assert report.source == "hf://org/repo" and len(report.loaded) == 9
    assert_same(dst.state_dict(), src.state_dict())
    with pytest.raises(WeightNotFoundError, match=r"^No weight found: hf://org/other: the repository has none of"):
        resolve_weight_source("hf://org/other")
    with pytest.raises(UsageError, match="not a Hub source"):
        resolve_weight_source("hf://justorg")


# ---------------------------------------------------------------- strict load
def test_load_weights_strict_and_unwrapped(tmp_path: Path) -> None:
    src = make_net(0)
    torch.save({"state_dict": {f"module.{k}": v for k, v in src.state_dict().items()}}, tmp_path / "w.pth")
    dst = make_net(1)
    load_weights(dst, tmp_path / "w.pth")
    assert_same(dst.state_dict(), src.state_dict())
    with pytest.raises(CheckpointError, match=r"does not match the model architecture: .*head.weight \[3, 8\] "
                                              r"in checkpoint vs \[5, 8\] in model"):
        load_weights(make_net(1, classes=5), tmp_path / "w.pth")
    with pytest.raises(UsageError, match="uncompiled"):
        load_weights(CompileLike(make_net(1)), tmp_path / "w.pth")
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    nn.Module.__init__(ddp)
    ddp.module = make_net(1)
    with pytest.raises(UsageError, match="unwrapped"):
        load_weights(ddp, tmp_path / "w.pth")
    # warm start looks through wrappers instead
    warm_start(ddp, str(tmp_path / "w.pth"))
    assert_same(ddp.module.state_dict(), src.state_dict())


def test_export_weights_files(tmp_path: Path) -> None:
    src = make_net(0)
    torch.save({"format": "single", "weights": {"raw": src.state_dict(), "ema": make_net(9).state_dict()}},
               tmp_path / "ckpt.pth")
    export_weights(tmp_path / "ckpt.pth", tmp_path / "out" / "raw.safetensors")
    export_weights(tmp_path / "ckpt.pth", tmp_path / "out" / "ema.pth", weights="ema")
    assert_same(read_weight_sets(tmp_path / "out" / "raw.safetensors")["raw"], src.state_dict())
    plain = torch.load(tmp_path / "out" / "ema.pth", weights_only=True)  # an ordinary state dict
    assert_same(plain, make_net(9).state_dict())
    export_weights(tmp_path / "ckpt.pth", tmp_path / "outdir")
    assert (tmp_path / "outdir" / "model.safetensors").is_file()
    assert not list(tmp_path.glob("out/.*tmp"))


def test_unwrap_follows_wrappers_only() -> None:
    """One unwrap rule (checkpoint.state.unwrap): ``.module`` only on a data-parallel wrapper,
    ``._orig_mod`` on a torch.compile wrapper; a model's own submodule named ``module`` stays."""
    from pimm_core.checkpoint.tensors.state import unwrap

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.head = nn.Linear(2, 1)

    class DistributedDataParallel(nn.Module):  # matched by name, as FSDP is
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner

    class Compiled(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self._orig_mod = inner

    plain = Holder()
    assert unwrap(plain) is plain
    assert unwrap(Compiled(DistributedDataParallel(plain))) is plain
    assert unwrap(nn.DataParallel(plain)) is plain
