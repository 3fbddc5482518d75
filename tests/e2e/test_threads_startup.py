"""``pimm launch`` chooses the intra-op threads and says so once in ``train.log``; ``train.threads``
and a user's ``OMP_NUM_THREADS`` win; and nothing a run does not use is imported before its first
step (``torch.distributed.checkpoint`` comes with the first save). The choice function itself:
tests/unit/test_threads.py."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _helpers import DIGITS, clean_env, describe, pimm
from test_user_code import USERPKG

_PROBE = """
[[callbacks]]
target = "userpkg.hooks:StartupProbe"
[callbacks.args]
out = "{out}"
modules = ["torch.distributed.checkpoint", "torch._inductor.compile_fx", "sklearn"]
"""


def test_launch_chooses_threads_says_it_once_and_imports_no_checkpoint_library_before_step_one(tmp_path):
    (tmp_path / "userpkg").symlink_to(USERPKG)  # beside the configs: found through their directory
    cases = {  # name: (environment, overrides, expected threads, expected reason in the log line)
        "auto": ({}, (), 1, "a model under 1,000,000 parameters: 1 thread"),
        "omp": ({"OMP_NUM_THREADS": "2"}, (), 2, "set by OMP_NUM_THREADS"),
        "key": ({"OMP_NUM_THREADS": "1"}, ("train.threads=2",), 2, "set by train.threads"),
    }

    def launch(name: str):
        env, overrides, _, _ = cases[name]
        config = tmp_path / f"{name}.toml"
        config.write_text(DIGITS.read_text() + _PROBE.format(out=tmp_path / f"{name}.json"))
        return pimm("launch", "--train.config", config, "--run.root", tmp_path / "exp", "--run.name", name,
                    "--run.no-timestamp", "--", "train.max_steps=1", "data.num_workers=0", *overrides,
                    env={**clean_env(one_thread=False), **env})

    with ThreadPoolExecutor(len(cases)) as pool:  # three independent 1-step runs at once
        results = dict(zip(cases, pool.map(launch, cases)))
    for name, (_, _, threads, reason) in cases.items():
        result = results[name]
        assert result.returncode == 0, describe(result)
        run = tmp_path / "exp" / "digits" / name
        said = [line for line in (run / "train.log").read_text().splitlines() if "threads:" in line]
        assert len(said) == 1, said  # once
        m = re.search(r"threads: (\d+) per rank \((\d+) CPUs? usable: affinity (\d+), cgroup quota (\S+)", said[0])
        assert m and int(m.group(1)) == threads and reason in said[0], said
        assert int(m.group(2)) <= int(m.group(3))  # never more usable CPUs than the affinity mask holds
        probe = json.loads((tmp_path / f"{name}.json").read_text())
        assert probe["threads"] == threads, probe  # what torch really runs with at the first step
        # the checkpoint library, the compiler's back end and scikit-learn: none was imported by then...
        assert probe["imported"] == [], probe
        assert (run / "model" / "last" / "trainer.dcp").is_dir()  # ...and the save at the end still wrote DCP
