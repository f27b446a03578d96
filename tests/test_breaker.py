"""Circuit breaker (mtaqueue.policy.breaker)."""

from __future__ import annotations

import math

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mtaqueue.policy.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker

FAILURES, WINDOW, COOLDOWN, COOLDOWN_MAX = 3, 60.0, 30.0, 200.0


@pytest.fixture
def breaker() -> CircuitBreaker:
    return CircuitBreaker(FAILURES, WINDOW, COOLDOWN, COOLDOWN_MAX)


def trip(breaker: CircuitBreaker, now: float) -> None:
    for _ in range(FAILURES):
        breaker.failure(now)
    assert breaker.state(now) == OPEN


def test_closed_allows_everything(breaker):
    assert breaker.state(0.0) == CLOSED
    assert all(breaker.allow(0.0) for _ in range(100))
    assert breaker.wait(0.0) == 0
    assert (breaker.reopen_at, breaker.trips) == (None, 0)


def test_a_burst_within_the_window_opens_it(breaker):
    breaker.failure(0.0)
    breaker.failure(30.0)
    assert breaker.state(30.0) == CLOSED
    breaker.failure(60.0)  # three within 60 s
    assert breaker.state(60.0) == OPEN
    assert (breaker.reopen_at, breaker.trips) == (90.0, 1)
    assert not breaker.allow(60.0)
    assert breaker.wait(70.0) == 20.0


def test_scattered_failures_do_not(breaker):
    for now in (0.0, 40.0, 80.0, 120.0, 160.0):  # never three within a minute
        breaker.failure(now)
    assert breaker.state(160.0) == CLOSED


def test_a_success_starts_the_count_over(breaker):
    breaker.failure(0.0)
    breaker.failure(1.0)
    breaker.success(2.0)
    breaker.failure(3.0)
    breaker.failure(4.0)
    assert breaker.state(4.0) == CLOSED
    breaker.failure(5.0)
    assert breaker.state(5.0) == OPEN


def test_failures_while_open_are_the_same_outage(breaker):
    trip(breaker, 0.0)
    for now in range(1, 20):
        breaker.failure(float(now))  # connections that were in flight
    assert (breaker.reopen_at, breaker.trips) == (30.0, 1)


def test_a_success_while_open_changes_nothing(breaker):
    trip(breaker, 0.0)
    breaker.success(10.0)
    assert breaker.state(10.0) == OPEN


def test_trip_opens_it_at_once_and_counts_once_while_open(breaker):
    breaker.trip(0.0)  # a failure every attempt would repeat (refused credentials)
    assert breaker.state(0.0) == OPEN and breaker.reopen_at == COOLDOWN
    breaker.trip(5.0)
    assert (breaker.reopen_at, breaker.trips) == (COOLDOWN, 1)
    assert breaker.allow(COOLDOWN)  # the probe
    breaker.trip(COOLDOWN + 1)  # refused again: open for longer
    assert (breaker.reopen_at, breaker.trips) == (COOLDOWN + 1 + 2 * COOLDOWN, 2)


def test_half_open_allows_one_probe(breaker):
    trip(breaker, 0.0)
    assert breaker.state(29.9) == OPEN
    assert breaker.state(30.0) == HALF_OPEN
    assert breaker.wait(30.0) == 0
    assert breaker.allow(30.0)
    assert breaker.wait(31.0) == math.inf
    assert not breaker.allow(31.0)
    assert breaker.state(31.0) == HALF_OPEN


def test_a_successful_probe_closes_it(breaker):
    trip(breaker, 0.0)
    assert breaker.allow(30.0)
    breaker.success(31.0)
    assert breaker.state(31.0) == CLOSED
    assert (breaker.reopen_at, breaker.trips) == (None, 0)
    assert breaker.allow(31.0) and breaker.allow(31.0)


def test_a_failed_probe_opens_it_for_longer(breaker):
    trip(breaker, 0.0)
    assert breaker.allow(30.0)
    breaker.failure(35.0)
    assert breaker.state(35.0) == OPEN
    assert (breaker.reopen_at, breaker.trips) == (95.0, 2)


def test_the_cooldown_doubles_up_to_the_maximum(breaker):
    trip(breaker, 0.0)
    cooldowns = [breaker.reopen_at - 0.0]
    for _ in range(5):
        now = breaker.reopen_at
        assert breaker.allow(now)
        breaker.failure(now)
        cooldowns.append(breaker.reopen_at - now)
    assert cooldowns == [30, 60, 120, 200, 200, 200]
    assert breaker.trips == 6


def test_closing_forgets_the_trips(breaker):
    trip(breaker, 0.0)
    breaker.allow(30.0)
    breaker.failure(30.0)  # second trip: 60 s
    breaker.allow(90.0)
    breaker.success(90.0)
    trip(breaker, 100.0)
    assert (breaker.reopen_at, breaker.trips) == (130.0, 1)


