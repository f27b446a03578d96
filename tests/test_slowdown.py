"""What reply latency does to the pace (mtaqueue.policy.slowdown): pure, time passed in.

A small model of a provider stands in for the network: with `sessions` open and `rate`
messages a second sent, its reply to the final dot takes `dot(sessions, rate)` seconds. The
sender is the policy itself (a Slowdown, an AdaptiveConcurrency and a PaceCap), sending as
fast as its limits let it.
"""

from __future__ import annotations

import random

import pytest

from mtaqueue.policy.concurrency import AdaptiveConcurrency
from mtaqueue.policy.latency import ROUND
from mtaqueue.policy.pace_cap import PaceCap
from mtaqueue.policy.slowdown import SETTLE, Slowdown

FACTOR = 3.0
WORK = 0.02  # seconds a transaction takes besides the reply to its dot


class Sender:
    def __init__(self, initial: int = 1, maximum: int = 10) -> None:
        self.now = 1000.0
        self.slowdown = Slowdown(FACTOR, None, self.now)
        self.concurrency = AdaptiveConcurrency(initial, maximum, now=self.now)
        self.pace = PaceCap()
        self.rates: list[float] = []  # messages a second, one a delivery
        self.sessions: list[int] = []

    def run(self, seconds: float, dot, rng: random.Random | None = None) -> None:
        """Deliver for `seconds` against a provider whose dot reply takes
        `dot(sessions, rate)` (with `rng`, times 1 to 1.8 at random: a wandering host)."""
        end = self.now + seconds
        while self.now < end:
            sessions = self.concurrency.limit
            reply = dot(sessions, self._rate(sessions, dot))
            if rng is not None:
                reply *= 1 + 0.8 * rng.random()
            rate = self._rate(sessions, dot)
            self.now += 1 / rate
            self.rates.append(rate)
            self.sessions.append(sessions)
            before = self.concurrency.limit
            if self.concurrency.success(self.now):
                self.slowdown.stepped_up(self.now, before, self.pace.rate)
            closed = self.slowdown.timed(self.now, [("dot", reply)], 0.0)
            if closed is not None:
                self.slowdown.react(self.now, closed, False, self.concurrency, self.pace)

    def _rate(self, sessions: int, dot) -> float:
        """What the sender sends at: its sessions over the time a transaction takes, under
        the ceiling; the provider's reply settles with the rate."""
        low, high = 0.0, sessions / (WORK + dot(sessions, 0.0))  # (slower with the rate)
        for _ in range(40):  # where what it is sent at is what it answers for
            rate = (low + high) / 2
            low, high = (
                (rate, high) if sessions / (WORK + dot(sessions, rate)) > rate else (low, rate)
            )
        return min(low, self.pace.rate) if self.pace.rate else low

    def share_over(self, limit: float, since: int) -> float:
        later = self.rates[since:]
        return sum(rate > limit * 1.02 for rate in later) / len(later)


def rate_level(limit: float, base: float = 0.1):
    """Slower past `limit` messages a second: 2 s for each time over it."""
    return lambda sessions, rate: base + 2.0 * max(0.0, rate / limit - 1)


def session_level(limit: int, base: float = 0.25):
    """Slower past `limit` sessions: 0.2 s each."""
    return lambda sessions, rate: base + 0.2 * max(0, sessions - limit)


def test_a_site_minding_its_rate_gets_a_ceiling_under_it_and_keeps_the_sessions():
    sender = Sender()
    sender.run(300.0, rate_level(15.0))
    half = len(sender.rates) // 2
    assert sender.pace.rate and sender.pace.rate <= 15.0
    assert sender.share_over(15.0, half) <= 0.2  # most of the time under its comfort
    assert sum(sender.rates[half:]) / len(sender.rates[half:]) >= 0.8 * 15.0


def test_a_site_minding_its_sessions_gets_fewer_and_no_ceiling_under_what_they_carry():
    sender = Sender()
    sender.run(300.0, session_level(3))
    half = len(sender.sessions) // 2
    later = sender.sessions[half:]
    assert sum(s > 3 for s in later) / len(later) <= 0.2
    assert sender.concurrency.knee == 3
    carried = 3 / (WORK + 0.25)
    assert not sender.pace.rate or sender.pace.rate >= 0.8 * carried


def test_a_host_slow_at_every_load_is_sent_to_at_full_parallelism():
    sender = Sender()
    sender.run(300.0, lambda sessions, rate: 1.0)
    assert sender.concurrency.limit == 10
    assert sender.pace.rate == 0.0 and sender.slowdown.slowed is None


def test_a_host_whose_replies_wander_is_not_cut():
    sender = Sender()
    sender.run(300.0, lambda sessions, rate: 0.08, random.Random(3))  # 80 to 144 ms
    assert sender.concurrency.limit == 10
    assert sender.pace.rate == 0.0 and sender.slowdown.slowed is None


@pytest.mark.parametrize(
    ("rounds", "cut"),
    [(2, False), (3, True)],
    ids=["two high rounds hold", "three in a row cut the rate"],
)
def test_dot_rounds_stretched_at_a_steady_pace_cut_the_rate(rounds, cut):
    slowdown = Slowdown(FACTOR, None, 0.0)
    concurrency, pace = AdaptiveConcurrency(4, 4), PaceCap()
    now = 0.0
    for seconds in [0.25] * (ROUND + 1) + [0.3] * (ROUND * rounds):  # +20%: high, not slow
        now += 0.1
        closed = slowdown.timed(now, [("dot", seconds)], 0.0)
        if closed is not None:
            slowdown.react(now, closed, False, concurrency, pace)
    assert concurrency.limit == 4
    assert bool(pace.rate) == cut
    if cut:
        assert pace.rate == pytest.approx(0.85 * 10.0, rel=0.05)  # a dot every 0.1 s


def test_a_slow_site_is_not_halved_twice_in_one_episode():
    slowdown = Slowdown(FACTOR, None, 0.0)
    concurrency, pace = AdaptiveConcurrency(8, 8), PaceCap()
    now, limits = 0.0, []
    for seconds in [0.2] * (ROUND + 1) + [2.0] * ROUND * 6:
        now += 0.5
        closed = slowdown.timed(now, [("dot", seconds)], 0.0)
        if closed is not None and slowdown.react(now, closed, False, concurrency, pace):
            limits.append((now, concurrency.limit))
    assert [limit for _, limit in limits][:2] == [4, 2]
    assert limits[1][0] - limits[0][0] >= SETTLE


def test_a_stretch_neither_lever_brings_back_costs_one_cut_of_each():
    sender = Sender(initial=4, maximum=4)
    sender.run(20.0, lambda sessions, rate: 0.1)
    sender.slowdown.changes()
    sender.run(120.0, lambda sessions, rate: 0.2)  # 0.1 s more at any pace: not the site's
    cuts = [change for change in sender.slowdown.changes() if change.kind]
    assert len(cuts) == 2, cuts
    assert cuts[0].rate_new > 0 and cuts[0].new == cuts[0].old  # the rate first,
    assert cuts[1].new == cuts[1].old - 1  # then one session; then nothing more
