"""``Trainer(...).train()`` from a host program: train.log and console progress like the CLI,
without configuring the host's root logger."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from _helpers import DIGITS, REPO, clean_env, hang_s


def test_python_api_logs_like_the_cli_and_leaves_root_logger_alone(tmp_path):
    script = textwrap.dedent(f"""
        import logging
        from pathlib import Path
        from pimm_core import Trainer, load_config

        run = Path({str(tmp_path / "run")!r})
        cfg = load_config({str(DIGITS)!r}, ["train.epochs=1", "train.max_steps=12", "train.log_every_steps=5"])
        Trainer(cfg, run_dir=run).train(checkpoint_dir=run / "model")
        root, pimm = logging.getLogger(), logging.getLogger("pimm")
        print("ROOT", root.handlers, logging.getLevelName(root.level))
        print("PIMM", pimm.handlers, logging.getLevelName(pimm.level), pimm.propagate)
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                       timeout=hang_s(180))
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    # progress on the console, as the CLI prints it (stdout is not a terminal: plain periodic lines)
    assert any("step 5/12 epoch 0 iter 5 loss" in line for line in out), r.stdout
    assert any(f"saved {tmp_path / 'run' / 'model' / 'last'} (step 12" in line for line in out), r.stdout
    log = (tmp_path / "run" / "train.log").read_text()
    assert "INFO step 10/12 epoch 0 iter 10 loss" in log and "INFO saved" in log
    # the host's logging is as it was: no handler on the root logger, pimm's logger back to unconfigured
    assert "ROOT [] WARNING" in out and "PIMM [] NOTSET True" in out, r.stdout
