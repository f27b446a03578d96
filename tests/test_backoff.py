"""Retry timing, expiry and restarts (mtaqueue.policy.backoff)."""

from __future__ import annotations

import math
import random
from itertools import pairwise

import pytest
from fake_random import HIGH, LOW
from hypothesis import assume, given
from hypothesis import strategies as st

from mtaqueue.config import RetryConfig, load
from mtaqueue.policy.backoff import (
    RetryPolicy,
    expires_before,
    expiry,
    next_attempt,
    restart_due,
    retry_delay,
)

M, H, D = 60.0, 3600.0, 86400.0
DEFAULT = RetryPolicy.from_config(RetryConfig())


def policy(schedule=(5 * M, 15 * M), then=(4 * H, 6 * H), jitter=0.0, greylist_min=5 * M):
    return RetryPolicy(tuple(schedule), then, jitter, greylist_min)


# -- configuration ------------------------------------------------------------------------


def test_from_config_defaults():
    assert RetryPolicy((300.0, 900.0, 1800.0, 3600.0), (14400.0, 21600.0), 0.1, 300.0) == DEFAULT
    assert all(type(step) is float for step in (*DEFAULT.schedule, *DEFAULT.then))


def test_from_config_overrides():
    cfg = load(None, ['retry.schedule=["1m", "2m"]', 'retry.then=["1h", "1h"]', "retry.jitter=0"])
    assert RetryPolicy.from_config(cfg.retry) == RetryPolicy((60.0, 120.0), (H, H), 0.0, 300.0)


def test_the_first_class_has_a_tenth_of_the_jitter():
    first = RetryPolicy.from_config(RetryConfig(), first_class=True)
    assert first.jitter == pytest.approx(0.01)
    assert first.schedule == DEFAULT.schedule and first.greylist_min == DEFAULT.greylist_min
    # Greylisted for the default 5 min (the first step too): back within 1% of the window,
    # where bulk may take up to 10% more.
    assert next_attempt(first, 1, 0.0, HIGH, kind="greylisting") == pytest.approx(303)
    assert next_attempt(first, 1, 0.0, LOW, kind="greylisting") == pytest.approx(300)
    assert next_attempt(DEFAULT, 1, 0.0, HIGH, kind="greylisting") == pytest.approx(330)


def test_steps_are_taken_as_configured():
    # A first step longer than the rest is the operator's choice (and a test's).
    cfg = load(None, ['retry.schedule=["30s"]', 'retry.then=["6s", "8s"]'])
    p = RetryPolicy.from_config(cfg.retry)
    assert retry_delay(p, 1, LOW) == pytest.approx(27)
    assert retry_delay(p, 2, HIGH) == pytest.approx(8.8)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"schedule": (-1.0,)},
        {"greylist_min": -1.0},
        {"jitter": 1.0},
        {"jitter": -0.1},
        {"then": (5 * H, 4 * H)},
    ],
)
def test_invalid_policies(kwargs):
    with pytest.raises(ValueError):
        policy(**kwargs)


def test_an_empty_schedule_goes_straight_to_then():
    p = policy(schedule=())
    assert retry_delay(p, 1, LOW) == 4 * H
    assert retry_delay(p, 1, HIGH) == 6 * H


# -- the ladder -------------------------------------------------------------------------------


def test_default_ladder_without_jitter():
    p = policy(schedule=DEFAULT.schedule, jitter=0)
    assert [retry_delay(p, n, LOW) for n in range(1, 7)] == [300, 900, 1800, 3600, 4 * H, 4 * H]
    assert [retry_delay(p, n, HIGH) for n in range(1, 7)] == [300, 900, 1800, 3600, 6 * H, 6 * H]


def test_jitter_scales_every_step():
    assert retry_delay(DEFAULT, 1, LOW) == pytest.approx(270)
    assert retry_delay(DEFAULT, 1, HIGH) == pytest.approx(330)
    assert retry_delay(DEFAULT, 9, LOW) == pytest.approx(4 * H * 0.9)
    assert retry_delay(DEFAULT, 9, HIGH) == pytest.approx(6 * H * 1.1)


def test_jitter_spreads_mail_deferred_together():
    rng = random.Random(7)
    delays = {round(retry_delay(DEFAULT, 1, rng)) for _ in range(100)}
    assert len(delays) > 30 and min(delays) >= 270 and max(delays) <= 330


