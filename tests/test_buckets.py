"""Token buckets (mtaqueue.policy.buckets)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.policy.buckets import TokenBucket


def take_all(bucket: TokenBucket, now: float) -> int:
    """Take every token available at `now`."""
    taken = 0
    while bucket.wait(now) == 0:
        bucket.take(now)
        taken += 1
    return taken


def test_starts_full_and_refills_at_the_rate():
    bucket = TokenBucket(rate=1.0, burst=3, now=100.0)
    assert take_all(bucket, 100.0) == 3
    assert bucket.wait(100.0) == pytest.approx(1.0)
    assert bucket.wait(100.25) == pytest.approx(0.75)
    assert bucket.wait(101.0) == 0
    assert take_all(bucket, 101.0) == 1


def test_holds_at_most_burst():
    bucket = TokenBucket(rate=10.0, burst=5, now=0.0)
    assert take_all(bucket, 1e6) == 5  # a long quiet spell saves no more than the burst


def take_all_bounded(bucket: TokenBucket, now: float, most: int) -> int:
    """Take up to `most` tokens at `now` (for unlimited buckets)."""
    taken = 0
    while taken < most and bucket.wait(now) == 0:
        bucket.take(now)
        taken += 1
    return taken


def test_zero_rate_is_unlimited():
    bucket = TokenBucket(rate=0, burst=1, now=0.0)
    assert take_all_bounded(bucket, 0.0, 1000) == 1000


def test_a_token_given_back_is_there_again_up_to_the_burst():
    bucket = TokenBucket(rate=1.0, burst=2, now=0.0)
    bucket.take(0.0)
    bucket.take(0.0)
    bucket.give_back(0.0)  # the event it was taken for did not happen
    assert take_all(bucket, 0.0) == 1
    bucket.give_back(10.0)  # full again by then: no more than the burst
    assert take_all(bucket, 10.0) == 2


def test_a_take_without_a_token_is_debt():
    bucket = TokenBucket(rate=1.0, burst=1, now=0.0)
    bucket.take(0.0)
    bucket.take(0.0)  # two senders checked the same token
    assert bucket.wait(0.0) == pytest.approx(2.0)  # paid back before the next one
    assert bucket.wait(2.0) == 0


def test_set_rate_keeps_what_was_earned():
    bucket = TokenBucket(rate=1.0, burst=2, now=0.0)
    take_all(bucket, 0.0)
    bucket.set_rate(0.5, 1.0)  # one token earned at the old rate by t=1
    assert bucket.wait(1.0) == 0
    bucket.take(1.0)
    assert bucket.wait(1.0) == pytest.approx(2.0)  # the new rate from here on
    bucket.set_rate(2.0, 2.0)  # half a token by t=2, the rest at the faster rate
    assert bucket.wait(2.0) == pytest.approx(0.25)


def test_lifting_and_restoring_the_limit_starts_full():
    bucket = TokenBucket(rate=1.0, burst=2, now=0.0)
    take_all(bucket, 0.0)
    bucket.set_rate(0, 0.0)
    assert take_all_bounded(bucket, 0.0, 10) == 10
    bucket.set_rate(1.0, 0.0)
    assert take_all(bucket, 0.0) == 2  # no debt left from an unlimited spell


def test_invalid_arguments():
    with pytest.raises(ValueError):
        TokenBucket(rate=-1, burst=1, now=0.0)
    with pytest.raises(ValueError):
        TokenBucket(rate=1, burst=0, now=0.0)
    with pytest.raises(ValueError):
        TokenBucket(rate=1, burst=1, now=0.0).set_rate(-1, 0.0)


@given(
    st.floats(1.6e9, 1.8e9),
    st.floats(0.01, 1000),
    st.integers(1, 20),
)
def test_waiting_the_wait_gives_a_token_at_epoch_scale(start, rate, burst):
    """A caller that sleeps exactly `wait()` seconds gets its token: no busy loop of
    ~0-second waits from rounding at epoch-sized timestamps."""
    bucket = TokenBucket(rate, burst, start)
    now = start
    take_all(bucket, now)
    for _ in range(20):
        now += bucket.wait(now)
        assert bucket.wait(now) == 0
        bucket.take(now)


# -- the rate is never exceeded ------------------------------------------------------------

# Each token may be granted up to this many seconds early (see buckets._SLACK).
SLACK = 1e-6


def greedy_takes(bucket: TokenBucket, start: float, steps: list[tuple[float, int]]) -> list[float]:
    """Advance by each gap and try `tries` takes, each only if wait() says 0."""
    now, taken = start, []
    for gap, tries in steps:
        now += gap
        for _ in range(tries):
            if bucket.wait(now) == 0:
                bucket.take(now)
                taken.append(now)
    return taken


@given(
    rate=st.floats(0.001, 100),
    burst=st.integers(1, 10),
    start=st.one_of(st.just(0.0), st.floats(1.6e9, 1.8e9)),
    steps=st.lists(st.tuples(st.floats(0, 30), st.integers(0, 5)), max_size=80),
)
def test_takes_never_exceed_burst_plus_rate(rate, burst, start, steps):
    """Over any interval T (between two takes), takes <= burst + rate * T."""
    taken = greedy_takes(TokenBucket(rate, burst, start), start, steps)
    for i, first in enumerate(taken):
        for j in range(i, len(taken)):
            count = j - i + 1
            span = taken[j] - first
            assert count <= burst + rate * (span + count * SLACK) + 1e-9


@given(rate=st.floats(0.01, 100), burst=st.integers(1, 10), horizon=st.floats(1, 1000))
def test_a_patient_taker_gets_the_full_rate(rate, burst, horizon):
    """The limit is not stricter than it says: waiting as told yields rate * T tokens."""
    bucket = TokenBucket(rate, burst, 0.0)
    now, taken = 0.0, 0
    while True:
        now += bucket.wait(now)
        if now > horizon:
            break
        bucket.take(now)
        taken += 1
    assert taken >= burst + int(rate * horizon * (1 - 1e-9)) - 1


@given(
    burst=st.integers(1, 10),
    steps=st.lists(
        st.tuples(st.floats(0, 30), st.integers(0, 5), st.floats(0.001, 50)), max_size=60
    ),
)
def test_rate_changes_never_let_more_through_than_the_rates_allow(burst, steps):
    """With the rate changed between steps, takes in any interval are at most burst plus
    what the rates in force earned over it."""
    bucket = TokenBucket(1.0, burst, 0.0)
    now = 0.0
    events: list[tuple[float, int, float]] = []  # (time, takes, rate set right after)
    for gap, tries, rate in steps:
        now += gap
        took = 0
        for _ in range(tries):
            if bucket.wait(now) == 0:
                bucket.take(now)
                took += 1
        bucket.set_rate(rate, now)
        events.append((now, took, rate))
    fastest = max([1.0] + [rate for _, _, rate in events])
    for i, (_, first_takes, _) in enumerate(events):
        earned, count = 0.0, first_takes
        for j in range(i + 1, len(events)):
            earned += events[j - 1][2] * (events[j][0] - events[j - 1][0])
            count += events[j][1]
            assert count <= burst + earned + count * SLACK * fastest + 1e-9


def test_after_a_pause_it_resumes_one_token_at_a_time():
    bucket = TokenBucket(10.0, 5, 0.0)  # full: five at once
    bucket.resume_at(3.0)
    assert bucket.wait(2.9) > 0  # nothing before the resume
    assert bucket.wait(3.0) == 0
    bucket.take(3.0)
    assert bucket.wait(3.0) == pytest.approx(0.1)  # then at the rate, not a burst of five
    slow = TokenBucket(0.1, 1, 0.0)
    slow.take(0.0)
    slow.resume_at(5.0)  # half a token earned by then: it does not get a whole one
    assert slow.wait(5.0) == pytest.approx(5.0)
