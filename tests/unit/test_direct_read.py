"""A standard checkpoint's tensors read straight into the model and optimizer (``formats.direct_read``):
the same values as ``load_state_dict``, and a model that loads its own way still goes through it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pimm_core.checkpoint.formats.direct_read import mapped_load, read_into_module
from pimm_core.checkpoint.formats.standard import load_standard, save_standard
from pimm_core.process.dist import DistInfo

META = {"trainer": {"global_step": 1, "epoch": 0, "iter": 1}, "scheduler": {}, "scaler": {}, "world_size": 1,
        "workers_per_rank": 0}


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def _save(tmp_path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> Path:
    return save_standard(tmp_path, model=model, optimizer=opt, meta=META, rank_state={"rng": torch.get_rng_state()},
                         manifest={"kind": "last", "step": 1, "epoch": 0, "iter": 1}, info=DistInfo())


def test_a_load_gives_the_saved_weights_and_optimizer_state(tmp_path: Path) -> None:
    model, opt = _trained(0)
    ckpt = _save(tmp_path, model, opt)
    fresh, fresh_opt = _trained(1)
    fresh_opt.state.clear()
    load_standard(ckpt, model=fresh, optimizer=fresh_opt, info=DistInfo())
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key, value in opt.state[p].items():
            assert torch.equal(value, fresh_opt.state[q][key]), key


def test_a_load_parses_the_dcp_metadata_once(tmp_path: Path, monkeypatch) -> None:
    """pimm's checks and both ``dcp.load`` calls of one load share one parse of ``.metadata``
    (pure-Python restricted unpickling: ~15 % of a 108 MiB load when it ran three times)."""
    from pimm_core.checkpoint.formats import mapped_reader

    parsed: list[Path] = []
    real = mapped_reader.read_dcp_metadata
    monkeypatch.setattr(mapped_reader, "read_dcp_metadata", lambda path: parsed.append(path) or real(path))
    model, opt = _trained(0)
    ckpt = _save(tmp_path, model, opt)
    fresh, fresh_opt = _trained(1)
    load_standard(ckpt, model=fresh, optimizer=fresh_opt, info=DistInfo())
    assert parsed == [ckpt / "trainer.dcp" / ".metadata"]
    assert torch.equal(fresh_opt.state[fresh[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])


def test_a_model_with_a_load_hook_is_loaded_through_load_state_dict(tmp_path: Path) -> None:
    model, opt = _trained(0)
    ckpt = _save(tmp_path, model, opt)
    fresh, _ = _trained(1)
    seen = []
    fresh[0].register_load_state_dict_pre_hook(lambda module, sd, prefix, *rest: seen.append(prefix))
    loaded = mapped_load(ckpt / "weights.pth")
    assert loaded is not None
    weights, whole = loaded
    assert not read_into_module(ckpt / "weights.pth", whole, fresh, weights["state_dict"])  # left to load_state_dict
    assert not torch.equal(fresh[0].weight, model[0].weight)  # nothing was read into it
    load_standard(ckpt, model=fresh, optimizer=None, info=DistInfo())
    assert seen == ["0."] and torch.equal(fresh[0].weight, model[0].weight)


def test_large_tensors_are_read_in_pieces_on_the_reading_threads(tmp_path: Path) -> None:
    """A 20 MiB layer (three pieces of READ_PIECE) and small ones (read at once): the weights and the
    optimizer's state come back bit for bit, through the reads queued on the two threads."""
    from pimm_core.checkpoint.formats import direct_read

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2560, 2048), nn.Linear(2048, 3))  # 20 MiB, then 24 KiB
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 2560)).sum().backward()
    opt.step()
    ckpt = _save(tmp_path, model, opt)
    assert model[0].weight.nbytes > 2 * direct_read.READ_PIECE
    fresh = nn.Sequential(nn.Linear(2560, 2048), nn.Linear(2048, 3))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    load_standard(ckpt, model=fresh, optimizer=fresh_opt, info=DistInfo())
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), key