def test_failures_start_at_one():
    with pytest.raises(ValueError):
        retry_delay(DEFAULT, 0, LOW)


# -- floors: greylisting and server hints -------------------------------------------------------


def test_greylisted_mail_waits_the_window_even_when_jitter_says_less():
    # 5 min -10% would be 4.5 min: under the 5 min greylist window.
    assert next_attempt(DEFAULT, 1, 1000.0, LOW, kind="greylisting") == 1000 + 300
    assert next_attempt(DEFAULT, 1, 1000.0, LOW) == pytest.approx(1000 + 270)


def test_a_greylisting_hint_longer_than_the_window_wins():
    at = next_attempt(DEFAULT, 1, 0.0, LOW, kind="greylisting", retry_after=600)
    assert at == 600


def test_a_greylisting_hint_shorter_than_the_window_does_not():
    assert next_attempt(DEFAULT, 1, 0.0, LOW, kind="greylisting", retry_after=60) == 300


def test_hints_are_floors_for_every_kind():
    assert next_attempt(DEFAULT, 1, 0.0, LOW, kind="throttling", retry_after=600) == 600
    # A hint below the ladder changes nothing.
    assert next_attempt(DEFAULT, 5, 0.0, LOW, kind="throttling", retry_after=600) == 4 * H * 0.9


def test_mail_under_a_floor_is_spread_above_it():
    assert next_attempt(DEFAULT, 1, 0.0, HIGH, retry_after=1000) == pytest.approx(1100)
    rng = random.Random(3)
    times = {next_attempt(DEFAULT, 1, 0.0, rng, kind="greylisting") for _ in range(50)}
    assert len(times) > 1 and min(times) >= 300


def test_zero_hint_is_no_floor():
    assert next_attempt(DEFAULT, 1, 0.0, LOW, retry_after=0.0) == pytest.approx(270)


# -- expiry ---------------------------------------------------------------------------------


def test_expiry():
    assert expiry(1000.0, 5 * D, None) == 1000 + 5 * D
    # X-Mtaqueue-Expires overrides the class lifetime, shorter or longer.
    assert expiry(1000.0, 5 * D, 2000.0) == 2000
    assert expiry(1000.0, 5 * D, 1000 + 9 * D) == 1000 + 9 * D


def test_expires_before_looks_ahead():
    assert expires_before(101.0, 100.0)
    assert not expires_before(100.0, 100.0)  # a retry right at the expiry still happens
    assert not expires_before(99.0, 100.0)


def lifetime_run(p: RetryPolicy, lifetime: float, rng: random.Random, kind: str = ""):
    """Fail every attempt until expiry; the attempt times."""
    created = now = 0.0
    expires_at = expiry(created, lifetime, None)
    attempts = [now]
    for failures in range(1, 10_000):
        due = next_attempt(p, failures, now, rng, kind=kind)
        if expires_before(due, expires_at):
            return attempts, expires_at
        now = due
        attempts.append(now)
    raise AssertionError("never expired")


def test_five_days_of_the_default_schedule():
    attempts, expires_at = lifetime_run(DEFAULT, 5 * D, random.Random(1))
    gaps = [b - a for a, b in pairwise(attempts)]
    assert [round(g / M) for g in gaps[:4]] == pytest.approx([5, 15, 30, 60], abs=6)
    assert all(3.6 * H <= g <= 6.6 * H for g in gaps[4:])
    # About 5 days at one attempt per ~5 h after the first two hours.
    assert 20 <= len(attempts) <= 32
    assert attempts[-1] <= expires_at


def test_a_short_lifetime_expires_at_the_look_ahead():
    # p0: 4 h. After 5+15+30+60 min the next retry (4-6 h) would pass it: expire then.
    attempts, _ = lifetime_run(DEFAULT, 4 * H, random.Random(2))
    assert len(attempts) == 5


# -- restarts -------------------------------------------------------------------------------


def test_restart_keeps_future_due_times():
    assert restart_due(2000.0, 1000.0, 60.0, HIGH) == 2000


@pytest.mark.parametrize("due", [None, 0.0, 500.0, 1000.0])
def test_restart_spreads_overdue_mail(due):
    assert restart_due(due, 1000.0, 60.0, LOW) == 1000
    assert restart_due(due, 1000.0, 60.0, HIGH) == 1060


def test_restart_spread_zero_is_now():
    assert restart_due(None, 1000.0, 0.0, random.Random()) == 1000


