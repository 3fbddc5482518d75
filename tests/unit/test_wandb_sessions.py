"""A resume that starts in the same second as the run's previous W&B session gets a directory
``offline-run-<time>-<id>-1``: its steps count as held (else they would be logged twice), and
another run's directories do not."""

from __future__ import annotations

from pathlib import Path

from pimm_core.train.wandb_sink import session_logs


def test_every_session_of_the_run_and_no_other_run(tmp_path: Path) -> None:
    names = ["offline-run-20261202_100000-abc", "offline-run-20261202_100000-abc-1", "run-20261202_100500-abc",
             "offline-run-20261202_100000-xabc", "offline-run-20261202_100000-abcd"]
    for name in names:
        (tmp_path / "wandb" / name).mkdir(parents=True)
        (tmp_path / "wandb" / name / "run-abc.wandb").write_bytes(b"")
    got = [f.parent.name for f in session_logs(tmp_path, "abc")]
    assert got == ["offline-run-20261202_100000-abc", "offline-run-20261202_100000-abc-1", "run-20261202_100500-abc"]
