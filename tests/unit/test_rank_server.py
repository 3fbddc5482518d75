"""The ranks' fork server (pimm_core/launch/rank_start.py) imports torch without touching CUDA: a process
forked after CUDA's initialization cannot use CUDA, so a preload that initialized it would break every
rank on a GPU node."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_SPY = """
import importlib, json, torch
calls = []
for name in ("_cuda_init", "_cuda_getDeviceCount", "_cuda_getDevice", "_cuda_setDevice"):
    real = getattr(torch._C, name, None)
    if real is not None:  # (a torch built without CUDA has none of them)
        setattr(torch._C, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
from pimm_core.launch.rank_start import PRELOAD
for module in PRELOAD:
    importlib.import_module(module)
print(json.dumps({"calls": calls, "initialized": torch.cuda.is_initialized(), "preload": PRELOAD}))
"""


def test_the_rank_servers_preload_leaves_cuda_alone():
    out = subprocess.run([sys.executable, "-c", _SPY], capture_output=True, text=True, check=True, timeout=300)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert "torch._dynamo" in seen["preload"]  # (what torch.optim would import in every rank)
    assert seen["calls"] == [] and seen["initialized"] is False, seen


def test_a_server_that_cannot_start_leaves_the_ranks_to_start_as_python_m(tmp_path):
    # multiprocessing puts the server's socket under $TMPDIR; a socket path has at most 107 bytes
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    code = ("from pimm_core.launch.rank_start import rank_server\n"
            "with rank_server(True) as forked:\n"
            "    print('forked', forked)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TMPDIR": str(deep)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "forked False"
    warning = out.stderr.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("warning: the ranks' fork server could not start"), warning
    assert "a shorter $TMPDIR avoids this" in warning[0]


def test_dataloader_workers_start_with_spawn_when_their_fork_server_cannot_start(tmp_path):
    # a rank's DataLoader workers: the same socket-length limit under a long $TMPDIR, one warning, workers by spawn,
    # where the workers need no socket of their own to hand their batches over (torch's file_system sharing; with
    # the default, file_descriptor, such a run is refused: tests/e2e/test_worker_start.py)
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    code = ("import logging\n"
            "logging.basicConfig(format='%(message)s')\n"
            "import torch.multiprocessing\n"
            "torch.multiprocessing.set_sharing_strategy('file_system')\n"
            "from pimm_core.data.workers import worker_context\n"
            "print(worker_context('forkserver').get_start_method(), worker_context('forkserver').get_start_method())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TMPDIR": str(deep)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["spawn", "spawn"]
    warning = out.stderr.strip().splitlines()
    assert len(warning) == 1 and "DataLoader workers start with 'spawn'" in warning[0], warning
    assert "a shorter $TMPDIR avoids this" in warning[0]
