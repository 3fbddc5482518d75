"""DataLoader workers never start as forks of a busy rank (issue #28).

A rank has threads (pimm's purge and async saves, torch's, the user's); a worker forked
while one of them holds a lock inherits that lock held forever. CPython's own runtime lock
is such a lock whenever a native thread enters Python, and the child hangs before running a
line: the run stops making progress with no error. pimm starts workers from a fork server
(``data.multiprocessing_context = "forkserver"``), and a batch that does not come in
``data.timeout`` seconds is a one-line failure rather than a wait forever.

The first tests drive pimm's train loader through short epochs (two fresh workers each)
while user code holds a lock or keeps native threads entering Python. With the old start
method (``fork``) they hung within a few hundred worker starts on this machine (the timeout
below caught it), and every epoch's workers had this process as their parent, which each test
checks: that check fails at the first epoch, hang or not, so a few epochs suffice (each costs
CPU time the churning threads spin away). They must pass every time now. The last is the
issue's scenario end to end: two ranks, many short epochs, a save (async) and a background
purge at every epoch end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from _helpers import DIGITS, REPO, clean_env, describe, hang_s, launch, read_json

sys.path.insert(0, str(Path(__file__).parent))


def _loader(ds, workers: int, timeout: float, method: str = "forkserver"):
    from pimm_core.config import DataConfig
    from pimm_core.data.loaders import train_loader
    from pimm_core.process.dist import DistInfo

    cfg = DataConfig(batch_size=2, num_workers=workers, multiprocessing_context=method, timeout=timeout)
    return train_loader(ds, cfg, DistInfo(rank=0, world_size=1, local_rank=0), seed=0)


def _epochs(loader, sampler, epochs: int) -> set[int]:
    """Iterate ``epochs`` epochs, checking each yields every item once; the workers' parent pids."""
    parents: set[int] = set()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        items = [(int(i), int(p)) for batch, ppid in loader for i, p in zip(batch, ppid)]
        assert sorted(i for i, _ in items) == list(range(len(loader.dataset))), f"epoch {epoch}: {items}"
        parents.update(p for _, p in items)
    return parents


def _assert_fork_server(parents: set[int]) -> None:
    assert os.getpid() not in parents, "a worker was forked from the training process itself"
    (server,) = parents
    cmdline = Path(f"/proc/{server}/cmdline").read_bytes().replace(b"\0", b" ")
    assert b"forkserver" in cmdline, cmdline


def test_workers_never_inherit_a_lock_another_thread_holds():
    """User code's own lock, held most of the time by a thread of the training process: a worker
    forked from it (``fork``) inherits it held and waits forever (here: the 20 s timeout)."""
    from userpkg.threads import CachedRange, start_cache_filler

    stop = start_cache_filler()
    try:
        loader, sampler = _loader(CachedRange(), workers=2, timeout=hang_s(20))
        _assert_fork_server(_epochs(loader, sampler, 10))
    finally:
        stop.set()


def test_workers_start_while_native_threads_enter_python():
    """CPython's own runtime lock, taken whenever a native thread enters Python: a fork at that
    instant hangs the child before it runs a line (a few in a thousand forks here). Each epoch's workers
    must come from the fork server (a fork of this process fails that check whether or not it hangs)."""
    from userpkg.threads import CachedRange, start_native_churn

    stop = start_native_churn(2)
    try:
        loader, sampler = _loader(CachedRange(), workers=2, timeout=hang_s(20))
        _assert_fork_server(_epochs(loader, sampler, 15))
    finally:
        stop.set()


