"""``pimm resume --dry-run`` says what the resume will say when ``eval.metric`` or ``eval.mode``
changes: the best so far is not a value of the new selection metric, so the best starts over."""

from __future__ import annotations

from _helpers import describe, launch, pimm_here

TINY = ("train.epochs=2", "data.batch_size=256")  # 6 steps an epoch, an evaluation at each epoch end
LOSS = ("train.epochs=3", 'eval.metric="val/loss"', 'eval.mode="min"')


def _warnings(text: str, about: str) -> list[str]:
    return [line[line.index("warning: "):] for line in text.splitlines() if "warning: " in line and about in line]


def test_the_dry_run_says_the_best_starts_over_as_the_resume_does(tmp_path):
    r = launch(tmp_path, "m", *TINY, here=True)
    assert r.returncode == 0, describe(r)
    run_dir = tmp_path / "digits" / "m"

    same = pimm_here("resume", run_dir, "--dry-run", "--", "train.epochs=3")
    assert same.returncode == 0, describe(same)
    assert "selection metric changed" not in same.stdout + same.stderr

    dry = pimm_here("resume", run_dir, "--dry-run", "--", *LOSS)
    assert dry.returncode == 0, describe(dry)
    said = _warnings(dry.stdout, "selection metric changed")
    assert len(said) == 1 and "from val/acc (max) to val/loss (min)" in said[0] and "starts over" in said[0], dry.stdout
    assert "dry run: nothing was trained or written" in dry.stdout

    real = pimm_here("resume", run_dir, "--", *LOSS)
    assert real.returncode == 0, describe(real)
    assert _warnings(real.stdout + real.stderr, "selection metric changed") == said  # word for word
