"""What a step of a 2-rank DDP run (torchrun, gloo) waits for, and where a stop lands.

A collective waits for the last rank to arrive; on a machine whose cores are shared the ranks
are not always scheduled at once, so at a small model each one costs more than the arithmetic.
A step without ``on_step_end`` callbacks makes two: DDP's gradient all-reduce and one small
all-reduce that carries the window's loss and count with the stop agreement's flags
(counted from torch's profiler, whose events name each gloo collective). The stop guarantees
stay: a request from one rank's ``on_step_end`` callback stops both ranks at that step, and a
request on one rank during a window (before its all-reduce) stops both at the end of that
window.

The three runs are jobs of one ``torchrun --nproc-per-node 2`` (this file is its script, see
the end): one start of two ranks for all of them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import REPO, TORCHRUN, clean_env, describe, hang_s

USERPKG = Path(__file__).resolve().parent / "userpkg"

CONFIG = """\
objective = "classification"
[data]
target = "userpkg.data:indexed"
batch_size = 4
num_workers = 0
[data.args]
train = 64
val = 8
[model]
target = "pimm_core.models:mlp"
[model.args]
hidden = 16
dropout = 0.0
[train]
epochs = 1
max_steps = 8
warmup_steps = 0
scheduler = "constant"
log_every_steps = 1000
[eval]
every_epochs = 0
metric = "val/loss"
mode = "min"
"""

#: The forwards (counted from 1) between which the profiler records: steps 3, 4 and 5 whole.
PROFILED = (3, 6)
JOBS = ("count", "rank1_callback", "rank1_request")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """Every job at 2 ranks, by one torchrun: ``{job: [rank 0's result, rank 1's]}``."""
    root = tmp_path_factory.mktemp("collectives")
    (root / "userpkg").symlink_to(USERPKG)  # beside the config: found through its directory
    (root / "c.toml").write_text(CONFIG)
    r = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2",
                        __file__, str(root)], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                       timeout=hang_s(300))
    assert r.returncode == 0, describe(r)
    return {job: [json.loads((root / f"{job}.rank{rank}.json").read_text()) for rank in (0, 1)] for job in JOBS}


def test_a_step_makes_two_collectives_the_gradients_and_one_small_all_reduce(results):
    steps = PROFILED[1] - PROFILED[0]
    for rank, got in enumerate(results["count"]):
        assert got["collectives"] == {"gloo:all_reduce": 2 * steps}, (rank, got)
        assert got["step"] == 8 and got["stop_reason"] is None


def test_a_stop_asked_by_one_ranks_callback_stops_both_at_that_step(results):
    assert [(r["step"], r["stop_reason"]) for r in results["rank1_callback"]] == [(3, "rank 1 callback")] * 2


def test_a_stop_asked_on_one_rank_during_a_window_stops_both_at_its_end(results):
    assert [(r["step"], r["stop_reason"]) for r in results["rank1_request"]] == [(4, "rank 1 request")] * 2


def _forward_hook(model, at: dict[int, object]):
    """Call ``at[n]()`` before the model's ``n``-th forward (counted from 1)."""
    seen = [0]

    def hook(module, args):
        seen[0] += 1
        if seen[0] in at:
            at[seen[0]]()
    model.register_forward_pre_hook(hook)


def _run(root: Path) -> int:
    """Each rank under torchrun: train every job in turn, in one process group; write its result."""
    from collections import Counter

    import torch

    from pimm_core import Trainer, load_config
    from pimm_core.checkpoint.tensors.state import unwrap
    from pimm_core.launch import setup_logging
    from pimm_core.process import dist

    info = dist.env_world()
    setup_logging(info.is_main)
    try:
        for job in JOBS:
            config = root / "c.toml"
            trainer = Trainer(load_config(config, []), run_dir=root / job, config_path=config)
            model = unwrap(trainer.model)
            result: dict = {}
            if job == "count":
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

                def stop_profiling() -> None:
                    prof.stop()
                    result["collectives"] = dict(Counter(e.name for e in prof.events() if e.name.startswith("gloo:")))
                _forward_hook(model, {PROFILED[0]: prof.start, PROFILED[1]: stop_profiling})
            elif job == "rank1_callback" and info.rank == 1:  # (rank 0 has no callback at all)
                trainer.callbacks.append(lambda tr: tr.stop.request("rank 1 callback")
                                         if tr.state.global_step == 3 else None)
            elif job == "rank1_request" and info.rank == 1:  # during step 4's window, no callback anywhere
                _forward_hook(model, {4: lambda: trainer.stop.request("rank 1 request")})
            trainer.train()
            result.update(step=trainer.state.global_step, stop_reason=trainer.state.stop_reason)
            (root / f"{job}.rank{info.rank}.json").write_text(json.dumps(result))
    finally:
        dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(_run(Path(sys.argv[1])))
