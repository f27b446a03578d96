"""Reply latency and our own load (mtaqueue.policy.latency): series in, verdicts out."""

from __future__ import annotations

import random

import pytest

from mtaqueue.policy.latency import (
    CALM,
    CROWD_WINDOW,
    FLOOR,
    HIGH,
    LAG_WINDOW,
    ROSE,
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


def verdicts(series, lag: float = 0.0) -> list[tuple[str, str]]:
    """(kind, verdict) of each round, in order."""
    latency = ReplyLatency(FACTOR)
    return [
        (closed.kind, closed.verdict)
        for now, kind, seconds in series
        if (closed := latency.sample(now, kind, seconds, lag)) is not None
    ]


def of(kind: str, found: list[tuple[str, str]]) -> list[str]:
    return [verdict for k, verdict in found if k == kind]


def jitter(base: float, spread: float):
    return lambda i, rng: base * (1 + spread * rng.random())


SERIES = {
    # name: (mail, dot, what the rounds must say)
    "loopback, a loaded machine's jitter": (
        jitter(0.0002, 4.0),
        jitter(0.0005, 6.0),
        lambda v: SLOW not in dict(v).values() and SLOW not in of("dot", v),
    ),
    "a 50 ms path with 40 ms of jitter": (
        jitter(0.05, 0.8),
        jitter(0.08, 0.8),
        lambda v: all(verdict != SLOW for _, verdict in v),
    ),
    "slow at any load: 1 s after every dot": (
        jitter(0.001, 0.5),
        jitter(1.0, 0.2),
        lambda v: {verdict for _, verdict in v} == {CALM},
    ),
    "the dot's reply ten times slower from the 20th message": (
        jitter(0.001, 0.5),
        lambda i, rng: 0.2 if i < 20 else 2.0,
        lambda v: (
            of("dot", v)[:4] == [CALM] * 4
            and of("dot", v)[6:] == [SLOW] * len(of("dot", v)[6:])
            and set(of("mail", v)) == {CALM}
        ),
    ),
    "slowing little by little: +5% a message": (
        jitter(0.001, 0.2),
        lambda i, rng: 0.2 * 1.05**i,
        lambda v: of("dot", v)[0] == CALM and of("dot", v)[-1] == SLOW,
    ),
    "every fifth reply a spike": (
        jitter(0.01, 0.2),
        lambda i, rng: 0.5 if i % 5 == 4 else 0.01,
        lambda v: SLOW not in of("dot", v) and HIGH in of("dot", v),
    ),
}


@pytest.mark.parametrize("name", SERIES)
def test_series(name):
    mail, dot, holds = SERIES[name]
    found = verdicts(transactions(random.Random(7), 60, mail, dot))
    assert len(found) == 2 * ((60 - 1) // ROUND), found
    assert holds(found), found


def test_a_round_is_one_kinds_and_says_how_much():
    latency = ReplyLatency(FACTOR)
    latency.sample(0.0, "dot", 0.1)
    closed = []
    for i in range(ROUND):  # four RCPTs a message: they do not drown the dot's
        closed += [latency.sample(10.0 + i, "rcpt", 0.01) for _ in range(4)]
        closed.append(latency.sample(10.0 + i, "dot", 1.5 if i % 2 else 0.1))
    rounds = [r for r in closed if r is not None]
    assert [r.kind for r in rounds] == ["rcpt"] * 3 + ["dot"]  # (the first rcpt: a seed)
    dot = rounds[-1]
    assert (dot.verdict, dot.slow, dot.samples) == (SLOW, ROUND // 2, ROUND)
    assert dot.ratio == pytest.approx(15.0)  # the median: half at 1x, half at 15x
    assert latency.last is dot
    assert not latency.calm


def test_calm_once_every_kinds_last_round_was_the_dots_included():
    latency = ReplyLatency(FACTOR)
    latency.sample(0.0, "mail", 0.01)
    assert latency.calm  # no dot timed yet: nothing to wait for
    latency.sample(0.0, "dot", 0.1)
    assert not latency.calm  # the dot's round is what a new pace waits for
    for i in range(ROUND):
        latency.sample(1.0 + i, "mail", 0.01)
    assert latency.last.verdict == CALM and not latency.calm  # the MAILs came sooner
    for i in range(ROUND):
        latency.sample(10.0 + i, "dot", 0.1)
    assert latency.calm
    for i in range(ROUND):
        latency.sample(20.0 + i, "dot", 0.1 if i else 0.5)  # one slow of four: mixed
    assert latency.last.verdict == HIGH and not latency.calm
    for i in range(ROUND):
        latency.sample(30.0 + i, "mail", 0.01)
    assert not latency.calm  # the dot's last round still stands
    latency.restart(40.0)
    assert not latency.calm
    for i in range(ROUND):
        latency.sample(41.0 + i, "dot", 0.1)
    assert latency.calm


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
    assert closed.verdict == HIGH  # 90x the baseline, but 90 ms: not slow (a loaded machine)
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


def test_every_destination_a_little_over_its_baseline_at_once_is_ours_too():
    load = OwnLoad()
    for at, key in enumerate("abc"):
        load.reported(float(at), key, HIGH if key != "b" else ROSE)
    assert load.ours(2.0)  # our uplink, our machine: stretched everywhere
    load.reported(3.0, "d", CALM)
    load.reported(4.0, "e", CALM)
    assert not load.ours(4.0)


def test_the_crowd_forgets_destinations_as_they_age():
    load = OwnLoad()
    for i in range(1000):
        load.reported(float(i), f"d{i}", SLOW)
    assert len(load._rounds) <= CROWD_WINDOW + 1


def test_a_round_whose_median_rose_over_the_last_one_rose():
    latency = ReplyLatency(FACTOR)
    latency.sample(0.0, "dot", 0.25)
    rounds = [latency.sample(1.0 + i, "dot", 0.25) for i in range(ROUND)]
    assert rounds[-1].verdict == CALM
    latency.restart(10.0)  # a step up
    rounds = [latency.sample(11.0 + i, "dot", 0.45) for i in range(ROUND)]
    assert rounds[-1].verdict == ROSE and rounds[-1].rose  # +80%: under 3x, but it rose
    rounds = [latency.sample(20.0 + i, "dot", 0.5) for i in range(ROUND)]
    assert rounds[-1].verdict == HIGH and not rounds[-1].rose  # +11% over the round before
    rounds = [latency.sample(30.0 + i, "dot", 0.0005 * 2.0) for i in range(ROUND)]
    assert rounds[-1].verdict == CALM  # faster


def test_a_rise_must_also_be_the_floor():
    latency = ReplyLatency(FACTOR)
    latency.sample(0.0, "mail", 0.001)
    [latency.sample(1.0 + i, "mail", 0.001) for i in range(ROUND)]
    rounds = [latency.sample(10.0 + i, "mail", 0.004) for i in range(ROUND)]
    assert rounds[-1].verdict == CALM  # 4x on loopback is 3 ms: nothing
