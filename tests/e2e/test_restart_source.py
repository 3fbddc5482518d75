"""A rank that torchrun restarts (``--max-restarts``) resumes the run's own newest checkpoint, not the
``--train.resume-from`` checkpoint the launch began from: going back there would silently lose every
step the run made since (issue 35's review).

In this process (``pimm_here``), with ``TORCHELASTIC_RESTART_COUNT=1`` set as torchrun's agent sets it
for restarted ranks: the decision is made before any process-specific work, and the real restarts are
covered by tests/e2e/test_memory_tier.py.
"""

from __future__ import annotations

from _helpers import DIGITS, pimm_here, read_json

TINY = ["data.num_workers=0", "data.batch_size=256"]


def _resumes(run):
    return [(e["step"], e.get("epoch")) for e in read_json(run / "provenance.json")["starts"] if e.get("kind") == "resume"]


def test_a_restarted_rank_resumes_the_runs_own_last_not_the_resume_from_it_began_with(tmp_path):
    root = str(tmp_path)
    a = pimm_here("launch", "--train.config", DIGITS, "--run.root", root, "--run.name", "a", "--run.no-timestamp",
                  "--", "train.epochs=1", *TINY)
    assert a.returncode == 0, a.stderr
    start = tmp_path / "digits" / "a" / "model" / "last"
    assert start.is_dir(), sorted(p.name for p in start.parent.iterdir())
    b_args = ["launch", "--train.config", DIGITS, "--run.root", root, "--run.name", "b", "--run.no-timestamp",
              "--train.resume-from", str(start)]
    b = pimm_here(*b_args, "--", "train.epochs=2", *TINY)  # the launch's first attempt: from a's epoch 1 to epoch 2
    assert b.returncode == 0, b.stderr
    run = tmp_path / "digits" / "b"
    (first,) = _resumes(run)
    # the same launch's ranks restarted by torchrun (here: with one more epoch to train, so the restart has work)
    again = pimm_here(*b_args, "--", "train.epochs=3", *TINY, env={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert again.returncode == 0, again.stderr
    step = 2 * first[0]  # b's own last: epoch 2
    assert f"resuming from {run / 'model' / 'last'} at step {step}," in again.stdout, again.stdout
    assert f"recovered from disk at step {step} (restart 1;" in again.stdout, again.stdout
    assert read_json(run / "status.json")["step"] == 3 * first[0]
