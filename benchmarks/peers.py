"""Peers: the same model and state saved and resumed by PyTorch Lightning, Hugging Face Accelerate and pimm.

Runs in the benchmark environment only (``lightning`` and ``accelerate`` are in the
``bench`` dependency group, not runtime dependencies)::

    uv run --group bench python benchmarks/peers.py [--mib 256] [--repeats 3] [--dir /tmp]

State: a stack of ``Linear(--width, --width)`` layers + AdamW after one step (1/3
parameters, 2/3 optimizer state), >= ``--mib`` MiB. Each engine saves its own
complete training state, then restores it into a freshly built model and optimizer:

- ``pimm``: ``save_standard`` into a model dir holding a previous ``last/`` (DCP +
  ``weights.pth`` + sha256 manifest + rotation, everything fsynced); ``load_standard``.
- ``lightning``: ``Trainer.save_checkpoint`` (what ``ModelCheckpoint`` calls) after a
  one-step ``fit``; resume with ``Trainer(...).fit(module, ckpt_path=...)``. Lightning's
  restore is measured as the time from ``fit`` to the first training batch with
  ``ckpt_path`` minus the same without it (the trainer's own set-up); both raw numbers
  are reported too.
- ``accelerate``: ``Accelerator.save_state`` (safetensors model + ``optimizer.bin`` + RNG)
  after one step on prepared objects; ``Accelerator.load_state`` into freshly
  prepared objects.

Lightning and Accelerate do not fsync; ``save_durable_s`` adds an fsync of every file
they wrote (what pimm's save includes), so ``ratio_to_pimm.save_durable`` compares like
with like. Loads read from a warm page cache for every engine (the files were just written).
Ratios are engine / pimm (time: > 1 means slower than pimm; bytes: > 1 means larger).
Repeats interleave the engines; one warm-up round is discarded.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (MiB, build_model, load_average, machine, median, one_adamw_step, r, remove,  # noqa: E402
                     settle, state_bytes, tree_bytes)
from pimm_core.fsio import fsync_tree  # noqa: E402
from pimm_core.checkpoint.formats.standard import load_standard, save_standard  # noqa: E402
from pimm_core.process.dist import DistInfo  # noqa: E402


@contextlib.contextmanager
def quiet():
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def fsync_path(path: Path) -> float:
    t0 = time.perf_counter()
    if path.is_dir():
        fsync_tree(path)
    else:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


# --------------------------------------------------------------------- pimm
class Pimm:
    name = "pimm"

    def __init__(self, total: int, width: int, work: Path):
        self.total, self.width, self.dir = total, width, work / "pimm"
        self.dir.mkdir()
        self.model = build_model(total, width)
        self.opt = one_adamw_step(self.model)

    def save(self) -> tuple[float, float, Path]:
        t0 = time.perf_counter()
        meta = {"trainer": {"global_step": 1, "epoch": 0, "iter": 1}, "scheduler": {}, "scaler": {}, "world_size": 1,
                "workers_per_rank": 0}  # what a resume needs (load_standard checks it)
        save_standard(self.dir, model=self.model, optimizer=self.opt, meta=meta,
                      rank_state={"rng": torch.get_rng_state()}, manifest={"kind": "last", "step": 1},
                      info=DistInfo())
        t = time.perf_counter() - t0
        return t, t, self.dir / "last"  # already durable

    def load(self) -> dict:
        model = build_model(self.total, self.width, seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        t0 = time.perf_counter()
        load_standard(self.dir / "last", model=model, optimizer=opt, info=DistInfo())
        t = time.perf_counter() - t0
        assert torch.equal(next(model.parameters()), next(self.model.parameters()))
        assert len(opt.state) == len(self.opt.state)
        return {"load_s": t}


# ---------------------------------------------------------------- lightning
class Lightning:
    name = "lightning"

    def __init__(self, total: int, width: int, work: Path):
        import lightning as L

        self.L, self.total, self.width, self.dir = L, total, width, work / "lightning"
        self.dir.mkdir()
        data = torch.utils.data.TensorDataset(torch.randn(8, width))
        self.loader = torch.utils.data.DataLoader(data, batch_size=2)
        self.module = self._module(seed=0)
        with quiet():
            self.trainer = self._trainer(max_steps=1)
            self.trainer.fit(self.module, self.loader)

    def _module(self, seed: int):
        L, total, width = self.L, self.total, self.width

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = build_model(total, width, seed)

            def training_step(self, batch, _idx):
                (x,) = batch
                return F.mse_loss(self.net(x), x)

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01)

        return Module()

    def _trainer(self, max_steps: int, callbacks=()):
        return self.L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                              num_sanity_val_steps=0, callbacks=list(callbacks))

    def save(self) -> tuple[float, float, Path]:
        path = self.dir / "last.ckpt"
        t0 = time.perf_counter()
        with quiet():
            self.trainer.save_checkpoint(path)
        t = time.perf_counter() - t0
        return t, t + fsync_path(path), path

    def _time_to_first_batch(self, ckpt_path: Path | None) -> tuple[float, object]:
        L = self.L
        stamps: list[float] = []
        first: list[torch.Tensor] = []

        class FirstBatch(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, *_):
                stamps.append(time.perf_counter())
                first.append(next(pl_module.net.parameters()).detach().clone())  # before the step runs
                trainer.should_stop = True

        module = self._module(seed=1)
        trainer = self._trainer(max_steps=2, callbacks=[FirstBatch()])
        t0 = time.perf_counter()
        with quiet():
            trainer.fit(module, self.loader, ckpt_path=str(ckpt_path) if ckpt_path else None)
        return stamps[0] - t0, first[0]

    def load(self) -> dict:
        fresh, _ = self._time_to_first_batch(None)
        resumed, restored = self._time_to_first_batch(self.dir / "last.ckpt")
        assert torch.equal(restored, next(self.module.net.parameters()))
        return {"load_s": max(resumed - fresh, 0.0), "fit_to_first_batch_resumed_s": resumed,
                "fit_to_first_batch_fresh_s": fresh}


# --------------------------------------------------------------- accelerate
class Accelerate:
    name = "accelerate"

    def __init__(self, total: int, width: int, work: Path):
        from accelerate import Accelerator

        self.Accelerator, self.total, self.width, self.dir = Accelerator, total, width, work / "accelerate"
        self.dir.mkdir()
        self.acc = Accelerator(cpu=True)
        model = build_model(total, width)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        self.model, self.opt = self.acc.prepare(model, opt)
        x = torch.randn(2, width)
        self.acc.backward(F.mse_loss(self.model(x), x))
        self.opt.step()
        self.opt.zero_grad()

    def save(self) -> tuple[float, float, Path]:
        out = self.dir / "state"
        t0 = time.perf_counter()
        with quiet():
            self.acc.save_state(str(out))
        t = time.perf_counter() - t0
        return t, t + fsync_path(out), out

    def load(self) -> dict:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state()  # a new Accelerator in the same process, as a resumed script would make
        acc = self.Accelerator(cpu=True)
        model = build_model(self.total, self.width, seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        model, opt = acc.prepare(model, opt)
        t0 = time.perf_counter()
        with quiet():
            acc.load_state(str(self.dir / "state"))
        t = time.perf_counter() - t0
        assert torch.equal(next(model.parameters()), next(self.model.parameters()))
        return {"load_s": t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=256.0, help="minimum state size in MiB (params + AdamW state)")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()

    warnings.filterwarnings("ignore")
    import accelerate  # noqa: F401  (imported before the log levels are set: they set their own at import)
    import lightning  # noqa: F401

    for name in ("pimm", "lightning", "lightning.pytorch", "lightning.fabric", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    load_start = load_average()
    total = int(args.mib * MiB)
    work = Path(tempfile.mkdtemp(prefix="pimm-peers-bench-", dir=args.dir))
    results: dict[str, dict[str, list[float]]] = {}
    on_disk: dict[str, int] = {}
    files: dict[str, list[str]] = {}
    try:
        engines = [Pimm(total, args.width, work), Lightning(total, args.width, work), Accelerate(total, args.width, work)]
        sizes = state_bytes(engines[0].model, engines[0].opt)
        for repeat in range(args.repeats + 1):
            k = repeat % len(engines)
            for eng in engines[k:] + engines[:k]:
                settle()
                save_s, durable_s, out = eng.save()
                settle()
                loaded = eng.load()
                on_disk[eng.name] = tree_bytes(out)
                files[eng.name] = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) \
                    if out.is_dir() else [out.name]
                if repeat:
                    rec = results.setdefault(eng.name, {})
                    for key, v in {"save_s": save_s, "save_durable_s": durable_s, **loaded}.items():
                        rec.setdefault(key, []).append(v)
    finally:
        remove(work)

    med = {e: {k: median(v) for k, v in rec.items()} for e, rec in results.items()}
    p = med["pimm"]
    out = {}
    for e, m in med.items():
        out[e] = {**{k: r(v) for k, v in m.items()}, "bytes_on_disk": on_disk[e], "files": files[e],
                  "ratio_to_pimm": {"save": r(m["save_s"] / p["save_s"]),
                                    "save_durable": r(m["save_durable_s"] / p["save_durable_s"]),
                                    "load": r(m["load_s"] / p["load_s"]) if p["load_s"] else None,
                                    "bytes": r(on_disk[e] / on_disk["pimm"])}}
    print(json.dumps({
        "state_bytes": sizes, "state_mib": r(sizes["total"] / MiB, 1), "width": args.width,
        "engines": out,
        "versions": {"lightning": lightning.__version__, "accelerate": accelerate.__version__},
        "seconds_all": {e: {k: [r(x) for x in v] for k, v in rec.items()} for e, rec in results.items()},
        "repeats": args.repeats,
        "machine": machine(work.parent, load_start),
    }, indent=2))


if __name__ == "__main__":
    main()