# -- properties -------------------------------------------------------------------------------

durations = st.floats(0, 30 * D, allow_nan=False)


@st.composite
def policies(draw, growing: bool = False) -> RetryPolicy:
    steps = draw(st.lists(durations, max_size=8))
    if growing:
        steps.sort()
    low = draw(st.floats(steps[-1] if growing and steps else 0, 30 * D))
    high = draw(st.floats(low, 30 * D))
    jitter = draw(st.floats(0, 0.5))
    return RetryPolicy(tuple(steps), (low, high), jitter, draw(durations))


def nominal(p: RetryPolicy, failures: int) -> tuple[float, float]:
    """The range a step may take before jitter."""
    if failures <= len(p.schedule):
        return (p.schedule[failures - 1],) * 2
    return p.then


def close_below(a: float, b: float) -> bool:
    """a <= b, allowing for float rounding."""
    return a <= b or math.isclose(a, b, rel_tol=1e-9)


rngs = st.randoms(use_true_random=False)
failure_counts = st.integers(1, 30)


@given(policies(), failure_counts, rngs)
def test_delay_within_jitter_of_the_nominal_step(p, failures, rng):
    low, high = nominal(p, failures)
    delay = retry_delay(p, failures, rng)
    assert delay >= 0
    assert close_below(low * (1 - p.jitter), delay)
    assert close_below(delay, high * (1 + p.jitter))


@given(policies(growing=True), failure_counts)
def test_nominal_steps_never_shrink(p, failures):
    """For a growing configuration (the default is one) the ladder only goes up."""
    zero = RetryPolicy(p.schedule, p.then, 0.0, p.greylist_min)
    if failures <= len(p.schedule):  # the largest this step can be <= the least the next can
        assert retry_delay(zero, failures, HIGH) <= retry_delay(zero, failures + 1, LOW)
    else:  # in the then range for good
        assert retry_delay(zero, failures, LOW) == retry_delay(zero, failures + 1, LOW)
        assert retry_delay(zero, failures, HIGH) == retry_delay(zero, failures + 1, HIGH)


@given(policies(), st.integers(1, 100), rngs)
def test_then_range_after_the_schedule(p, extra, rng):
    failures = len(p.schedule) + extra
    zero = RetryPolicy(p.schedule, p.then, 0.0, p.greylist_min)
    assert p.then[0] <= retry_delay(zero, failures, rng) <= p.then[1]


@given(
    policies(),
    failure_counts,
    st.floats(0, 1e10),
    rngs,
    st.sampled_from(["", "greylisting", "throttling", "other"]),
    st.none() | durations,
)
def test_never_earlier_than_the_floors(p, failures, now, rng, kind, hint):
    at = next_attempt(p, failures, now, rng, kind=kind, retry_after=hint)
    floor = max(hint or 0.0, p.greylist_min if kind == "greylisting" else 0.0)
    assert close_below(now + floor, at)
    assert at >= now
    # ... and never later than the ladder's top or just above the floor.
    top = max(nominal(p, failures)[1], floor) * (1 + p.jitter)
    assert close_below(at - now, top) or math.isclose(at, now + top, rel_tol=1e-9)


@given(st.floats(0, 1e10), durations, st.none() | st.floats(0, 1e10), st.floats(0, 1e10))
def test_expiry_never_late(created, lifetime, expires, next_at):
    expiry_at = expiry(created, lifetime, expires)
    if not expires_before(next_at, expiry_at):
        assert next_at <= expiry_at


@given(policies(), st.floats(1, 30 * D), rngs, st.sampled_from(["", "greylisting"]))
def test_no_retry_is_scheduled_past_the_expiry(p, lifetime, rng, kind):
    # A policy of zeros would retry forever at the same instant; keep the runs short.
    assume(p.then[0] > 0 and lifetime / p.then[0] < 2000)
    attempts, expires_at = lifetime_run(p, lifetime, rng, kind)
    assert all(a <= expires_at for a in attempts)
    assert attempts == sorted(attempts)


@given(st.none() | st.floats(0, 1e10), st.floats(0, 1e10), st.floats(0, D), rngs)
def test_restart_due_properties(due, now, spread, rng):
    at = restart_due(due, now, spread, rng)
    if due is not None and due > now:
        assert at == due
    else:
        assert now <= at <= now + spread
