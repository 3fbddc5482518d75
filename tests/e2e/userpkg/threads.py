"""User code that keeps native threads entering Python, as C extensions do (a logger's or
exporter's callback thread, a tokenizer pool calling back): each ``pthread_create`` below runs
a ctypes callback, so CPython creates and destroys a thread state for it under its runtime
lock (``PyGILState_Ensure``/``Release``), without the GIL. A process forked while one of
them holds that lock deadlocks in ``PyOS_AfterFork_Child`` (issue #28).

``churning_mlp``: a small MLP, built while such threads run for the rest of the process (and,
with ``cache_filler``, a thread holding the lock of :func:`cached_digits`' cache).
"""

from __future__ import annotations

import ctypes
import threading

_libc = ctypes.CDLL(None)
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


@_CALLBACK
def _enter_python(_arg):
    return None


def _churn(stop: threading.Event) -> None:
    tid = ctypes.c_ulong()
    while not stop.is_set():
        if _libc.pthread_create(ctypes.byref(tid), None, _enter_python, None) == 0:
            _libc.pthread_join(tid, None)


def start_native_churn(threads: int = 2) -> threading.Event:
    """Start ``threads`` daemon threads, each creating native threads that enter Python until
    the returned event is set."""
    stop = threading.Event()
    for i in range(threads):
        threading.Thread(target=_churn, args=(stop,), name=f"user-native-churn-{i}", daemon=True).start()
    return stop


def churning_mlp(in_features: int = 64, hidden: int = 32, classes: int = 10, churn_threads: int = 2,
                 cache_filler: bool = False):
    from torch import nn

    start_native_churn(churn_threads)
    if cache_filler:
        start_cache_filler()
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


# A cache shared by the main process's filler thread and the dataset's __getitem__, under one
# lock (a prefetching cache, a connection pool): a worker forked while the filler holds the lock
# inherits it held, by a thread that does not exist in the child.
_cache_lock = threading.Lock()


def _fill_cache(stop: threading.Event) -> None:
    import time

    while not stop.is_set():
        with _cache_lock:
            time.sleep(0.05)  # filling: the lock is held most of the time
        time.sleep(0.001)


def start_cache_filler() -> threading.Event:
    """Start the main process's filler thread (daemon), until the returned event is set."""
    stop = threading.Event()
    threading.Thread(target=_fill_cache, args=(stop,), name="user-cache-filler", daemon=True).start()
    return stop


class CachedRange:
    """A map-style dataset of ``n`` items ``(index, pid of the worker's parent)``, each read under the cache lock."""

    def __init__(self, n: int = 16):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import os

        import torch

        with _cache_lock:
            return torch.tensor(i), torch.tensor(os.getppid())


class _UnderCacheLock:
    """A map-style dataset read under the cache lock (``(x, y, index)`` items of ``inner``)."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        with _cache_lock:
            return self.inner[i]


def cached_digits(val_fraction: float = 0.2):
    """The bundled digits, the train split read under the cache lock that the main process's
    filler thread (started by :func:`churning_mlp` with ``cache_filler=True``) holds most of the time."""
    from pimm_core.data.loaders import Datasets, digits

    d = digits(val_fraction=val_fraction)
    return Datasets(_UnderCacheLock(d.train), d.val, fingerprint=d.fingerprint)