def test_a_probe_that_never_reports_is_taken_as_lost(breaker):
    trip(breaker, 0.0)
    assert breaker.allow(30.0)
    assert not breaker.allow(59.0)
    assert breaker.allow(60.0)  # a whole cooldown without a word: probe again
    assert not breaker.allow(61.0)


def test_a_long_streak_does_not_overflow():
    breaker = CircuitBreaker(1, 0.0, 1.0, 1e9)
    now = 0.0
    for _ in range(2000):
        breaker.failure(now)
        now = breaker.reopen_at
        breaker.allow(now)
    assert breaker.reopen_at - now <= 1e9


def test_invalid_arguments():
    with pytest.raises(ValueError):
        CircuitBreaker(0, WINDOW, COOLDOWN, COOLDOWN_MAX)


class Breaker(RuleBasedStateMachine):
    """Random failures, successes, probes and time: the transitions stay as documented."""

    def __init__(self) -> None:
        super().__init__()
        self.breaker = CircuitBreaker(FAILURES, WINDOW, COOLDOWN, COOLDOWN_MAX)
        self.now = 0.0
        self.cooldowns: list[float] = []  # of the current run of trips
        self.probes = 0  # allowed since the breaker went half-open

    def _observe(self, before: tuple[float | None, int]) -> None:
        reopen_at, trips = self.breaker.reopen_at, self.breaker.trips
        if trips == 0:
            self.cooldowns = []
        elif (reopen_at, trips) != before:  # tripped
            assert trips == before[1] + 1
            self.cooldowns.append(reopen_at - self.now)
            self.probes = 0

    @rule()
    def failure(self):
        before = (self.breaker.reopen_at, self.breaker.trips)
        state = self.breaker.state(self.now)
        self.breaker.failure(self.now)
        if state == OPEN:
            assert (self.breaker.reopen_at, self.breaker.trips) == before
        if state == HALF_OPEN:
            assert self.breaker.state(self.now) == OPEN
        self._observe(before)

    @rule()
    def success(self):
        before = (self.breaker.reopen_at, self.breaker.trips)
        state = self.breaker.state(self.now)
        self.breaker.success(self.now)
        expected = {CLOSED: CLOSED, OPEN: OPEN, HALF_OPEN: CLOSED}[state]
        assert self.breaker.state(self.now) == expected
        self._observe(before)

    @rule()
    def allow(self):
        state = self.breaker.state(self.now)
        allowed = self.breaker.allow(self.now)
        if state == CLOSED:
            assert allowed
        if state == OPEN:
            assert not allowed
        if state == HALF_OPEN and allowed:
            self.probes += 1
            # One probe per cooldown at most, even when probes go unreported.
            since = self.now - self.breaker.reopen_at
            assert self.probes <= 1 + since // self.cooldowns[-1]

    @rule(seconds=st.sampled_from([0.5, 5.0, 19.0, 30.0, 61.0, 200.0]))
    def wait(self, seconds):
        self.now += seconds

    @invariant()
    def consistent(self):
        state = self.breaker.state(self.now)
        assert (state == CLOSED) == (self.breaker.reopen_at is None) == (self.breaker.trips == 0)
        wait = self.breaker.wait(self.now)
        if state == OPEN:
            assert 0 < wait <= COOLDOWN_MAX
        elif state == CLOSED:
            assert wait == 0

    @invariant()
    def cooldowns_grow_and_are_capped(self):
        assert all(COOLDOWN <= c <= COOLDOWN_MAX for c in self.cooldowns)
        assert self.cooldowns == sorted(self.cooldowns)
        assert len(self.cooldowns) == self.breaker.trips


TestBreaker = Breaker.TestCase


def test_probe_opens_the_door_for_one_connection(breaker):
    trip(breaker, 0.0)
    assert breaker.wait(1.0) == pytest.approx(COOLDOWN - 1.0)
    breaker.probe(1.0)  # an operator's flush: no waiting out the cooldown
    assert breaker.state(1.0) == HALF_OPEN
    assert breaker.allow(1.0)
    assert not breaker.allow(1.0)  # one probe, not a storm
    breaker.failure(2.0)  # still down: open again, for the next cooldown
    assert breaker.state(2.0) == OPEN and breaker.wait(2.0) == pytest.approx(2 * COOLDOWN)


def test_probe_of_a_closed_breaker_lets_one_through_and_closes_on_success(breaker):
    breaker.probe(0.0)
    assert breaker.allow(0.0) and not breaker.allow(0.0)
    assert breaker.wait(0.0) == math.inf  # until the probe reports
    breaker.success(1.0)
    assert breaker.state(1.0) == CLOSED and breaker.trips == 0
    assert all(breaker.allow(1.0) for _ in range(10))


def test_a_failed_probe_of_a_closed_breaker_opens_it_for_the_base_cooldown(breaker):
    breaker.probe(0.0)
    assert breaker.allow(0.0)
    breaker.failure(1.0)
    assert breaker.state(1.0) == OPEN and breaker.wait(1.0) == pytest.approx(COOLDOWN)
