"""A multi-node launch whose nodes never meet ends with one line naming the rendezvous and the fix: no
traceback, nothing left behind (the run never started)."""

from __future__ import annotations

from _helpers import DIGITS, clean_env, describe, free_port, pimm


def test_a_rendezvous_that_times_out_is_one_error_line(tmp_path):
    port = free_port()
    r = pimm("launch", "--train.config", DIGITS, "--run.root", tmp_path / "exp", "--run.name", "rz",
             "--run.no-timestamp", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "join_timeout=2",
             env=clean_env())
    assert r.returncode == 1, describe(r)
    assert "Traceback" not in r.stdout + r.stderr, describe(r)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: the rendezvous of the nodes at 127.0.0.1:{port} timed out: start this command on "
                      "every node (the same --rdzv-endpoint, --nnodes 2), or give them longer with --rdzv-conf "
                      "join_timeout=SECONDS"], describe(r)
    assert not (tmp_path / "exp" / "digits" / "rz").exists()  # (the run never started: nothing is left)
