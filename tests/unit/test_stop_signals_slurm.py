"""Inside a Slurm job SIGUSR1 (what ``sbatch --signal=B:USR1@N`` sends) is a stop signal by default;
elsewhere the default stays SIGINT, SIGTERM, SIGHUP; a list set in the config is taken as it is."""

from __future__ import annotations

import signal

from pimm_core.config import TrainConfig
from pimm_core.process.stop import STOP_SIGNALS, configured_signals, signals_from_env


def test_sigusr1_is_a_default_stop_signal_inside_a_slurm_job_only(monkeypatch) -> None:
    default = TrainConfig().stop_signals
    monkeypatch.delenv("PIMM_STOP_SIGNALS", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert configured_signals(default) == STOP_SIGNALS and signals_from_env() == STOP_SIGNALS
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert configured_signals(default) == (*STOP_SIGNALS, signal.SIGUSR1)
    assert signals_from_env() == (*STOP_SIGNALS, signal.SIGUSR1)  # a launcher's start-up, before its config
    assert configured_signals(["SIGINT", "SIGTERM"]) == (signal.SIGINT, signal.SIGTERM)  # as set
    assert configured_signals(["SIGTERM", "SIGUSR2"]) == (signal.SIGTERM, signal.SIGUSR2)
    assert TrainConfig().requeue is None  # unset: requeue after SIGUSR1 or the time limit (launch/requeue.py)


def test_requeue_true_asks_slurm_after_any_stop_signal_and_unset_only_after_sigusr1(tmp_path, monkeypatch, capsys):
    """``train.requeue = true`` requeues after a SIGTERM stop too; unset, only after SIGUSR1 or the time limit (the
    real Slurm job of tests/e2e/test_slurm.py covers unset + SIGUSR1). No ``scontrol`` on PATH here: the asked-for
    requeue fails in one ``error:`` line, exit 1, so this never requeues a real job."""
    import json

    from pimm_core.config import Config
    from pimm_core.launch.requeue import requeue_if_asked

    (tmp_path / "status.json").write_text(json.dumps({"state": "stopped", "stop_reason": "signal:SIGTERM"}))
    monkeypatch.setenv("SLURM_JOB_ID", "424242")
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    cfg = Config()
    assert cfg.train.requeue is None
    assert requeue_if_asked(cfg, tmp_path) == 0  # scancel's SIGTERM: a cancelled job stays cancelled
    assert capsys.readouterr() == ("", "")
    cfg.train.requeue = True
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}
    try:  # (it ignores the stop signals before it asks Slurm: put this process's handlers back)
        assert requeue_if_asked(cfg, tmp_path) == 1
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    out, err = capsys.readouterr()
    assert err.startswith("error: train.requeue: scontrol requeue 424242 failed: ") and len(err.splitlines()) == 1, err
