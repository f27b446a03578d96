"""Throttle rules and backoff mode (mtaqueue.policy.throttle)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.config import ThrottleRule
from mtaqueue.policy.throttle import BACKOFF, NORMAL, BackoffMode, ThrottleRules

HOUR = 3600.0

# -- throttle rules -----------------------------------------------------------------------


def test_two_per_hour():
    rules = ThrottleRules([ThrottleRule(match="(?i)temporarily deferred", threshold=2)])
    line = "451 4.3.0 Temporarily deferred"
    assert not rules.hit(line, 0.0)
    assert rules.hit(line, 1800.0)
    # The count starts over after firing.
    assert not rules.hit(line, 1801.0)
    assert rules.hit(line, 1802.0)


def test_hits_outside_the_window_do_not_add_up():
    rules = ThrottleRules([ThrottleRule(match="RL0000", threshold=2, window=HOUR)])
    assert not rules.hit("421 RL0000 rate limited", 0.0)
    assert not rules.hit("421 RL0000 rate limited", HOUR + 1)
    assert rules.hit("421 RL0000 rate limited", HOUR + 2)


def test_only_matching_lines_count():
    rules = ThrottleRules([ThrottleRule(match=r"\bTS04\b", threshold=2)])
    assert not rules.hit("421 4.7.0 [TS04] Messages deferred", 0.0)
    assert not rules.hit("550 5.1.1 no such user", 1.0)
    assert not rules.hit("421 4.7.0 [TS045]", 2.0)
    assert rules.hit("421 4.7.0 [TS04] Messages deferred", 3.0)


def test_rules_count_apart():
    rules = ThrottleRules(
        [ThrottleRule(match="alpha", threshold=2), ThrottleRule(match="beta", threshold=1)]
    )
    assert not rules.hit("alpha", 0.0)
    assert rules.hit("beta", 1.0)  # threshold 1: at once
    assert rules.hit("alpha beta", 2.0)  # both fire; both start over
    assert not rules.hit("alpha", 3.0)


def test_no_rules_never_fire():
    assert not ThrottleRules([]).hit("421 4.7.0 rate limited", 0.0)


@given(st.integers(1, 5), st.lists(st.floats(0, 100), max_size=40))
def test_fires_exactly_on_every_threshold_th_hit_within_the_window(threshold, gaps):
    rules = ThrottleRules([ThrottleRule(match="x", threshold=threshold, window=1e9)])
    now, fired = 0.0, []
    for gap in gaps:
        now += gap
        fired.append(rules.hit("x", now))
    assert fired == [(i + 1) % threshold == 0 for i in range(len(gaps))]


# -- backoff mode -------------------------------------------------------------------------

DURATION, SUCCESSES = 900.0, 50


@pytest.fixture
def backoff() -> BackoffMode:
    return BackoffMode(DURATION, 0.5, 2.0, SUCCESSES)


def succeed(backoff: BackoffMode, count: int, now: float) -> None:
    for _ in range(count):
        backoff.success(now)


def test_normal_until_a_signal(backoff):
    assert backoff.stage(0.0) == 0
    assert backoff.mode(0.0) == NORMAL
    assert (backoff.rate_factor(0.0), backoff.retry_factor(0.0)) == (1.0, 1.0)


def test_a_signal_goes_to_the_deepest_stage(backoff):
    backoff.signal(100.0)
    assert backoff.stage(100.0) == 2
    assert backoff.mode(100.0) == BACKOFF
    assert backoff.rate_factor(100.0) == 0.25
    assert backoff.retry_factor(100.0) == 4.0


def test_time_steps_back_one_stage_per_duration(backoff):
    backoff.signal(0.0)
    assert [backoff.stage(t) for t in (899.0, 900.0, 1799.0, 1800.0, 1e6)] == [2, 1, 1, 0, 0]
    assert backoff.mode(1800.0) == NORMAL


def test_success_runs_step_back_too(backoff):
    backoff.signal(0.0)
    succeed(backoff, SUCCESSES - 1, 10.0)
    assert backoff.stage(10.0) == 2
    backoff.success(10.0)
    assert backoff.stage(10.0) == 1
    succeed(backoff, SUCCESSES, 20.0)
    assert backoff.stage(20.0) == 0


def test_time_and_successes_add_up(backoff):
    backoff.signal(0.0)
    succeed(backoff, SUCCESSES, 10.0)  # 2 -> 1
    assert backoff.stage(899.0) == 1
    assert backoff.stage(900.0) == 0  # and the first duration is over: normal


def test_a_new_signal_restarts(backoff):
    backoff.signal(0.0)
    succeed(backoff, SUCCESSES, 10.0)
    backoff.success(20.0)
    backoff.signal(800.0)
    assert backoff.stage(1000.0) == 2  # the clock restarted at 800
    succeed(backoff, SUCCESSES - 1, 1000.0)  # the run restarted too
    assert backoff.stage(1000.0) == 2


def test_successes_in_normal_mode_bank_nothing(backoff):
    succeed(backoff, 500, 0.0)
    backoff.signal(10.0)
    assert backoff.stage(10.0) == 2


def test_forced_backoff(backoff):
    backoff.force(5000.0)
    assert backoff.stage(0.0) == 2
    succeed(backoff, 10 * SUCCESSES, 1.0)
    assert backoff.stage(4999.0) == 2  # successes do not end an operator's backoff
    assert backoff.forced_until(4999.0) == 5000.0
    assert backoff.stage(5000.0) == 0
    assert backoff.forced_until(5000.0) is None


def test_a_signal_outlives_a_shorter_force(backoff):
    backoff.signal(0.0)
    backoff.force(100.0)
    assert backoff.stage(100.0) == 2
    assert backoff.stage(900.0) == 1


def test_clear_goes_back_to_normal(backoff):
    backoff.signal(0.0)
    backoff.force(5000.0)
    backoff.clear()
    assert backoff.stage(1.0) == 0
    backoff.signal(2.0)  # and a later signal works as usual
    assert backoff.stage(2.0) == 2


def test_more_stages_and_a_zero_duration():
    backoff = BackoffMode(60.0, 0.5, 3.0, 1, stages=3)
    backoff.signal(0.0)
    assert (backoff.stage(0.0), backoff.rate_factor(0.0), backoff.retry_factor(0.0)) == (
        3,
        0.125,
        27.0,
    )
    assert BackoffMode(0.0, 0.5, 2.0, 1).stage(0.0) == 0
    instant = BackoffMode(0.0, 0.5, 2.0, 1)
    instant.signal(0.0)
    assert instant.stage(0.0) == 0


def test_invalid_arguments():
    with pytest.raises(ValueError):
        BackoffMode(DURATION, 0.5, 2.0, 0)
    with pytest.raises(ValueError):
        BackoffMode(DURATION, 0.5, 2.0, 1, stages=0)


@given(
    st.lists(
        st.tuples(st.floats(0, 2 * DURATION), st.integers(0, 2 * SUCCESSES)),
        min_size=1,
        max_size=30,
    )
)
def test_recovery_is_monotone_and_never_slower_than_time_alone(steps):
    """After a signal, with successes sprinkled in, the stage never rises and is never
    above where time alone would have brought it."""
    backoff = BackoffMode(DURATION, 0.5, 2.0, SUCCESSES)
    backoff.signal(0.0)
    now, previous = 0.0, 2
    for gap, successes in steps:
        now += gap
        succeed(backoff, successes, now)
        stage = backoff.stage(now)
        assert stage <= previous
        assert stage <= max(0, 2 - int(now // DURATION))
        assert backoff.rate_factor(now) == 0.5**stage
        previous = stage
