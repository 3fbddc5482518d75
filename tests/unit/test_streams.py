"""Iterable (streaming) datasets in the Trainer, in process: a stream with
``state_dict``/``load_state_dict`` resumes mid-epoch bit for bit; one without replays the
interrupted epoch from its start and says so (log and provenance)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from pimm_core import Trainer, TrainConfig, load_config  # noqa: E402
from userpkg.nets import tied_bn  # noqa: E402
from userpkg.stream import digits_stream  # noqa: E402

TRAIN = ["train.epochs=2", "train.lr=0.01", "train.warmup_steps=2"]
SELECT = ["data.batch_size=16", "eval.metric=\"val/loss\"", "eval.mode=\"min\""]


def _trainer(run: Path, stateful: bool) -> Trainer:
    cfg = load_config(None, SELECT + TRAIN)
    torch.manual_seed(0)  # the same initial weights in every run
    return Trainer(cfg, run_dir=run, model=tied_bn(8), datasets=digits_stream(96, 40, stateful=stateful),
                   objective="classification")


def _stop_at(step: int):
    return lambda tr: tr.stop.request("test") if tr.state.global_step == step else None


def _weights(tr: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tr.model.state_dict().items()}


def test_stateful_stream_resumes_bitwise(tmp_path):
    full = _trainer(tmp_path / "full", stateful=True)
    assert full.train(checkpoint_dir=tmp_path / "full" / "model").global_step == 12
    cut = _trainer(tmp_path / "cut", stateful=True)
    cut.callbacks.append(_stop_at(4))  # mid-epoch 0 (6 steps per epoch)
    assert cut.train(checkpoint_dir=tmp_path / "cut" / "model").stop_reason is not None
    resumed = _trainer(tmp_path / "cut", stateful=True)
    state = resumed.train(checkpoint_dir=tmp_path / "cut" / "model",
                          resume_from=tmp_path / "cut" / "model")
    assert state.finished and state.global_step == 12
    a, b = _weights(full), _weights(resumed)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    start = json.loads((tmp_path / "cut" / "provenance.json").read_text())["starts"][-1]
    assert start["exact"] and start["data_resume"] == "exact" and "loader cursor" in start["restored"]


def test_stateless_stream_replays_its_epoch_and_says_so(tmp_path, caplog):
    cut = _trainer(tmp_path / "cut", stateful=False)
    cut.callbacks.append(_stop_at(4))
    with caplog.at_level(logging.WARNING, logger="pimm"):
        cut.train(checkpoint_dir=tmp_path / "cut" / "model")
    assert any("without state_dict/load_state_dict" in r.getMessage() for r in caplog.records)
    resumed = _trainer(tmp_path / "cut", stateful=False)
    state = resumed.train(checkpoint_dir=tmp_path / "cut" / "model",
                          resume_from=tmp_path / "cut" / "model")
    assert state.finished and state.global_step == 12  # epoch 0 replayed from step 0
    start = json.loads((tmp_path / "cut" / "provenance.json").read_text())["starts"][-1]
    assert start["data_resume"] == "replay_from_boundary" and start["policy"] == "no_loader_state"
    assert start["replay_boundary"] == {"epoch": 0, "step": 0, "from_iter": 4} and not start["exact"]


def test_stream_evaluates_every_val_sample_once(tmp_path):
    seen = []

    def objective(model, batch):
        x, y = batch
        if not model.training:
            seen.append(len(x))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        return loss, {"loss": loss.detach()}

    cfg = load_config(None, SELECT)
    tr = Trainer(cfg, model=tied_bn(8), datasets=digits_stream(32, 40), objective=objective)
    tr.train(TrainConfig(epochs=1, lr=0.01))
    assert sum(seen) == 40


def test_stream_without_len_is_a_config_error():
    from torch.utils.data import IterableDataset

    from pimm_core.errors import ConfigError

    class Endless(IterableDataset):
        def __iter__(self):
            while True:
                yield torch.zeros(64), torch.tensor(0)

    cfg = load_config(None, [])
    with pytest.raises(ConfigError, match="without __len__"):
        Trainer(cfg, model=tied_bn(8), datasets=(Endless(), Endless()))


def test_provenance_names_the_user_code_and_the_streams_fingerprint(tmp_path):
    import hashlib
    import subprocess

    _trainer(tmp_path / "run", stateful=True).train()
    prov = json.loads((tmp_path / "run" / "provenance.json").read_text())
    parts = ["digits-stream:96:0", "digits-stream:40:0"]  # the datasets' own fingerprints
    assert prov["data_fingerprint"] == hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                          text=True).stdout.strip()
    code = {c["module"]: c for c in prov["starts"][-1]["user_code"]}
    assert set(code) == {"userpkg.nets", "userpkg.stream"}  # pimm's own objective is not user code
    assert code["userpkg.nets"]["git_commit"] == head and isinstance(code["userpkg.nets"]["dirty"], bool)
