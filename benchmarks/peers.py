"""Peers: the same model and state saved and resumed by PyTorch Lightning, Hugging Face Accelerate and pimm.

Runs in the benchmark environment only (``lightning`` and ``accelerate`` are in the
``bench`` dependency group, not runtime dependencies)::

    uv run --group bench python benchmarks/peers.py [--mib 108 624] [--width 1024] [--repeats 5] [--busy 2]
        [--engines pimm,raw,accelerate,lightning] [--dir /tmp]

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
- ``raw``: the floor: as many bytes as pimm's checkpoint written with ``os.write`` (64 MiB
  buffers) into one new file, ``fsync``, the previous file removed; the previous file's
  page cache is released first, as pimm does (``benchmarks/save_throughput.py``).
  Its "load" reads the file back into one preallocated buffer (``readinto``).

``--busy N`` measures every size twice in the same run, alternating round by round:
idle, and beside N CPU-bound processes (``python3 -c "while True: pass"``) that the
benchmark starts before the round and kills after it. pimm's save is also split into
its parts (``pimm_parts_s``: state dict, DCP write, ``weights.pth`` (of which its own
fsync, ``weights_fsync``), the sha256 computed during the writes (``sha256_in_writes``,
summed over threads: it overlaps them), the page release in step with the writes, the
sha256 left after the writes, the wait for the shards' background fsync, the fsync of the
rest, manifest and markers, rotation; ``other`` is what is left), and the parts run alone
on the same state in the same round (``pimm_parts_s.alone``: the sha256 of the tensors'
bytes, the DCP write and ``weights.pth`` without hashing), wall and CPU seconds.

Lightning and Accelerate do not fsync; ``save_durable_s`` adds an fsync of every file
they wrote (what pimm's save includes), so ``ratio_to_pimm.save_durable`` compares like
with like. Loads read from a warm page cache for every engine (the files were just written).
Ratios are engine / pimm (time: > 1 means slower than pimm; bytes: > 1 means larger);
``pimm_to`` gives pimm / engine (the issue's direction: <= 1 means pimm is as fast).
Repeats interleave the engines (the order rotates); one warm-up round is discarded.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import subprocess
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

from _common import (MiB, time_calls, build_model, load_average, machine, median, one_adamw_step, r, remove,  # noqa: E402
                     settle, state_bytes, tree_bytes)
from pimm_core.checkpoint.formats.standard import load_standard, save_standard
from pimm_core.fsio import fsync_tree, release_cached_pages
from pimm_core.process.dist import DistInfo


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
# pimm's save split into its parts: each function is wrapped while the save runs (summed
# wall time; a part on a second thread overlaps, so `other` is clamped at 0).
PARTS = {"state_dict": ("pimm_core.checkpoint.formats.standard", "dcp_state"),
         "dcp_write": ("torch.distributed.checkpoint", "save"),
         "weights_pth": ("pimm_core.checkpoint.publish.rotation", "save_torch_file"),
         "sha256_left": ("pimm_core.checkpoint.publish.follow", "FollowingHasher.finish"),  # (of the followed files)
         "describe_files": ("pimm_core.checkpoint.publish.rotation", "describe_files"),
         "fsync_tree": ("pimm_core.checkpoint.publish.rotation", "fsync_tree"),  # (before 2026-12-03)
         "fsync_together": ("pimm_core.checkpoint.publish.rotation", "fsync_tree_together"),
         "shard_fsync_wait": ("pimm_core.fsio", "BackgroundSync.wait"),  # (what the overlap did not hide)
         "manifest": ("pimm_core.checkpoint.publish.rotation", "write_manifest"),
         "rotate": ("pimm_core.checkpoint.publish.rotation", "rotate_into_place"),
         "release_pages": ("pimm_core.checkpoint.formats.standard", "release_cached_pages"),
         "release_pages_in_step": ("pimm_core.fsio", "PageRelease.advance"),  # (inside the writes)
         "weights_fsync": ("pimm_core.fsio", "fsync_file"),  # (weights.pth's own fsync, inside weights_pth)
         "set_up": ("pimm_core.checkpoint.publish.rotation", "prepare")}
# Parts that run inside others (not subtracted for `other`).
NESTED = {"release_pages_in_step", "weights_fsync", "sha256_in_writes"}


class _TimedSha:
    """hashlib.sha256 whose update()s add their seconds to ``totals["sha256_in_writes"]`` (summed
    over threads: it overlaps the writes)."""

    def __init__(self, totals: dict[str, float], *a):
        import hashlib

        self._h, self._totals = hashlib.sha256(*a), totals

    def update(self, b) -> None:
        t0 = time.perf_counter()
        self._h.update(b)
        dt = time.perf_counter() - t0
        self._totals["sha256_in_writes"] = self._totals.get("sha256_in_writes", 0.0) + dt

    def hexdigest(self) -> str:
        return self._h.hexdigest()


@contextlib.contextmanager
def sha_timer(parts: dict[str, float]):
    """Inside: the sha256 computed while pimm's files are written is timed (``sha256_in_writes``)."""
    import types

    from pimm_core.checkpoint.publish import follow

    real = follow.hashlib
    follow.hashlib = types.SimpleNamespace(sha256=lambda *a: _TimedSha(parts, *a))
    try:
        yield
    finally:
        follow.hashlib = real


