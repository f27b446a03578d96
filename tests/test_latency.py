"""Reply latency and our own load (mtaqueue.policy.latency): series in, verdicts out."""

from __future__ import annotations

import random

import pytest

from mtaqueue.policy.latency import (
    CALM,
    CROWD_WINDOW,
    FLOOR,
    LAG_WINDOW,
    MIXED,
    ROUND,
    SLOW,
    WINDOW,
    OwnLoad,
    ReplyLatency,
)

FACTOR = 3.0  # shaping.latency_factor's default


def transactions(rng: random.Random, count: int, mail, dot, gap: float = 0.5):
    """`count` transactions, each a MAIL group's reply and the reply after the dot, the
    seconds drawn by `mail(i, rng)` and `dot(i, rng)`: [(now, kind, seconds)]."""
    now, series = 1000.0, []
    for i in range(count):
        now += gap
        seconds = mail(i, rng)
        now += seconds
        series.append((now, "mail", seconds))
        seconds = dot(i, rng)
        now += seconds
        series.append((now, "dot", seconds))
    return series


def verdicts(series, lag: float = 0.0) -> list[str]:
    latency = ReplyLatency(FACTOR)
    return [
        closed.verdict
        for now, kind, seconds in series
        if (closed := latency.sample(now, kind, seconds, lag)) is not None
    ]


def jitter(base: float, spread: float):
    return lambda i, rng: base * (1 + spread * rng.random())


SERIES = {
    # name: (mail, dot, what the rounds must say)
    "loopback, a loaded machine's jitter": (
        jitter(0.0002, 4.0),
        jitter(0.0005, 6.0),
        lambda v: SLOW not in v,
    ),
    "a 50 ms path with 40 ms of jitter": (
        jitter(0.05, 0.8),
        jitter(0.08, 0.8),
        lambda v: SLOW not in v,
    ),
    "slow at any load: 1 s after every dot": (
        jitter(0.001, 0.5),
        jitter(1.0, 0.2),
        lambda v: set(v) == {CALM},
    ),
    "the dot's reply ten times slower from the 20th message": (
        jitter(0.001, 0.5),
        lambda i, rng: 0.2 if i < 20 else 2.0,
        lambda v: v[:2] == [CALM, CALM] and v[-1] == SLOW and v.count(SLOW) >= 5,
    ),
    "slowing little by little: +5% a message": (
        jitter(0.001, 0.2),
        lambda i, rng: 0.2 * 1.05**i,
        lambda v: SLOW in v and v[0] == CALM,
    ),
    "every fifth reply a spike": (
        jitter(0.01, 0.2),
        lambda i, rng: 0.5 if i % 5 == 4 else 0.01,
        lambda v: SLOW not in v and MIXED in v,
    ),
}


@pytest.mark.parametrize("name", SERIES)
def test_series(name):
    mail, dot, holds = SERIES[name]
    found = verdicts(transactions(random.Random(7), 60, mail, dot))
    assert len(found) >= 60 * 2 // ROUND - 1, found
    assert holds(found), found


