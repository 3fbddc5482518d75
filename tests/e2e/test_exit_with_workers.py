"""A Python program that trained with DataLoader workers exits promptly even when its
Trainer is still referenced at exit (a global, a reference cycle). The workers ignore
SIGTERM (the main process decides when to stop), so multiprocessing's exit handler, which
SIGTERMs daemon children and then joins them, used to wait forever."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from _helpers import REPO, clean_env, hang_s

SCRIPT = textwrap.dedent("""
    from pimm_core import Trainer, load_config

    cfg = load_config("configs/digits.toml", ["train.epochs=1", "train.max_steps=2", "data.num_workers=2"])
    trainer = Trainer(cfg)
    trainer.train()
    trainer.itself = trainer  # a cycle: only the garbage collector could free it, and it does not run at exit
    print("trained", flush=True)
""")


def test_program_with_a_live_trainer_and_workers_exits():
    try:
        r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                           timeout=hang_s(120))
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the program hung at exit\n{(e.stdout or b'')[-2000:]!r}") from None
    assert r.returncode == 0 and "trained" in r.stdout, r.stderr[-3000:]