class Stuck(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        if i == 5:
            time.sleep(3600)  # a worker that never answers (a hung read, a deadlock in user code)
        return torch.tensor(i)


def test_a_batch_that_never_comes_is_one_line_not_a_hang():
    from pimm_core.errors import TrainingError

    loader, _ = _loader(Stuck(), workers=2, timeout=3)
    with pytest.raises(TrainingError) as e:
        for _ in loader:
            pass
    assert str(e.value).startswith("rank 0: no batch from its 2 DataLoader workers in 3 s (data.timeout)"), e.value
    assert "\n" not in str(e.value)


def _local_class_dataset():
    class Local(Dataset):  # defined in a function: pickle cannot name it
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.tensor(i)
    return Local()


def test_a_dataset_the_workers_cannot_receive_is_one_config_line():
    from pimm_core.errors import ConfigError

    loader, _ = _loader(_local_class_dataset(), workers=2, timeout=hang_s(30))
    with pytest.raises(ConfigError) as e:
        next(iter(loader))
    msg = str(e.value)
    assert msg.startswith("data: the train dataset (or its collate_fn) cannot be sent to DataLoader workers"), msg
    assert "data.num_workers = 0" in msg and "\n" not in msg


def _progress(run: Path) -> tuple:
    try:
        s = json.loads((run / "status.json").read_text())
    except (OSError, ValueError):
        return ()
    return s.get("state"), s.get("step"), s.get("epoch"), s.get("iter")


# Each epoch starts fresh workers and ends with a save and a purge; the old start hung in the first.
# 12, not the 40 of before: the churning threads keep both cores busy for the whole run (issue #25).
EPOCHS = 12


def test_two_ranks_many_short_epochs_with_saves_and_purges_never_hang(tmp_path):
    """The issue's run, made harder: 12 epochs of 3 steps per rank, two fresh workers per rank
    at each, an async save and a purge of ``last.prev`` at every epoch end, evaluation at
    each, and user code in every rank with native threads entering Python and a thread
    holding the lock of the dataset's cache most of the time. With workers forked from the
    ranks (``fork``, the old start) it hangs in the first epoch. It must finish; a run whose
    status makes no progress for 120 s (a hang: an epoch takes well under a second) fails."""
    root = tmp_path / "exp"
    overrides = [f"train.epochs={EPOCHS}", "train.log_every_steps=1", "data.num_workers=2", "data.batch_size=16",
                 "checkpoint.every_epochs=1", "checkpoint.async=true", "data.target=userpkg.threads:cached_digits",
                 "data.args={val_fraction = 0.95}", "model.target=userpkg.threads:churning_mlp",
                 "model.args={hidden = 16, cache_filler = true}"]
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-m", "pimm_core.cli", "launch", "--train.config", str(DIGITS),
                             "--run.root", str(root), "--run.name", "stress", "--run.no-timestamp",
                             "--nproc-per-node", "2", "--", *overrides], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    run = root / "digits" / "stress"
    last, since = None, time.monotonic()
    try:
        while proc.poll() is None:
            now = _progress(run)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > 120:
                raise AssertionError(f"no progress for 120 s at {now}: the run hangs")
            time.sleep(0.5)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    status = read_json(run / "status.json")
    assert status["state"] == "finished" and status["epoch"] == EPOCHS, status


def test_a_dataset_defined_in_an_interactive_session_is_one_config_line():
    """A notebook's or the prompt's ``__main__`` has no file a worker could import its classes from."""
    script = ("import torch\nfrom torch.utils.data import Dataset\nfrom pimm_core.config import DataConfig\n"
              "from pimm_core.data import train_loader\nfrom pimm_core.process.dist import DistInfo\n"
              "class Mine(Dataset):\n    def __len__(self): return 4\n    def __getitem__(self, i): return torch.tensor(i)\n"
              "try:\n    train_loader(Mine(), DataConfig(batch_size=2, num_workers=2), DistInfo(), seed=0)\n"
              "except Exception as e:\n    print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable], input=script, cwd=REPO, env=clean_env(), capture_output=True, text=True,
                       timeout=hang_s(120))
    assert r.stdout.startswith("ConfigError data: the train dataset (Mine) is defined in an interactive session"), \
        describe(r)


@pytest.mark.parametrize("nproc", [None, 2])
def test_a_temporary_directory_too_deep_for_the_workers_sockets_is_one_error_line(tmp_path, nproc):
    """Seen: with $TMPDIR 80 characters deep and data.num_workers = 2, every worker died on its first batch
    (``AF_UNIX path too long`` handing the batch's tensors over) and the ranks waited for batches until
    data.timeout. Refused before the run starts, with the fix named."""
    deep = tmp_path / ("d" * 40) / ("e" * 40)
    deep.mkdir(parents=True)
    result = launch(tmp_path / "exp", "deep", "train.max_steps=2", "data.num_workers=2", nproc=nproc,
                    env={**clean_env(), "TMPDIR": str(deep)}, timeout=hang_s(120))
    assert result.returncode != 0 and "Traceback" not in result.stderr, describe(result)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "set TMPDIR to a shorter directory" in errors[0], describe(result)
    assert not (tmp_path / "exp" / "digits" / "deep").exists()