def test_a_slow_round_names_the_slow_kind_and_how_much():
    latency = ReplyLatency(FACTOR)
    latency.sample(0.0, "mail", 0.01)
    latency.sample(0.0, "dot", 0.1)
    closed = None
    for i in range(ROUND // 2):
        latency.sample(10.0 + i, "mail", 0.01)
        closed = latency.sample(10.0 + i, "dot", 1.5) or closed
    assert closed is not None and closed.verdict == SLOW
    assert (closed.kind, closed.slow, closed.samples) == ("dot", ROUND // 2, ROUND)
    assert closed.ratio == pytest.approx(15.0)  # the median: half at 1x, half at 15x
    assert latency.last is closed


def test_replies_sent_before_the_pace_changed_are_not_judged():
    latency = ReplyLatency(FACTOR)
    latency.sample(0.0, "dot", 0.1)
    latency.restart(100.0)
    for _ in range(ROUND):  # sent at 98 s, read after the restart: the old pace's
        assert latency.sample(101.0, "dot", 3.0) is None
    for i in range(ROUND - 1):
        assert latency.sample(102.0 + i, "dot", 0.1) is None
    assert latency.sample(110.0, "dot", 0.1).verdict == CALM


def test_the_loops_lag_is_not_the_destinations():
    latency = ReplyLatency(FACTOR)
    latency.sample(0.0, "dot", 0.01)
    rounds = [latency.sample(1.0 + i, "dot", 0.4, lag=0.39) for i in range(ROUND)]
    assert rounds[-1].verdict == CALM
    assert latency.baseline("dot", 10.0) == pytest.approx(0.01)


def test_a_baseline_is_the_minimum_of_its_window():
    latency = ReplyLatency(FACTOR)
    latency.sample(0.0, "dot", 0.2)
    latency.sample(1.0, "dot", 0.1)
    latency.sample(WINDOW / 2, "dot", 5.0)  # slowing does not raise it
    assert latency.baseline("dot", WINDOW / 2) == 0.1
    assert latency.baseline("dot", WINDOW + 1) == 5.0  # the fast ones are too old now
    assert latency.baseline("dot", 2 * WINDOW) is None  # nothing left: starts over
    assert latency.baseline("mail", 0.0) is None


def test_the_round_trip_is_the_least_baseline_of_the_commands():
    latency = ReplyLatency(FACTOR)
    assert latency.rtt(0.0) is None
    latency.sample(0.0, "connect", 0.0002)  # a proxy answered the handshake
    latency.sample(0.0, "banner", 0.3)
    latency.sample(0.0, "ehlo", 0.055)
    assert latency.rtt(0.0) is None  # one sample decides nothing
    latency.sample(0.0, "mail", 0.050)
    latency.sample(0.0, "dot", 0.049)
    assert latency.rtt(0.0) == 0.050


def test_baselines_outlive_a_restart_for_their_window():
    latency = ReplyLatency(FACTOR)
    latency.sample(0.0, "dot", 0.1234567)
    latency.sample(0.0, "mail", 0.02)
    saved = latency.saved(10.0)
    assert saved == {"dot": 0.123457, "mail": 0.02}
    again = ReplyLatency(FACTOR, saved, at=10.0)
    assert again.baseline("dot", 20.0) == 0.123457
    slow = [again.sample(30.0 + i, "dot", 1.0) for i in range(ROUND)]  # judged at once
    assert slow[-1].verdict == SLOW
    assert ReplyLatency(FACTOR, saved, at=10.0).baseline("dot", 10.0 + WINDOW) is None
    assert ReplyLatency(FACTOR, {"bogus": 1.0}).saved(0.0) == {}


def test_a_slow_sample_needs_the_floor_as_well_as_the_factor():
    latency = ReplyLatency(FACTOR)
    latency.sample(0.0, "dot", 0.001)
    closed = [latency.sample(1.0 + i, "dot", 0.001 + FLOOR * 0.9) for i in range(ROUND)][-1]
    assert closed.verdict == CALM  # 90x the baseline, but 90 ms: a loaded machine
    closed = [latency.sample(20.0 + i, "dot", 0.001 + FLOOR * 1.1) for i in range(ROUND)][-1]
    assert closed.verdict == SLOW


# -- our own load ---------------------------------------------------------------------


def test_the_loops_lag_is_ours_for_a_while():
    load = OwnLoad()
    load.lag(0.0, 0.5)
    load.lag(0.5, 0.01)
    assert load.lagging(1.0) == 0.5
    assert load.ours(1.0)
    assert load.lagging(LAG_WINDOW + 0.1) == 0.01
    assert not load.ours(LAG_WINDOW + 0.1)
    assert load.lagging(10.0) == 0.0


def test_every_destination_slow_at_once_is_ours():
    load = OwnLoad()
    load.reported(0.0, "a", SLOW)
    load.reported(1.0, "b", SLOW)
    assert not load.ours(1.0)  # two say little
    load.reported(2.0, "c", SLOW)
    assert load.ours(2.0)
    load.reported(3.0, "d", CALM)
    assert load.ours(3.0)  # three of four
    load.reported(4.0, "e", CALM)
    assert not load.ours(4.0)  # three of five: some are fine, the slow ones are slow
    load.reported(5.0, "a", CALM)  # a destination counts once: its last round
    assert not load.ours(5.0)
    assert not load.ours(5.0 + CROWD_WINDOW + 1)  # old rounds say nothing


def test_the_crowd_forgets_destinations_as_they_age():
    load = OwnLoad()
    for i in range(1000):
        load.reported(float(i), f"d{i}", SLOW)
    assert len(load._rounds) <= CROWD_WINDOW + 1
