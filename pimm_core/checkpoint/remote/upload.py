"""Uploading a run's published checkpoints to ``checkpoint.remote`` in the background (rank 0).

:class:`Uploader` mirrors the run's local ``model/`` onto the remote layout of
:mod:`~pimm_core.checkpoint.remote.store` on one thread of its own, off the training step's
critical path: :meth:`Uploader.request` (after each save) wakes it; it uploads what is
published locally and not yet complete remotely, files of one checkpoint ``concurrency`` at
a time, each retried with exponential backoff, its sha256 read back and compared with the
manifest, the marker (``.complete``, a weights file's sidecar) last; then it removes from
the remote what the local retention removed (older ``step_<N>/``, rotated ``iter_<step>.pth`` and
``best_<step>.pth``): the weights files this process saw in ``model/`` and no longer does, and an
``iter_<step>.pth`` older than all ``checkpoint.keep_iter`` newest ones ``model/`` holds (the
retention dropped it in an earlier session, and a crash came before the mirror removed it). Any
other remote file the run's ``model/`` does not hold (a wiped ``model/`` whose restore could not
download it, a later life of the run on another node, a ``best_<step>.pth`` dropped before a
crash: whether the retention dropped it depends on metrics, not steps) is never removed: the
mirror loses nothing the local retention did not decide to drop.

A failure (unreachable store, credentials, full bucket) is a warning; the thread retries on
the next request or after a backoff while training goes on. :meth:`Uploader.close` waits
at most ``timeout`` seconds and returns what is not on the remote.

With FSDP/DCP every rank's shards are written into the shared ``model/`` on rank 0's node
(one node) or a shared file system (several), so rank 0 alone uploads them all.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from ...faults import point, register
from ..records.manifest import COMPLETE, MANIFEST
from ..select.selection import BEST, BEST_K_RE, ITER_RE
from .store import STEP_RE, is_mirrored_weights, open_store, sha256_remote

log = logging.getLogger("pimm")

register("remote.file_uploaded", "remote.step_markers", "remote.sidecar")


def with_retries(what: str, fn: Callable[[], Any], *, attempts: int = 4, base: float = 0.5,
                 stopping: threading.Event | None = None) -> Any:
    """``fn()``, retried ``attempts`` times with backoff ``base * 2**i`` seconds; the last error is raised."""
    for i in range(attempts):
        try:
            return fn()
        except Exception:
            if i == attempts - 1 or (stopping is not None and stopping.is_set()):
                raise
            time.sleep(base * 2 ** i)
    raise AssertionError("unreachable")


class Uploader:
    """Background mirror of ``model_dir`` onto ``prefix`` of the store at ``url`` (see the module docstring).

    Args:
        url: ``checkpoint.remote`` (any fsspec URL).
        options: ``checkpoint.remote_options`` (storage options of that filesystem).
        model_dir: the run's local ``model/``.
        prefix: the remote path of this run's ``model/`` (:func:`~pimm_core.checkpoint.remote.store.run_prefix`).
        concurrency: files of one checkpoint uploaded at a time.
        keep_iter: ``checkpoint.keep_iter``: with that many ``iter_<step>.pth`` in ``model/``, a remote
            one older than all of them is one the local retention removed (before a crash, in an
            earlier session) and is removed remotely too.
    """

    def __init__(self, url: str, options: dict[str, Any] | None, model_dir: Path, prefix: str, *,
                 concurrency: int = 4, retry_after: float = 5.0, keep_iter: int = 0):
        self.url, self.options, self.model_dir, self.concurrency = url, options, model_dir, concurrency
        self.keep_iter = keep_iter
        self.remote_prefix, self.retry_after = prefix, retry_after
        self._fs: Any = None
        self._prefix = ""
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._missing: list[str] = []  # what the last pass could not upload
        self._generation = 0  # requests made
        self._done = 0  # the request generation the last successful pass covered
        self._warned = False
        self._current = ""  # what the pass in progress is uploading ("model/last (step N)")
        # the weights files model/ held since this uploader started (at its start, and at each pass):
        # the only ones whose absence from model/ (the retention removed them) removes them remotely
        self._seen = self._local_weights()
        self._thread = threading.Thread(target=self._run, name="pimm-upload", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- public
    def request(self) -> None:
        """A checkpoint was published locally: upload it (returns at once)."""
        with self._lock:
            self._generation += 1
        self._wake.set()

    def close(self, timeout: float) -> list[str]:
        """Upload what is published, waiting at most ``timeout`` seconds; returns what is not on the remote."""
        self.request()
        with self._lock:
            target = self._generation
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._done >= target:
                    return []
            time.sleep(0.05)
        self._closing.set()
        self._wake.set()
        with self._lock:
            return list(self._missing) or [self._current or "the upload in progress"]

    # ---------------------------------------------------------------- thread
    def finish(self, timeout: float) -> list[str]:
        """:meth:`close`, then say (logged) what is not on the remote after ``timeout`` seconds, or that all is."""
        missing = self.close(timeout)
        if missing:
            log.warning("warning: not on the remote %s after waiting %gs: %s (the local copies are intact)",
                        self.url, timeout, "; ".join(missing))
        else:
            log.info("checkpoints uploaded to %s", self.url)
        return missing

    def _run(self) -> None:
        while not self._closing.is_set():
            if not self._wake.wait(self.retry_after) and not self._missing:
                continue
            self._wake.clear()
            with self._lock:
                generation = self._generation
            try:
                missing = self._pass()
            except Exception as e:  # the store failed beyond its retries: a warning, training goes on
                error = str(e).splitlines()[0] if str(e) else type(e).__name__
                missing = [f"{self._current or self.url} ({error})"]
            with self._lock:
                self._missing = missing
                if not missing:
                    self._done = generation
            if missing and not self._warned:
                log.warning("warning: checkpoint upload to %s failed: %s; retrying while training goes on",
                            self.remote_prefix, "; ".join(missing))
                self._warned = True
            elif not missing and self._warned:
                log.info("checkpoint upload to %s works again", self.remote_prefix)
                self._warned = False

    def _store(self) -> tuple[Any, str]:
        if self._fs is None:
            self._fs, _ = open_store(self.url, self.options)
            self._prefix = self._fs._strip_protocol(self.remote_prefix)
        return self._fs, self._prefix

    def _retry(self, what: str, fn: Callable[[], Any]) -> Any:
        return with_retries(what, fn, stopping=self._closing)

    def _pass(self) -> list[str]:
        """One mirror pass; returns what could not be uploaded."""
        fs, prefix = self._store()
        missing: list[str] = []
        last = self.model_dir / "last"
        step = None
        if (last / COMPLETE).exists():
            try:
                described = (last / MANIFEST).read_bytes()
                manifest = json.loads(described)
                step, files = int(manifest["step"]), list(manifest["files"])
            except (OSError, ValueError, KeyError, TypeError):
                step = None  # rotated away meanwhile: the next request uploads the new one
            if step is not None:
                self._current = f"model/last (step {step})"
                if not self._upload_unit(fs, last, f"{prefix}/step_{step}", described, files, [MANIFEST, COMPLETE]):
                    self._wake.set()  # replaced while uploading: the newer one goes next
                    step = None  # and no older remote step is pruned before it is complete
        local_weights = self._local_weights()
        self._seen |= local_weights
        for name in sorted(local_weights):
            try:
                described = (self.model_dir / f"{name}.json").read_bytes()
                record = json.loads(described)
                record["files"][name]
                local_step = record.get("step")
            except (OSError, ValueError, KeyError, TypeError):
                continue  # no sidecar yet: uploaded with the next request
            self._current = f"model/{name}"
            if name == BEST and _newer_remote(fs, f"{prefix}/{name}.json", local_step):
                continue  # a later life of the run's best: never replaced by an older one
            if not self._upload_unit(fs, self.model_dir, prefix, described, [name], [f"{name}.json"]):
                self._wake.set()
        if not missing:
            self._current = "removing what the local retention removed"
            self._prune(fs, prefix, step, local_weights)
        self._current = ""
        return missing

    def _local_weights(self) -> set[str]:
        return {p.name for p in self.model_dir.glob("*.pth") if is_mirrored_weights(p.name)}

    def _upload_unit(self, fs: Any, local: Path, remote: str, described: bytes, files: list[str],
                     markers: list[str]) -> bool:
        """Upload ``files`` of ``local``, each sha256 read back and checked against ``described``
        (the manifest or sidecar bytes read once, before), then ``markers`` in order: ``described``
        as ``markers[0]``, an empty ``.complete`` after it. True when the remote has it complete;
        False when a newer save replaced the local copy while it was uploading (rotation).

        Raises:
            OSError, or the filesystem's own errors: the store failed beyond the retries.
        """
        sums = json.loads(described)["files"]
        contents = [described] + [b""] * (len(markers) - 1)
        marker = f"{remote}/{markers[-1]}"
        if fs.exists(marker) and fs.cat_file(marker) == contents[-1]:
            return True

        def put(rel: str) -> None:
            src, dst = local / rel, f"{remote}/{rel}"
            self._retry(dst, lambda: fs.put_file(str(src), dst))
            got = self._retry(dst, lambda: sha256_remote(fs, dst))
            if got != sums[rel]["sha256"]:
                raise OSError(f"{dst}: sha256 after upload {got[:12]} does not match the manifest")
            point("remote.file_uploaded", dst)

        # a marker left by an earlier attempt would make a half-replaced unit look complete
        for m in markers:
            if fs.exists(f"{remote}/{m}"):
                self._retry(remote, lambda m=m: fs.rm_file(f"{remote}/{m}"))
        try:
            with ThreadPoolExecutor(self.concurrency, thread_name_prefix="pimm-upload-file") as pool:
                for f in [pool.submit(put, rel) for rel in files]:
                    f.result()
        except OSError:
            try:
                replaced = (local / markers[0]).read_bytes() != described
            except FileNotFoundError:
                replaced = True
            if replaced:
                return False  # its files now hold a newer save's bytes, not the manifest's
            raise
        point("remote.step_markers" if markers[-1] == COMPLETE else "remote.sidecar", remote)
        for rel, data in zip(markers, contents):  # the marker last
            self._retry(remote, lambda rel=rel, data=data: fs.pipe_file(f"{remote}/{rel}", data))
        return True

    def _prune(self, fs: Any, prefix: str, step: int | None, local_weights: set[str]) -> None:
        """Remove from the remote what the local retention removed: the ``step_<N>/`` older than
        ``step`` once ``step`` is complete there (a newer one, left by a later life of the run whose
        ``model/`` this node does not hold, is kept), and the weights files a pass saw locally that are gone now."""
        fs.invalidate_cache()
        for entry in fs.ls(prefix, detail=False) if fs.exists(prefix) else []:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            m = STEP_RE.match(name)
            if m and step is not None and int(m.group(1)) < step:  # never one newer than model/last
                self._retry(entry, lambda e=entry: fs.rm(e, recursive=True))
            base = name[:-5] if name.endswith(".pth.json") else name
            if base in local_weights:
                continue
            seen_go = bool(ITER_RE.match(base) or BEST_K_RE.match(base)) and base in self._seen
            if seen_go or self._retention_dropped(base, local_weights):
                self._retry(entry, lambda e=entry: fs.rm_file(e))

    def _retention_dropped(self, name: str, local_weights: set[str]) -> bool:
        """``iter_<step>.pth`` older than each of the ``keep_iter`` newest in ``model/``: the local retention
        dropped it (in an earlier session of this run: a crash came before the mirror removed it
        remotely). One newer than those (a later life of the run on another node) is kept."""
        m = ITER_RE.match(name)
        if m is None or not self.keep_iter:
            return False
        held = sorted(int(k.group(1)) for n in local_weights if (k := ITER_RE.match(n)))
        return len(held) >= self.keep_iter and int(m.group(1)) < held[-self.keep_iter]


def _newer_remote(fs: Any, sidecar: str, local_step: Any) -> bool:
    """True when the remote weights file described by ``sidecar`` records a step after ``local_step``."""
    try:
        step = json.loads(fs.cat_file(sidecar)).get("step") if fs.exists(sidecar) else None
    except (ValueError, AttributeError, FileNotFoundError):
        return False
    return isinstance(step, int) and isinstance(local_step, int) and step > local_step