def _block_reading_threads():
    import threading

    from pimm_core.checkpoint.formats.direct_read import _read_pool

    release, started = threading.Event(), [threading.Event(), threading.Event()]

    def hold(i):
        started[i].set()
        release.wait(60)

    for i in range(2):
        _read_pool.submit(hold, i)
    assert all(e.wait(60) for e in started)
    return release


def test_a_queued_read_goes_on_while_the_caller_does_and_wait_gives_its_bytes(tmp_path: Path) -> None:
    """With both reading threads busy, pread_into queues a 1 MiB read and returns at once (the caller
    unpickles the next record meanwhile); wait() returns when the bytes are in."""
    import os

    from pimm_core.checkpoint.formats.direct_read import Reads

    src = torch.randn(512, 512)
    torch.save({"w": src}, tmp_path / "w.pth")
    sd, whole = mapped_load(tmp_path / "w.pth")
    target = torch.zeros(512, 512)
    fd = os.open(tmp_path / "w.pth", os.O_RDONLY)
    release = _block_reading_threads()
    try:
        reads = Reads()
        assert reads.pread_into(fd, whole, sd["w"], target)
        assert not torch.equal(target, src)  # queued, not read yet: the caller went on
    finally:
        release.set()
    reads.wait()
    os.close(fd)
    assert torch.equal(target, src)


def test_a_failed_queued_read_is_raised_by_wait_after_the_others_end(tmp_path: Path) -> None:
    """The file shrank after it was mapped: the read past its end fails, and wait() raises it."""
    import os

    import pytest

    from pimm_core.checkpoint.formats.direct_read import Reads

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    torch.save({"a": a, "b": b}, tmp_path / "w.pth")
    sd, whole = mapped_load(tmp_path / "w.pth")
    ta, tb = torch.zeros(512, 512), torch.zeros(512, 512)
    end_of_a = sd["a"].data_ptr() - whole.data_ptr() + a.nbytes
    os.truncate(tmp_path / "w.pth", end_of_a + 100)  # b's bytes are gone
    fd = os.open(tmp_path / "w.pth", os.O_RDONLY)
    try:
        reads = Reads()
        assert reads.pread_into(fd, whole, sd["a"], ta) and reads.pread_into(fd, whole, sd["b"], tb)
        with pytest.raises(OSError, match="bytes missing"):
            reads.wait()
        assert torch.equal(ta, a)  # the read that could be done was done
    finally:
        os.close(fd)


def test_a_forked_child_saves_and_loads_after_its_parent_did(tmp_path: Path) -> None:
    """The hashing and reading threads are the parent's: a child forked after a save and a load
    (a fork server, a DataLoader worker) starts its own instead of queueing work for threads it
    does not have (it waited forever)."""
    import multiprocessing

    model = nn.Sequential(nn.Linear(1024, 1024))  # 4 MiB: read and hashed on the threads
    opt = torch.optim.AdamW(model.parameters())
    load_standard(_save(tmp_path / "parent", model, opt), model=model, optimizer=opt, info=DistInfo())

    def child() -> None:
        torch.set_num_threads(1)  # (as a DataLoader worker does: the parent's OpenMP threads are gone too)
        (tmp_path / "child").mkdir()
        fresh = nn.Sequential(nn.Linear(1024, 1024))
        load_standard(_save(tmp_path / "child", model, opt), model=fresh, optimizer=None, info=DistInfo())
        raise SystemExit(0 if torch.equal(fresh[0].weight, model[0].weight) else 3)

    (tmp_path / "parent").mkdir(exist_ok=True)
    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(120)
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == 0


def test_at_interpreter_exit_the_reads_are_done_on_the_calling_thread(tmp_path: Path, monkeypatch) -> None:
    from pimm_core.checkpoint.formats import direct_read

    def refuse(*_args):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(direct_read._read_pool, "submit", refuse)
    model, opt = _trained(0)
    model[0] = nn.Linear(8, 40000)  # 1.3 MiB: above the size read at once
    model[2] = nn.Linear(40000, 4)
    model(torch.randn(3, 8)).sum().backward()
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    ckpt = _save(tmp_path, model, opt)
    fresh = nn.Sequential(nn.Linear(8, 40000), nn.ReLU(), nn.Linear(40000, 4))
    load_standard(ckpt, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()), info=DistInfo())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