def parts_timer(parts: dict[str, float]):
    """Time the parts of a save (:data:`PARTS`) that this version of pimm has."""
    import importlib

    targets = {}
    for label, (mod_name, attr) in PARTS.items():
        owner = importlib.import_module(mod_name)
        *outer, name = attr.split(".")
        for o in outer:
            owner = getattr(owner, o)
        if hasattr(owner, name):  # (a part this version of pimm does not have is left out)
            targets[label] = (owner, name)
    return time_calls(targets, parts)


class Pimm:
    name = "pimm"

    def __init__(self, total: int, width: int, work: Path):
        self.total, self.width, self.dir = total, width, work / self.name
        self.dir.mkdir()
        self.model = build_model(total, width)
        self.opt = one_adamw_step(self.model)
        self.parts: dict[str, float] = {}

    def save(self) -> tuple[float, float, Path]:
        meta = {"trainer": {"global_step": 1, "epoch": 0, "iter": 1}, "scheduler": {}, "scaler": {}, "world_size": 1,
                "workers_per_rank": 0}  # what a resume needs (load_standard checks it)
        parts: dict[str, float] = {}
        with parts_timer(parts), sha_timer(parts):
            t0 = time.perf_counter()
            save_standard(self.dir, model=self.model, optimizer=self.opt, meta=meta,
                          rank_state={"rng": torch.get_rng_state()}, manifest={"kind": "last", "step": 1, "epoch": 0, "iter": 1},
                          info=DistInfo())
            t = time.perf_counter() - t0
        parts["other"] = max(0.0, t - sum(v for k, v in parts.items() if k not in NESTED))
        self.parts = parts
        return t, t, self.dir / "last"  # already durable

    def load(self) -> dict:
        model = build_model(self.total, self.width, seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        t0 = time.perf_counter()
        load_standard(self.dir / "last", model=model, optimizer=opt, info=DistInfo())
        t = time.perf_counter() - t0
        assert torch.equal(next(model.parameters()), next(self.model.parameters()))
        assert len(opt.state) == len(self.opt.state)
        # what a resume does first: the sha256 of every file checked against the manifest
        from pimm_core.checkpoint.records.manifest import read_manifest, verify_files

        t1 = time.perf_counter()
        problems = verify_files(self.dir / "last", read_manifest(self.dir / "last" / "manifest.json")["files"])
        verify = time.perf_counter() - t1
        assert not problems, problems
        return {"load_s": t, "verify_s": verify}


def components(pimm: Pimm, work: Path) -> dict[str, float]:
    """pimm's save in parts, each run alone on the same state (wall and CPU seconds): the sha256
    of every tensor's bytes (what the save hashes, less the pickles and zip headers), the DCP
    write of the trainer state without hashing (DCP's own fsync), ``weights.pth`` without
    hashing (written, fsynced, renamed), each replacing its previous copy as the save does."""
    import hashlib

    import torch.distributed.checkpoint as dcp

    from pimm_core.checkpoint.formats.standard import _shard_writer, dcp_state
    from pimm_core.checkpoint.formats.weights_file import weights_payload
    from pimm_core.checkpoint.publish.rotation import save_torch_file, without_zip_crc32
    from pimm_core.fsio import remove_tree

    tensors = [p.detach() for p in pimm.model.parameters()] + [
        v for st in pimm.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
    base = work / "components"
    base.mkdir(exist_ok=True)

    def sha() -> None:
        h = hashlib.sha256()
        for t in tensors:
            h.update(memoryview(t.numpy()).cast("B"))

    def dcp_write() -> None:
        old, new = base / "dcp", base / "dcp.new"
        remove_tree(new)
        new.mkdir()
        state = dcp_state(pimm.model, pimm.opt, {"trainer": {}}, {}, 0)
        release_cached_pages(old)
        with without_zip_crc32():
            dcp.save(state, storage_writer=_shard_writer(new, None, None), no_dist=True)
        remove_tree(old)
        new.rename(old)

    def weights() -> None:
        release_cached_pages(base / "weights.pth")  # (save_torch_file also does, as the save)
        with without_zip_crc32():
            save_torch_file(base / "weights.pth", weights_payload(pimm.model, None))

    out: dict[str, float] = {}
    for name, fn in (("sha256_alone", sha), ("dcp_write_unhashed", dcp_write), ("weights_pth_unhashed", weights)):
        settle()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        out[f"{name}_s"] = time.perf_counter() - t0
        out[f"{name}_cpu_s"] = time.process_time() - c0
    return out


class PimmAtOnce(Pimm):
    """pimm as it was before the previous checkpoint's pages were released in step with the
    writes: all of them at once, before the first byte is written (the ablation)."""

    name = "pimm_at_once"

    def save(self) -> tuple[float, float, Path]:
        from pimm_core.checkpoint.publish import rotation as publish
        from pimm_core.checkpoint.formats import standard

        def at_once(tmp: Path, previous: Path | None = None, **kw):
            if previous is not None:
                release_cached_pages(previous)
            return publish.follow_hashes(tmp, **kw)

        standard.follow_hashes = at_once
        try:
            return super().save()
        finally:
            standard.follow_hashes = publish.follow_hashes


# --------------------------------------------------------------------- raw
class Raw:
    """One file of ``nbytes`` written with ``os.write`` + ``fsync`` (the floor); read back with ``readinto``."""

    name = "raw"
    CHUNK = 64 << 20

    def __init__(self, total: int, width: int, work: Path):
        self.dir, self.nbytes, self.n = work / "raw", total, 0
        self.dir.mkdir()
        self.buf = memoryview(os.urandom(self.CHUNK))
        self.path: Path | None = None

    def save(self) -> tuple[float, float, Path]:
        self.n += 1
        path = self.dir / f"state-{self.n}.bin"
        t0 = time.perf_counter()
        if self.path is not None:
            release_cached_pages(self.path)  # as pimm does with its previous checkpoint
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = self.nbytes
            while left > 0:
                left -= os.write(fd, self.buf[:min(left, self.CHUNK)])
            os.fsync(fd)
        finally:
            os.close(fd)
        if self.path is not None:
            self.path.unlink()
        t = time.perf_counter() - t0
        self.path = path
        return t, t, path

    def load(self) -> dict:
        out = bytearray(self.nbytes)
        t0 = time.perf_counter()
        with open(self.path, "rb", buffering=0) as f:
            view, got = memoryview(out), 0
            while got < self.nbytes:
                got += f.readinto(view[got:])
        return {"load_s": time.perf_counter() - t0}


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


@contextlib.contextmanager
def busy(n: int):
    """``n`` CPU-bound processes (``python3 -c "while True: pass"``) running while inside."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        if procs:
            time.sleep(1.0)  # (running, and the scheduler has seen them)
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()



def measure(mib: float, args: argparse.Namespace, names: list[str]) -> dict:
    """Every engine at one state size, idle (and beside ``args.busy`` processes), alternated."""
    classes = {"pimm": Pimm, "pimm_at_once": PimmAtOnce, "raw": Raw, "accelerate": Accelerate,
               "lightning": Lightning}
    total = int(mib * MiB)
    work = Path(tempfile.mkdtemp(prefix="pimm-peers-bench-", dir=args.dir))
    conditions = ["idle", "busy"] if args.busy else ["idle"]
    results: dict[str, dict[str, dict[str, list[float]]]] = {c: {} for c in conditions}
    parts: dict[tuple[str, str], list[dict[str, float]]] = {}
    on_disk: dict[str, int] = {}
    files: dict[str, list[str]] = {}
    load_start = load_average()
    try:
        engines = [classes[n](total, args.width, work) for n in names]
        pimm = engines[0]
        sizes = state_bytes(pimm.model, pimm.opt)
        for repeat in range(args.repeats + 1):
            for c_i in range(len(conditions)):
                cond = conditions[(repeat + c_i) % len(conditions)]
                k = repeat % len(engines)
                with busy(args.busy if cond == "busy" else 0):
                    for eng in engines[k:] + engines[:k]:
                        if eng.name == "raw":
                            eng.nbytes = on_disk.get("pimm", eng.nbytes)  # the same bytes as pimm's checkpoint
                        settle()
                        c0 = time.process_time()  # CPU seconds of this process, all its threads
                        save_s, durable_s, out = eng.save()
                        save_cpu = time.process_time() - c0
                        settle()
                        c0 = time.process_time()
                        loaded = eng.load()
                        loaded["load_cpu_s"] = time.process_time() - c0  # (pimm: with the verify)
                        on_disk[eng.name] = tree_bytes(out)
                        files[eng.name] = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) \
                            if out.is_dir() else [out.name]
                        if repeat:
                            rec = results[cond].setdefault(eng.name, {})
                            for key, v in {"save_s": save_s, "save_durable_s": durable_s, "save_cpu_s": save_cpu,
                                           **loaded}.items():
                                rec.setdefault(key, []).append(v)
                            if eng.name.startswith("pimm"):
                                parts.setdefault((cond, eng.name), []).append(eng.parts)
                    if repeat and not args.no_components:
                        parts.setdefault((cond, "alone"), []).append(components(pimm, work))
    finally:
        remove(work)

    out: dict = {"state_bytes": sizes, "state_mib": r(sizes["total"] / MiB, 1),
                 "layers": sum(1 for m in pimm.model if isinstance(m, torch.nn.Linear)), "width": args.width,
                 "bytes_on_disk": on_disk, "files": files}
    for cond in conditions:
        med = {e: {k: median(v) for k, v in rec.items()} for e, rec in results[cond].items()}
        p = med["pimm"]
        engines_out = {}
        for e, m in med.items():
            engines_out[e] = {**{k: r(v) for k, v in m.items()},
                              "ratio_to_pimm": {"save": r(m["save_s"] / p["save_s"]),
                                                "save_durable": r(m["save_durable_s"] / p["save_durable_s"]),
                                                "load": r(m["load_s"] / p["load_s"]) if p["load_s"] else None,
                                                "bytes": r(on_disk[e] / on_disk["pimm"])}}
        pimm_to = {e: {"save_durable": r(p["save_durable_s"] / m["save_durable_s"]),
                       "load": r(p["load_s"] / m["load_s"]) if m["load_s"] else None}
                   for e, m in med.items() if e != "pimm"}
        parts_out = {}
        for (c, e), phs in parts.items():
            if c == cond:
                keys = sorted({k for ph in phs for k in ph})
                parts_out[e] = {k: r(median([ph.get(k, 0.0) for ph in phs])) for k in keys}
        out[cond] = {"engines": engines_out, "pimm_to": pimm_to, "pimm_parts_s": parts_out,
                     "seconds_all": {e: {k: [r(x) for x in v] for k, v in rec.items()}
                                     for e, rec in results[cond].items()}}
    out["busy_processes"] = args.busy
    out["load_average_start"], out["load_average_end"] = load_start, load_average()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, nargs="+", default=[256.0],
                    help="minimum state size(s) in MiB (params + AdamW state)")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--busy", type=int, default=0,
                    help="also measure beside N CPU-bound processes, alternating with idle rounds")
    ap.add_argument("--engines", default="pimm,raw,accelerate,lightning",
                    help="comma-separated subset of pimm,raw,accelerate,lightning,pimm_at_once (pimm always "
                         "runs; pimm_at_once: the ablation, the previous checkpoint's pages released at once)")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--no-components", action="store_true",
                    help="leave out pimm's save parts measured alone (pimm_parts_s.alone)")
    args = ap.parse_args()
    names = ["pimm"] + [n for n in args.engines.split(",") if n and n != "pimm"]
    unknown = sorted(set(names) - {"pimm", "pimm_at_once", "raw", "accelerate", "lightning"})
    if unknown:
        ap.error(f"unknown engine(s): {', '.join(unknown)}")

    warnings.filterwarnings("ignore")
    import accelerate  # noqa: F401  (imported before the log levels are set: they set their own at import)
    import lightning  # noqa: F401

    for name in ("pimm", "lightning", "lightning.pytorch", "lightning.fabric", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    load_start = load_average()
    by_size = {f"{mib:g}": measure(mib, args, names) for mib in args.mib}
    print(json.dumps({
        "sizes": by_size,
        "versions": {"lightning": lightning.__version__, "accelerate": accelerate.__version__},
        "repeats": args.repeats,
        "machine": machine(Path(args.dir), load_start),
    }, indent=2))


if __name__ == "__main__":
    main()
