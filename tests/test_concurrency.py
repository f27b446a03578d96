"""Adaptive concurrency (mtaqueue.policy.concurrency)."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mtaqueue.policy.concurrency import AdaptiveConcurrency


def limits_after_successes(concurrency: AdaptiveConcurrency, count: int) -> list[int]:
    limits = []
    for _ in range(count):
        concurrency.success()
        limits.append(concurrency.limit)
    return limits


def warm(concurrency: AdaptiveConcurrency, seconds: float = 1.0, samples: int = 5) -> None:
    for _ in range(samples):
        concurrency.latency(seconds)


def test_starts_at_initial_within_bounds():
    assert AdaptiveConcurrency(2, 10, latency_factor=3).limit == 2
    assert AdaptiveConcurrency(20, 10, latency_factor=3).limit == 10
    assert AdaptiveConcurrency(0, 10, latency_factor=3).limit == 1
    with pytest.raises(ValueError):
        AdaptiveConcurrency(1, 0, latency_factor=3)


def test_grows_by_one_after_limit_successes():
    concurrency = AdaptiveConcurrency(2, 5, latency_factor=3)
    # 2 successes at 2, 3 at 3, 4 at 4, then the ceiling.
    assert limits_after_successes(concurrency, 12) == [2, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5]


def test_throttled_halves_down_to_one():
    concurrency = AdaptiveConcurrency(10, 10, latency_factor=3)
    halvings = []
    for _ in range(5):
        concurrency.throttled()
        halvings.append(concurrency.limit)
    assert halvings == [5, 2, 1, 1, 1]


def test_a_cut_restarts_the_success_count():
    concurrency = AdaptiveConcurrency(4, 10, latency_factor=3)
    limits_after_successes(concurrency, 3)  # one short of growing
    concurrency.throttled()
    assert concurrency.limit == 2
    assert limits_after_successes(concurrency, 2) == [2, 3]


def test_no_latency_cut_during_the_warm_up():
    concurrency = AdaptiveConcurrency(8, 8, latency_factor=3)
    for seconds in (0.1, 5.0, 0.1, 9.0, 0.1):
        concurrency.latency(seconds)
    assert concurrency.limit == 8
    assert concurrency.baseline == pytest.approx(2.86)


def test_a_slow_sample_is_a_throttle_signal():
    concurrency = AdaptiveConcurrency(8, 8, latency_factor=3)
    warm(concurrency)
    concurrency.latency(2.9)  # slower, but within the factor
    assert concurrency.limit == 8
    concurrency.latency(3.5)
    assert concurrency.limit == 4


def test_jitter_on_a_fast_network_is_not_throttling():
    concurrency = AdaptiveConcurrency(8, 8, latency_factor=3)
    warm(concurrency, 0.006)  # loopback or a LAN
    concurrency.latency(0.023)  # four times the baseline: a loaded machine, not the site
    assert concurrency.limit == 8
    concurrency.latency(0.5)  # a site that tarpits
    assert concurrency.limit == 4


def test_at_most_one_latency_cut_per_limit_samples():
    concurrency = AdaptiveConcurrency(8, 8, latency_factor=3)
    warm(concurrency)
    limits = []
    for _ in range(14):
        concurrency.latency(10.0)  # every connection in flight sees the slowdown
        limits.append(concurrency.limit)
    # The cut at the first sample; the 8 connections in flight then are one signal.
    assert limits == [4] * 8 + [2] * 4 + [1] * 2


def test_one_outlier_does_not_move_the_baseline_far():
    concurrency = AdaptiveConcurrency(8, 8, latency_factor=3)
    warm(concurrency)
    concurrency.latency(1000.0)
    assert concurrency.baseline < 1.1  # counted as at most 3x the baseline


def test_a_lasting_change_becomes_the_new_normal():
    concurrency = AdaptiveConcurrency(8, 8, latency_factor=3)
    warm(concurrency)
    for _ in range(200):
        concurrency.latency(4.0)
    concurrency.reset(8)
    for _ in range(20):
        concurrency.latency(4.0)
    assert concurrency.limit == 8
    assert concurrency.baseline == pytest.approx(4.0, rel=0.1)


def test_reset_ramps_from_one():
    concurrency = AdaptiveConcurrency(2, 10, latency_factor=3)
    limits_after_successes(concurrency, 30)
    concurrency.reset()
    assert concurrency.limit == 1
    assert limits_after_successes(concurrency, 6) == [2, 2, 3, 3, 3, 4]
    concurrency.reset(50)
    assert concurrency.limit == 10
    concurrency.reset(0)
    assert concurrency.limit == 1


def test_cap_moves_the_ceiling():
    concurrency = AdaptiveConcurrency(8, 10, latency_factor=3)
    concurrency.cap(3)
    assert (concurrency.limit, concurrency.maximum) == (3, 3)
    concurrency.cap(10)
    assert concurrency.limit == 3  # grows back by successes, not at once
    assert limits_after_successes(concurrency, 3) == [3, 3, 4]
    concurrency.cap(0)
    assert (concurrency.limit, concurrency.maximum) == (1, 1)


class Concurrency(RuleBasedStateMachine):
    """Random feedback against a model of the documented rules; latency only ever lowers
    the limit."""

    def __init__(self) -> None:
        super().__init__()
        self.concurrency = AdaptiveConcurrency(2, 10, latency_factor=3)
        self.limit, self.maximum, self.successes = 2, 10, 0

    @rule()
    def success(self):
        self.successes += 1
        if self.successes >= self.limit:
            self.successes = 0
            self.limit = min(self.limit + 1, self.maximum)
        self.concurrency.success()

    @rule()
    def throttled(self):
        self.limit, self.successes = max(1, self.limit // 2), 0
        self.concurrency.throttled()

    @rule(seconds=st.floats(0.001, 100))
    def latency(self, seconds):
        self.concurrency.latency(seconds)
        assert self.concurrency.limit in (self.limit, max(1, self.limit // 2))
        if self.concurrency.limit != self.limit:
            self.limit, self.successes = self.concurrency.limit, 0

    @rule(limit=st.integers(-5, 30))
    def reset(self, limit):
        self.limit, self.successes = min(max(1, limit), self.maximum), 0
        self.concurrency.reset(limit)

    @rule(maximum=st.integers(-5, 30))
    def cap(self, maximum):
        self.maximum = max(1, maximum)
        self.limit = min(self.limit, self.maximum)
        self.concurrency.cap(maximum)

    @invariant()
    def within_bounds(self):
        assert 1 <= self.concurrency.limit <= self.concurrency.maximum
        assert self.concurrency.limit == self.limit
        assert self.concurrency.maximum == self.maximum


TestConcurrency = Concurrency.TestCase
