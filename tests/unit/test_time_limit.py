"""The wall-clock budget's decisions (pimm_core/process/time_limit.py) and the stop-signal names
(pimm_core/stop.parse_signals), in process, against a clock the test moves."""

from __future__ import annotations

import signal

import pytest

from pimm_core.config import load_config
from pimm_core.errors import ConfigError
from pimm_core.process.stop import StopRequest, parse_signals
from pimm_core.process.time_limit import MARGIN_S, SAVE_FACTOR, TimeLimit, parse_duration, scheduler_end

DIGITS = "configs/digits.toml"


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("text, seconds", [(90, 90.0), (1.5, 1.5), ("01:30:00", 5400.0), ("1:02:03", 3723.0),
                                           ("05:30", 330.0), ("2-00", 172800.0), ("1-01:30", 91800.0),
                                           ("1-00:00:10", 86410.0)])
def test_durations_read_like_slurm_time(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["90", "1h", "", "-1", 0, -5, "00:00:00", "1:2:3:4"])
def test_bad_durations_are_refused(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_no_limit_never_stops():
    clock = Clock()
    limit = TimeLimit(None, None, clock=clock)
    clock.now += 10**9
    assert limit.reason(1000.0) is None


def test_stops_at_the_first_step_that_leaves_less_than_the_reserve():
    clock = Clock()
    limit = TimeLimit(100.0, None, clock=clock)  # ends at 1100
    save_s, step_s = 20.0, 2.0
    reserve = SAVE_FACTOR * save_s + step_s + MARGIN_S  # 42 s
    assert limit.reserve(save_s, step_s) == reserve
    steps = 0
    while (reason := limit.reason(save_s)) is None:
        clock.now += step_s
        steps += 1
    left = limit.end - clock.now
    assert left < reserve <= left + step_s  # the step before still left the reserve
    assert reason.startswith("time limit: train.max_time")
    assert steps == 30  # 1000 -> 1060: 40 s left < 42 s


def test_a_longer_save_stops_earlier():
    clock = Clock()
    short, long_ = TimeLimit(300.0, None, clock=clock), TimeLimit(300.0, None, clock=clock)  # end at 1300
    clock.now = 1199.0
    short.reason(None), long_.reason(None)
    clock.now = 1200.0  # a one-second step, 100 s left
    assert short.reason(10.0) is None  # reserve 1.5 * 10 + 1 + 10 = 26 s
    assert long_.reason(70.0) is not None  # reserve 1.5 * 70 + 1 + 10 = 116 s


def test_the_scheduler_end_time_wins_when_earlier():
    clock = Clock()
    limit = TimeLimit(3600.0, clock.now + 60.0, clock=clock)
    assert limit.end == clock.now + 60.0 and limit.name == "SLURM_JOB_END_TIME"
    clock.now += 45.0  # 15 s left, reserve 45 + 10 s
    assert limit.reason(None).startswith("time limit: SLURM_JOB_END_TIME")
    assert TimeLimit(30.0, clock.now + 60.0, clock=clock).name == "train.max_time"


@pytest.mark.parametrize("value, end", [("1796166040", 1796166040.0), ("0", None), ("", None), ("soon", None)])
def test_scheduler_end_from_the_environment(value, end):
    assert scheduler_end({"SLURM_JOB_END_TIME": value}) == end
    assert scheduler_end({}) is None


def test_signal_names():
    assert parse_signals(["SIGINT", "usr1", "SIGUSR1", "TERM"]) == (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM)
    for bad in (["SIGKILL"], ["STOP"], ["SIGFOO"], ["1"]):
        with pytest.raises(ValueError):
            parse_signals(bad)


@pytest.mark.parametrize("override, message", [
    ('train.stop_signals=["SIGKILL"]', "train.stop_signals: SIGKILL cannot be caught"),
    ('train.stop_signals=["SIGFOO"]', "train.stop_signals: 'SIGFOO' is not a signal name"),
    ("train.stop_signals=[]", "train.stop_signals is empty"),
    ('train.max_time="90"', "train.max_time: '90' is not a duration"),
    ("train.max_time=-1", "train.max_time: -1.0 is not a positive duration"),
    ("train.max_time=true", "train.max_time must be a number or a string"),
])
def test_config_refuses_bad_values(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_config(DIGITS, [override])


def test_config_defaults_and_values():
    c = load_config(DIGITS)
    assert c.train.stop_signals == ["SIGINT", "SIGTERM", "SIGHUP"] and c.train.max_time is None
    c = load_config(DIGITS, ['train.stop_signals=["SIGTERM","SIGUSR1"]', 'train.max_time="00:10:00"'])
    assert parse_signals(c.train.stop_signals) == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_duration(c.train.max_time) == 600.0


def test_catch_only_changes_the_caught_signals():
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGHUP)
    stop = StopRequest()
    with stop.catch_signals((signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
        stop.catch_only((signal.SIGINT, signal.SIGTERM, signal.SIGUSR1))
        assert signal.getsignal(signal.SIGHUP) == before[1]  # no longer named: its old handler back
        signal.raise_signal(signal.SIGUSR1)
        assert stop.reason == "signal:SIGUSR1"
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGHUP)) == before
