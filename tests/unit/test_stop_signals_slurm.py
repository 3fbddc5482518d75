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
