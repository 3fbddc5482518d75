"""The Checkpointer and Recorder parts without a Trainer: the save schedule's decisions, the
trainer state a checkpoint holds, the format a config picks, the save-failure policy, and
the run-directory files the Recorder writes. Fast, no subprocess, no training."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from pimm_core.checkpoint.formats import files
from pimm_core.checkpoint.formats.async_save import AsyncStandardFormat
from pimm_core.checkpoint.formats.files import LegacyFormat, SingleFormat
from pimm_core.checkpoint.formats.choose import make_format
from pimm_core.checkpoint.formats.protocol import meta_problem
from pimm_core.checkpoint.formats.standard import StandardFormat
from pimm_core.config import CheckpointConfig, Config, TrainConfig
from pimm_core.process.dist import DistInfo
from pimm_core.train.ema import EMA
from pimm_core.errors import CheckpointSaveError, ConfigError
from pimm_core.run import read_json, read_metrics
from pimm_core.train.schedule import WarmupCosine
from pimm_core.process.stop import StopRequest
from pimm_core.train.checkpointer import Checkpointer, Save, SaveSchedule
from pimm_core.train.recorder import Recorder
from pimm_core.train.state import TrainState, end_step


# ------------------------------------------------------------------ the save schedule (pure)
def run_schedule(schedule: SaveSchedule, *, epochs: int, steps_per_epoch: int, stop_at: int | None = None):
    """Announce every moment of a run (one micro-batch per step) as the trainer does; the saves asked for."""
    saves, step = [], 0
    for epoch in range(epochs):
        for i in range(1, steps_per_epoch + 1):
            step += 1
            if step == stop_at:
                return saves + [("end", step, schedule.at_end(step, finished=False, mid_epoch=i < steps_per_epoch))]
            save = schedule.after_step(step, mid_epoch=i < steps_per_epoch, run_ends=step == epochs * steps_per_epoch)
            if save:
                saves.append(("step", step, save))
        save = schedule.after_epoch(step, epoch, run_ends=epoch + 1 == epochs)
        if save:
            saves.append(("epoch", step, save))
    return saves + [("end", step, schedule.at_end(step, finished=True, mid_epoch=False))]


def test_schedule_of_a_whole_run_saves_by_step_and_epoch_never_twice_at_the_end():
    saves = run_schedule(SaveSchedule(every_steps=4, every_epochs=1, keep_iter=2), epochs=3, steps_per_epoch=5)
    assert [(moment, step) for moment, step, _ in saves] == [
        ("step", 4), ("epoch", 5), ("step", 8), ("epoch", 10), ("step", 12), ("end", 15)]
    by_step = {step: save for _, step, save in saves}
    assert by_step[4] == Save(mid_epoch=True, snapshot=True)  # a step save keeps an iter_<step>.pth
    assert by_step[5] == Save(mid_epoch=False, snapshot=False)  # an epoch save does not
    assert by_step[15] == Save(mid_epoch=False, snapshot=False, background=False, pointers=("last", "final"))


def test_a_step_save_at_an_epoch_end_is_the_epoch_save_and_the_last_step_is_the_final_save():
    saves = run_schedule(SaveSchedule(every_steps=5, every_epochs=0, keep_iter=1), epochs=2, steps_per_epoch=5)
    assert [(moment, step, save.snapshot) for moment, step, save in saves] == [
        ("epoch", 5, True), ("end", 10, True)]  # step 10 ends the run: no periodic save before the final one


def test_train_max_steps_ending_mid_epoch_leaves_the_save_to_the_final_one():
    s = SaveSchedule(every_steps=4, keep_iter=1)
    assert s.after_step(8, mid_epoch=True, run_ends=False) == Save(mid_epoch=True, snapshot=True)
    assert s.after_step(8, mid_epoch=True, run_ends=True) is None
    assert s.at_end(8, finished=True, mid_epoch=True) == Save(mid_epoch=True, snapshot=True, background=False,
                                                               pointers=("last", "final"))


def test_schedule_without_periodic_saves_saves_only_at_the_end():
    saves = run_schedule(SaveSchedule(every_steps=0, every_epochs=0, keep_iter=3), epochs=2, steps_per_epoch=4)
    assert [(moment, step) for moment, step, _ in saves] == [("end", 8)]


def test_a_stopped_session_saves_last_only_and_mid_epoch():
    saves = run_schedule(SaveSchedule(every_steps=4, keep_iter=2), epochs=3, steps_per_epoch=5, stop_at=8)
    assert saves[-1] == ("end", 8, Save(mid_epoch=True, snapshot=False, background=False, pointers=("last",)))


@pytest.mark.parametrize("every_epochs,saved_epochs", [(1, [0, 1, 2, 3]), (2, [1, 3]), (3, [2])])
def test_epoch_saves_every_n_epochs(every_epochs, saved_epochs):
    s = SaveSchedule(every_epochs=every_epochs)
    assert [e for e in range(5) if s.after_epoch(e * 7 + 7, e, run_ends=e == 4)] == saved_epochs


# ------------------------------------------------------------------ format choice
def test_the_config_picks_the_format():
    info = DistInfo()
    assert type(make_format("standard", info)) is StandardFormat
    wrapped = make_format("standard", info, background=True)
    assert isinstance(wrapped, AsyncStandardFormat) and type(wrapped.inner) is StandardFormat
    assert (wrapped.name, wrapped.asynchronous) == ("standard", True)
    assert type(make_format("legacy", info, background=True)) is LegacyFormat
    single = make_format("single", info, keep_last=4)
    assert isinstance(single, SingleFormat) and single.keep_last == 4 and not single.asynchronous
    with pytest.raises(ConfigError, match="unknown checkpoint format 'zip'"):
        make_format("zip", info)


# ------------------------------------------------------------------ the Checkpointer
class FakeLoader:
    """What the Checkpointer asks of the training loader: its length and its cursor."""

    def __init__(self, micro_batches: int):
        self.micro_batches = micro_batches

    def __len__(self) -> int:
        return self.micro_batches

    def state_dict(self) -> dict:
        return {"cursor": 3}


def checkpointer(tmp_path: Path, fmt: str = "legacy", *, ema: bool = False, micro_batches: int = 5,
                 **checkpoint) -> Checkpointer:
    cfg = Config(checkpoint_format=fmt, checkpoint=CheckpointConfig(**checkpoint))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    c = Checkpointer(cfg, DistInfo(), StopRequest(), model=model, optimizer=opt, loader=FakeLoader(micro_batches),
                     state=TrainState(), scaler=torch.amp.GradScaler("cpu", enabled=False),
                     ema=EMA(model, 0.9) if ema else None, data_fingerprint="fp", code_version="v1")
    c.begin(tmp_path / "model", scheduler=WarmupCosine(opt, warmup=0, total=10, min_ratio=0.0, kind="cosine"),
            grad_accum=2)
    return c


def test_meta_is_the_parts_state_dicts_with_the_keys_checkpoints_have(tmp_path):
    c = checkpointer(tmp_path, ema=True)
    c.state.global_step, c.state.stop_reason, c.state.finished = 7, "budget", True
    meta = c.meta()
    assert list(meta) == ["trainer", "scheduler", "scaler", "world_size", "ema", "workers_per_rank", "batch_size",
                          "grad_accum", "data_length", "data_fingerprint", "callbacks", "objective", "optimizer_class",
                          "optimizer_built"]
    assert list(meta["trainer"]) == ["global_step", "epoch", "iter", "best_metric", "best_epoch", "best_of", "epoch_start_step",
                                     "last_eval", "eval_step", "stop_reason", "error", "finished"]
    assert (meta["trainer"]["global_step"], meta["trainer"]["stop_reason"], meta["trainer"]["finished"]) == (7, None, True)
    assert meta["scheduler"] == c.scheduler.state_dict() and meta["scaler"] == {}
    assert meta["ema"] == {"updates": 0, "decay": 0.9, "warmup": True}
    assert (meta["world_size"], meta["workers_per_rank"], meta["batch_size"], meta["grad_accum"]) == (
        1, c.config.data.num_workers, c.config.data.batch_size, 2)
    assert (meta["data_length"], meta["data_fingerprint"]) == (None, "fp")  # what the cursor was saved for
    assert meta_problem(meta) is None  # what a resume checks
    assert checkpointer(tmp_path).meta()["ema"] is None


def test_step_saves_write_last_and_keep_the_newest_iter_snapshots(tmp_path):
    c = checkpointer(tmp_path, every_steps=2, keep_iter=2)
    for step in range(1, 7):
        c.state.global_step, c.state.iter = step, step % 5
        c.on_step(run_ends=False)
    model_dir = tmp_path / "model"
    assert sorted(p.name for p in model_dir.glob("iter_*.pth")) == ["iter_4.pth", "iter_6.pth"]
    saved = torch.load(model_dir / "model_last.pth", weights_only=True)
    assert saved["progress"]["global_step"] == 6 and saved["progress"]["iter"] == 1
    assert read_json(model_dir / "iter_6.pth.json")["kind"] == "iter"


def test_a_failed_periodic_save_stops_the_run_with_a_typed_cause_and_skips_the_final_save(tmp_path, monkeypatch):
    c = checkpointer(tmp_path, every_steps=1, keep_iter=0)

    def disk_full(*_a, **_k):
        raise OSError(28, "No space left on device", str(tmp_path / "model" / "model_last.pth"))

    monkeypatch.setattr(files, "save_legacy", disk_full)
    c.state.global_step, c.state.iter = 1, 1
    c.on_step(run_ends=False)
    assert c.failed and isinstance(c.stop.cause, CheckpointSaveError)
    assert c.stop.reason == str(c.stop.cause) and c.stop.reason.startswith("checkpoint save failed: ")
    assert "No space left on device" in c.stop.reason
    monkeypatch.undo()
    assert c.on_end() is None and not (tmp_path / "model" / "model_last.pth").exists()


def test_on_error_continue_logs_and_trains_on(tmp_path, monkeypatch):
    c = checkpointer(tmp_path, every_steps=1, on_error="continue")

    def io_error(*_a, **_k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(files, "save_legacy", io_error)
    c.state.global_step, c.state.iter = 1, 1
    c.on_step(run_ends=False)
    assert not c.failed and c.stop.reason is None
    monkeypatch.undo()
    c.on_end()  # the final save still happens
    assert (tmp_path / "model" / "model_last.pth").is_file()


def test_best_file_names_the_evaluated_epoch(tmp_path):
    c = checkpointer(tmp_path, micro_batches=5)
    c.state.global_step, c.state.epoch, c.state.iter = 10, 2, 0  # epoch 1 just ended
    c.on_best(1, {"name": "val/acc", "value": 0.9, "mode": "max", "split": "val", "epoch": 1, "weights": "raw"})
    side = read_json(tmp_path / "model" / "model_best.pth.json")
    assert (side["kind"], side["epoch"], side["iter"], side["step"]) == ("best", 1, 5, 10)
    assert side["selection_metric"]["value"] == 0.9


def test_single_format_end_moves_pointers_without_rewriting_the_step(tmp_path):
    c = checkpointer(tmp_path, "single")
    c.state.global_step, c.state.epoch, c.state.finished = 10, 2, True
    c.on_best(1, {"name": "val/acc", "value": 0.9, "mode": "max", "split": "val", "epoch": 1, "weights": "raw"})
    written = (tmp_path / "model" / "step_10.pth").stat().st_mtime_ns
    c.on_end()
    model_dir = tmp_path / "model"
    assert {p: os.readlink(model_dir / p) for p in ("best", "last", "final")} == dict.fromkeys(
        ("best", "last", "final"), "step_10.pth")
    assert (model_dir / "step_10.pth").stat().st_mtime_ns == written


# ------------------------------------------------------------------ parts' state dicts
def test_train_state_round_trips_and_a_load_resets_the_session_outcome():
    s = TrainState(global_step=12, epoch=2, iter=3, best_metric=0.8, best_epoch=1, epoch_start_step=10,
                   last_eval={"val/acc": 0.8}, eval_step=10, stop_reason="budget", error="x", finished=True,
                   save_error=CheckpointSaveError("checkpoint save failed: disk"))
    saved = s.state_dict()
    assert "save_error" not in saved and saved["stop_reason"] is None and saved["error"] is None
    t = TrainState(stop_reason="old", finished=True)
    t.load_state_dict(saved)
    assert t == replace(s, stop_reason=None, error=None, finished=False, save_error=None)
    older = {k: v for k, v in saved.items() if k not in ("epoch_start_step", "eval_step")}  # saved by pimm < 0.2
    t.load_state_dict(older, epoch_start_step=9)
    assert (t.epoch_start_step, t.eval_step) == (9, None)


def test_ema_state_dict_and_restart():
    model = nn.Linear(3, 1)
    ema = EMA(model, 0.5, warmup=False)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)
    assert ema.state_dict() == {"updates": 1, "decay": 0.5, "warmup": False}
    ema.restart(model)
    assert ema.updates == 0 and torch.equal(ema.shadow["weight"], model.weight.detach())


@pytest.mark.parametrize("position,accum,epochs,max_steps,end", [
    ((0, 0, 0), 1, 3, 0, 15),  # 5 micro-batches per epoch, 3 epochs
    ((0, 0, 0), 2, 3, 0, 9),  # windows of 2: 3 steps per epoch (the last window is short)
    ((7, 1, 3), 2, 3, 0, 7 + 1 + 3),  # resumed at iter 3 of epoch 1: 1 window left, then one epoch
    ((7, 1, 3), 2, 3, 8, 8),  # capped by max_steps
    ((15, 3, 0), 1, 3, 0, 15),  # at the end already
])
def test_end_step_counts_the_windows_left(position, accum, epochs, max_steps, end):
    step, epoch, it = position
    s = TrainState(global_step=step, epoch=epoch, iter=it)
    t = TrainConfig(epochs=epochs, grad_accum=accum, max_steps=max_steps)
    assert end_step(s, t, micro_batches=5, steps_per_epoch=-(-5 // accum)) == end


def test_a_stop_request_keeps_the_first_reason_and_its_cause():
    stop = StopRequest()
    error = CheckpointSaveError("checkpoint save failed: disk full")
    stop.request(str(error), cause=error)
    stop.request("operator")
    assert (stop.reason, stop.cause) == (str(error), error)
    stop.clear()
    stop.request("checkpoint save failed, said the operator")  # text alone is not a failure
    assert stop.cause is None


# ------------------------------------------------------------------ the Recorder
def recorder(run_dir: Path | None, state: TrainState, info: DistInfo = DistInfo()) -> Recorder:
    rec = Recorder(run_dir, info, state, epochs=3, steps_per_epoch=5, log_every_steps=2)
    rec.total = 15
    return rec


def test_status_json_round_trips_the_position_and_the_outcome(tmp_path):
    s = TrainState(global_step=4, epoch=0, iter=4)
    rec = recorder(tmp_path, s)
    rec.status("running")
    status = read_json(tmp_path / "status.json")
    assert {k: status[k] for k in ("state", "step", "epoch", "iter", "total_steps", "steps_per_epoch", "epochs",
                                   "world_size", "stop_reason", "pids")} == {
        "state": "running", "step": 4, "epoch": 0, "iter": 4, "total_steps": 15, "steps_per_epoch": 5, "epochs": 3,
        "world_size": 1, "stop_reason": None, "pids": [os.getpid()]}
    s.stop_reason = "budget"
    rec.status("stopped")
    assert (read_json(tmp_path / "status.json")["state"], read_json(tmp_path / "status.json")["stop_reason"]) == (
        "stopped", "budget")
    rec.status("failed", error="OSError: disk")
    assert read_json(tmp_path / "status.json")["error"] == "OSError: disk"


def test_only_rank_0_with_a_run_dir_writes(tmp_path):
    recorder(tmp_path, TrainState(), DistInfo(rank=1, world_size=2)).status("running")
    recorder(None, TrainState()).status("running")
    assert list(tmp_path.iterdir()) == []


def test_a_session_writes_config_metrics_provenance_and_its_log(tmp_path):
    s = TrainState()
    rec = recorder(tmp_path, s)
    rec.open_log()
    logging.getLogger("pimm").warning("inside the run")
    rec.start(Config(), {"kind": "start"}, fresh=True, code_version="v1", data_fingerprint="fp")
    with rec.training():
        for step in range(1, 5):
            s.global_step, s.iter = step, step
            rec.on_step(0, torch.tensor(0.5), 0.1, samples=8)
    s.stop_reason = "budget"
    rec.on_stop()
    rec.close()
    logging.getLogger("pimm").warning("after the run")
    assert (tmp_path / "config.toml").is_file()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 4]  # step 1, then every 2
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert (prov["code_version"], prov["data_fingerprint"]) == ("v1", "fp")
    assert [e["kind"] for e in prov["starts"]] == ["start", "stop"] and prov["starts"][1]["reason"] == "budget"
    text = (tmp_path / "train.log").read_text()
    assert "inside the run" in text and "after the run" not in text
