"""One destination's pacing, composed (mtaqueue.policy.shaper)."""

from __future__ import annotations

import json
import math
import random

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mtaqueue.config import DestinationRule, Pacing, ShapingConfig, ThrottleRule
from mtaqueue.policy import pace_cap, rate_learner
from mtaqueue.policy.classify import classify
from mtaqueue.policy.pacing_rules import NAMED_HOP_RATE, pacing_for, stated_rate
from mtaqueue.policy.replies import Reply
from mtaqueue.policy.shaper import DestinationShaper

# A small, quick destination: 4 connections at most, 2 to start, one reserved for p0.
PACING = Pacing(max_connections=4, initial_connections=2, reserved_p0=1)
SHAPING = ShapingConfig(
    backoff_duration=600.0,
    backoff_successes=10,
    breaker_failures=3,
    breaker_window=60.0,
    breaker_cooldown=30.0,
    breaker_cooldown_max=120.0,
    release_spread=30.0,
)

DELIVERED = Reply("data_end", 250, "2.0.0", "ok")
THROTTLED = Reply("data_end", 451, "4.7.28", "Our system has detected an unusual rate")
TOO_MANY = Reply("banner", 421, "", "Too many connections")
REFUSED = Reply("connect", 0, network="refused")
NO_SUCH_USER = Reply("rcpt", 550, "5.1.1", "no such user")


def shaper_at(now: float = 0.0, pacing: Pacing = PACING, **shaping) -> DestinationShaper:
    return DestinationShaper(pacing, msgspec.structs.replace(SHAPING, **shaping), now)


def report(shaper: DestinationShaper, now: float, reply: Reply, times: int = 1) -> None:
    for _ in range(times):
        shaper.result(now, reply, classify(reply))


def slots(shaper: DestinationShaper, now: float) -> tuple[int, int]:
    """How many connections may be open at once: (ordinary, first-class only), opening
    ordinary ones first as the queue manager does."""
    ordinary = reserved = 0
    while shaper.connect_wait(now, ordinary, 0, first_class=False) == 0:
        ordinary += 1
    while shaper.connect_wait(now, ordinary + reserved, reserved, first_class=True) == 0:
        reserved += 1
    return ordinary, reserved


def grow_to(shaper: DestinationShaper, now: float, limit: int) -> float:
    """Deliveries whose replies come at an even pace (calm rounds) until the concurrency
    is at `limit`: the time then."""
    while shaper.concurrency.limit < limit:
        now += 0.001
        report(shaper, now, DELIVERED)
        closed = shaper.timed(now, [("mail", 0.0005), ("dot", 0.0005)], 0.0)
        if closed is not None:
            shaper.react(now, closed, ours=False)
    return now


# -- admission ----------------------------------------------------------------------------


def test_starts_at_the_initial_concurrency():
    shaper = shaper_at()
    assert shaper.concurrency.limit == 2
    assert shaper.connect_wait(0.0, 0, 0, first_class=False) == 0
    assert shaper.connect_wait(0.0, 2, 0, first_class=True) == math.inf
    assert shaper.send_wait(0.0) == 0  # no rate configured


def test_reserved_slot_for_the_first_class():
    shaper = shaper_at()
    # At limit 2 one slot is bulk's, the other the first class's.
    assert slots(shaper, 0.0) == (1, 1)
    now = grow_to(shaper, 0.0, 4)
    assert slots(shaper, now) == (3, 1)
    # Cut to 1 by two episodes: bulk keeps its one connection (never starved), p0 goes
    # first on it.
    report(shaper, now, THROTTLED)
    report(shaper, 100.0, THROTTLED)
    assert shaper.concurrency.limit == 1
    assert slots(shaper, 200.0) == (1, 0)


def test_first_class_connections_do_not_take_the_ordinary_share():
    shaper = shaper_at()
    now = grow_to(shaper, 0.0, 4)
    # Two first-class-only connections opened while the limit grew (1 ordinary, 2
    # reserved, e.g. during a p0 wave): bulk may still open two more ordinary ones.
    assert shaper.connect_wait(now, 3, 2, first_class=False) == 0
    assert shaper.connect_wait(now, 4, 2, first_class=False) == math.inf
    assert shaper.connect_wait(now, 4, 3, first_class=True) == math.inf


def test_no_reserve():
    shaper = shaper_at(pacing=Pacing(max_connections=4, initial_connections=4, reserved_p0=0))
    assert slots(shaper, 0.0) == (4, 0)


def test_connections_over_a_lowered_limit_close():
    shaper = shaper_at(pacing=Pacing(max_connections=4, initial_connections=4))
    assert all(shaper.keeps(0.0, 4, 1, first_class) for first_class in (False, True))
    shaper.override(0.0, rate_per_minute=None, concurrency=2, until=None)
    # 3 ordinary + 1 reserved open at limit 2 (share 1): one ordinary may stay.
    assert not shaper.keeps(0.0, 4, 1, first_class=False)
    assert not shaper.keeps(0.0, 4, 1, first_class=True)
    assert not shaper.keeps(0.0, 3, 1, first_class=False)  # 2 ordinary, share 1
    assert shaper.keeps(0.0, 2, 1, first_class=False)
    assert shaper.keeps(0.0, 2, 1, first_class=True)
    # A first-class connection with its work done turns ordinary if there is room.
    assert not shaper.keeps(0.0, 2, 0, first_class=False)
    assert shaper.keeps(0.0, 1, 0, first_class=False)


def test_connection_rate():
    shaper = shaper_at(pacing=Pacing(connections_per_minute=6, burst=1))
    assert shaper.connect_wait(0.0, 0, 0, False) == 0
    shaper.connected(0.0)
    assert shaper.connect_wait(0.0, 1, 0, True) == pytest.approx(10.0)
    assert shaper.connect_wait(10.0, 1, 0, True) == 0


def test_message_rate_allows_the_burst_then_paces():
    shaper = shaper_at(pacing=Pacing(messages_per_minute=60, burst=5))
    sent = 0
    while shaper.send_wait(0.0) == 0:
        shaper.sent(0.0)
        sent += 1
    assert sent == 5
    assert shaper.send_wait(0.0) == pytest.approx(1.0)


# -- throttling and backoff mode -------------------------------------------------------------


def test_throttle_rule_backoff_and_recovery_in_stages():
    pacing = Pacing(max_connections=8, initial_connections=8, messages_per_minute=120)
    shaper = shaper_at(pacing=pacing, throttle_rules=[ThrottleRule(match="unusual rate")])
    shaper.learner.rate = 10.0  # learned above the ceiling: the ceiling governs
    report(shaper, 0.0, THROTTLED)
    shaper.learner.rate = 10.0  # (and the ceiling, not the cut, is what backoff scales)
    snap = shaper.snapshot(0.0)
    assert (snap["mode"], snap["stage"]) == ("backoff", 2)
    assert snap["max"] == 2  # the ceiling 8 * 0.5**2
    assert snap["limit"] == 2  # halved to 4, then capped
    assert snap["messages_per_minute"] == pytest.approx(30)
    assert shaper.retry_factor(0.0) == 4.0

    # One duration later: stage 1, ceiling and rate half of normal.
    snap = shaper.snapshot(600.0)
    assert (snap["stage"], snap["max"], snap["messages_per_minute"]) == (1, 4, 60)
    assert shaper.retry_factor(600.0) == 2.0

    # A run of successes steps back the last stage: normal again.
    report(shaper, 601.0, DELIVERED, times=10)
    snap = shaper.snapshot(601.0)
    assert (snap["mode"], snap["stage"], snap["max"]) == ("normal", 0, 8)
    assert snap["messages_per_minute"] == pytest.approx(120)
    assert shaper.retry_factor(601.0) == 1.0
    # The ceiling is back, the limit grows back by successes, not at once.
    assert snap["limit"] < 8


def test_the_backoff_rate_paces_sending():
    shaper = shaper_at(pacing=Pacing(messages_per_minute=60, burst=1))
    shaper.sent(0.0)
    assert shaper.send_wait(0.0) == pytest.approx(1.0)
    shaper.force_backoff(0.0, until=100.0)
    assert shaper.send_wait(0.0) == pytest.approx(4.0)  # a quarter of the rate


def test_a_throttle_reply_pauses_and_cuts_the_learned_rate_not_backoff_mode():
    shaper = shaper_at()
    assert shaper.snapshot(0.0)["messages_per_minute"] == pytest.approx(120)  # slow start
    report(shaper, 0.0, THROTTLED)
    snap = shaper.snapshot(0.0)
    assert (snap["mode"], snap["learned"]["phase"]) == ("normal", "paused")
    assert snap["messages_per_minute"] == pytest.approx(120 / 2)  # slow start left: halved
    assert snap["learned"]["rate_reply"] == THROTTLED.line()
    assert shaper.send_wait(0.0) == pytest.approx(5.0)  # the cool-down, for every connection
    # Then one message at a time at the new rate: no burst of what the pause earned.
    assert shaper.send_wait(5.0) == 0.0
    shaper.sent(5.0)
    assert shaper.send_wait(5.0) == pytest.approx(1.0)  # 60/min
    assert shaper.connect_wait(0.0, 0, 0, first_class=True) == pytest.approx(5.0)
    assert shaper.retry_factor(0.0) == 1.0  # retries are not stretched


def test_a_throttle_rule_threshold():
    shaper = shaper_at(throttle_rules=[ThrottleRule(match="(?i)temporarily deferred", threshold=2)])
    deferred = Reply("rcpt", 451, "4.3.0", "Temporarily deferred")
    assert classify(deferred).kind != "throttling"
    report(shaper, 0.0, deferred)
    assert shaper.snapshot(0.0)["mode"] == "normal"
    report(shaper, 60.0, deferred)
    assert shaper.snapshot(60.0)["mode"] == "backoff"


def test_a_mailbox_rate_limit_does_not_slow_the_destination():
    reply = Reply("rcpt", 450, "4.2.1", "The user is receiving mail too quickly")
    assert (classify(reply).kind, classify(reply).scope) == ("throttling", "recipient")
    shaper = shaper_at()
    report(shaper, 0.0, reply)
    assert shaper.snapshot(0.0)["mode"] == "normal"
    assert shaper.concurrency.limit == 2


def test_forced_backoff_and_back_to_normal():
    shaper = shaper_at()
    shaper.force_backoff(0.0, until=100.0)
    assert shaper.snapshot(50.0)["mode"] == "backoff"
    assert shaper.snapshot(50.0)["backoff_until"] == 100.0
    assert shaper.snapshot(100.0)["mode"] == "normal"
    report(shaper, 200.0, THROTTLED)
    shaper.force_backoff(201.0, until=201.0)  # "normal now" also ends a signalled backoff
    assert shaper.snapshot(201.0)["mode"] == "normal"


# -- the circuit breaker ---------------------------------------------------------------------


def test_breaker_open_probe_and_ramp_from_one():
    shaper = shaper_at()
    grow_to(shaper, 0.0, 4)
    for _ in range(3):
        shaper.connect_failed(10.0)
    snap = shaper.snapshot(10.0)
    assert (snap["circuit"], snap["reopen_at"], snap["trips"]) == ("open", 40.0, 1)
    assert shaper.connect_wait(10.0, 0, 0, True) == pytest.approx(30.0)  # the cooldown left
    # Half-open: one probe.
    assert shaper.connect_wait(40.0, 0, 0, False) == 0
    shaper.connected(40.0)
    assert shaper.snapshot(40.0)["circuit"] == "half-open"
    assert shaper.connect_wait(40.0, 1, 0, True) == math.inf
    assert shaper.connect_wait(40.0, 0, 0, True) == math.inf  # not even with nothing open
    # The probe delivers: closed, and concurrency ramps up from 1.
    report(shaper, 41.0, DELIVERED)
    assert shaper.snapshot(41.0)["circuit"] == "closed"
    assert shaper.concurrency.limit == 1
    assert shaper.connect_wait(41.0, 0, 0, False) == 0
    assert shaper.connect_wait(41.0, 1, 0, False) == math.inf
    report(shaper, 42.0, DELIVERED)
    assert shaper.concurrency.limit == 2


def probing() -> DestinationShaper:
    """A shaper whose breaker opened at 0 (3 refused connections) and whose half-open
    probe connected at 30, the cooldown over."""
    shaper = shaper_at()
    for _ in range(3):
        report(shaper, 0.0, REFUSED)
    shaper.connected(30.0)
    assert shaper.snapshot(30.0)["circuit"] == "half-open"
    return shaper


def test_a_failed_probe_reopens_for_longer():
    shaper = probing()
    report(shaper, 31.0, TOO_MANY)
    snap = shaper.snapshot(31.0)
    assert (snap["circuit"], snap["reopen_at"], snap["trips"]) == ("open", 91.0, 2)


def test_a_throttled_probe_reopens():
    shaper = probing()
    report(shaper, 31.0, THROTTLED)  # answered, but still unhappy
    assert shaper.snapshot(31.0)["circuit"] == "open"


@pytest.mark.parametrize(
    "reply",
    [
        Reply("auth", 535, "5.7.8", "Authentication credentials invalid"),
        Reply("mail", 530, "5.7.0", "Authentication required"),  # at MAIL: still not an answer
        Reply("auth", 0, "", "relay.test offers no AUTH", network="auth"),
    ],
)
def test_refused_auth_opens_the_circuit_at_once_and_a_refused_probe_keeps_it_open(reply):
    shaper = shaper_at()
    report(shaper, 0.0, reply)  # one: every connection would be refused alike
    snap = shaper.snapshot(0.0)
    assert (snap["circuit"], snap["reopen_at"], snap["trips"]) == ("open", 30.0, 1)
    assert shaper.connect_wait(1.0, 0, 0, True) == pytest.approx(29.0)
    shaper.connected(30.0)  # the probe
    report(shaper, 31.0, reply)
    assert shaper.snapshot(31.0)["circuit"] == "open"


def test_a_bounce_shows_the_site_answering():
    shaper = probing()
    report(shaper, 31.0, NO_SUCH_USER)
    assert shaper.snapshot(31.0)["circuit"] == "closed"
    assert shaper.concurrency.limit == 1


def test_too_many_connections_at_the_greeting_caps_concurrency_not_the_host():
    shaper = shaper_at(pacing=Pacing(max_connections=8, initial_connections=8))
    for _ in range(5):  # the 4th refused (4 open, this one included), in one episode
        shaper.result(0.0, TOO_MANY, classify(TOO_MANY), active=4)
    snap = shaper.snapshot(0.0)
    assert (snap["mode"], snap["circuit"], snap["limit"], snap["max"]) == (
        "normal",
        "closed",
        3,
        3,
    )
    assert snap["learned"]["concurrency"] == 3
    assert snap["learned"]["concurrency_reply"] == TOO_MANY.line()
    # The rate is as it was; the refusal pauses (strict sites list a client that goes on).
    assert snap["messages_per_minute"] == pytest.approx(120)
    assert shaper.send_wait(0.0) == pytest.approx(5.0)
    assert shaper.learned(10.0).concurrency == 3  # remembered


def test_forgetting_lifts_a_learned_cap_and_rate_but_not_the_operators_limit():
    shaper = shaper_at(pacing=Pacing(max_connections=8, initial_connections=8))
    shaper.result(0.0, TOO_MANY, classify(TOO_MANY), active=4)
    report(shaper, 10.0, THROTTLED)
    shaper.override(10.0, rate_per_minute=300, concurrency=None, until=None)
    assert (shaper.snapshot(10.0)["max"], shaper.learned(10.0).concurrency) == (3, 3)
    shaper.forget(11.0)
    snap = shaper.snapshot(11.0)
    assert snap["max"] == 8  # the configured ceiling again, not the learned 3
    assert snap["learned"]["phase"] == "slow-start" and not snap["learned"]["concurrency"]
    assert shaper.send_wait(11.0) == 0  # no cool-down left either
    assert snap["messages_per_minute"] == pytest.approx(120)  # the slow start, under
    assert snap["override"]["rate_per_minute"] == 300  # the operator's ceiling, kept
    assert shaper.learned(11.0).good == 0 and shaper.learned(11.0).rate_reply == ""


def test_a_rate_stated_for_a_destination_is_where_it_starts_the_default_only_caps():
    # An admin who names a provider's rate knows it (the admin-paced storm); the default
    # table's rate says nothing of any one provider: slow start under it.
    shaping = msgspec.structs.replace(
        SHAPING,
        default=Pacing(messages_per_minute=600),
        destinations=[DestinationRule(mx_suffix=".provider.test", messages_per_minute=6000)],
    )
    hosts = ["mx1.provider.test"]
    assert stated_rate(shaping, "example.org", hosts) == 6000
    assert stated_rate(shaping, "other.test", ["mx.other.test"]) == 0
    stated = DestinationShaper(
        pacing_for(shaping, "example.org", hosts), shaping, 0.0, stated_rate=6000
    )
    snap = stated.snapshot(0.0)
    assert snap["messages_per_minute"] == pytest.approx(6000)
    assert snap["learned"]["phase"] == "at-ceiling"
    default = DestinationShaper(pacing_for(shaping, "other.test", ["mx.other.test"]), shaping, 0.0)
    assert default.snapshot(0.0)["messages_per_minute"] == pytest.approx(120)  # slow start
    report(stated, 1.0, THROTTLED)  # a throttle signal still cuts it
    assert stated.snapshot(1.0)["learned"]["phase"] == "paused"
    stated.forget(2.0)  # and forgetting starts at the stated rate again
    assert stated.snapshot(2.0)["messages_per_minute"] == pytest.approx(6000)


def test_a_next_hop_the_operator_named_starts_at_speed_not_in_slow_start():
    # A relayhost, a route or a smarthost: the operator chose it, as Postfix's relayhost;
    # slow start cost a third of the end-to-end bench. A rule's own rate still wins, and
    # shaping.default's rate still caps it.
    shaping = msgspec.structs.replace(
        SHAPING,
        destinations=[DestinationRule(mx_suffix=".provider.test", messages_per_minute=6000)],
    )
    assert stated_rate(shaping, "", ["127.0.0.1"], named_hop=True) == NAMED_HOP_RATE
    assert stated_rate(shaping, "", ["mx1.provider.test"], named_hop=True) == 6000
    assert stated_rate(shaping, "other.test", ["mx.other.test"]) == 0
    hop = DestinationShaper(
        pacing_for(shaping, "", ["127.0.0.1"]), shaping, 0.0, stated_rate=NAMED_HOP_RATE
    )
    assert hop.snapshot(0.0)["messages_per_minute"] == pytest.approx(NAMED_HOP_RATE)
    capped = msgspec.structs.replace(shaping, default=Pacing(messages_per_minute=600))
    hop = DestinationShaper(
        pacing_for(capped, "", ["127.0.0.1"]), capped, 0.0, stated_rate=NAMED_HOP_RATE
    )
    assert hop.snapshot(0.0)["messages_per_minute"] == pytest.approx(600)
    report(hop, 1.0, THROTTLED)  # a throttle signal still pauses and cuts it
    assert hop.snapshot(1.0)["learned"]["phase"] == "paused"


def test_a_throttle_rule_hit_is_a_throttle_signal():
    rule = ThrottleRule(match="(?i)temporarily deferred", threshold=1)
    shaper = shaper_at(throttle_rules=[rule])
    report(shaper, 0.0, Reply("mail", 451, "4.3.0", "Temporarily deferred"))
    assert shaper.snapshot(0.0)["learned"]["phase"] == "paused"
    assert shaper.send_wait(0.0) > 0


def test_a_refused_421_greeting_with_nothing_open_paces_without_tripping():
    shaper = shaper_at()
    report(shaper, 0.0, TOO_MANY, times=10)
    assert shaper.snapshot(0.0)["circuit"] == "closed"
    assert shaper.connect_wait(0.0, 0, 0, first_class=True) > 0  # cooling down


def test_timeouts_count_in_any_phase():
    shaper = shaper_at()
    report(shaper, 0.0, Reply("rcpt", 0, network="timeout"), times=2)
    report(shaper, 0.0, Reply("data_end", 0, network="timeout"))
    assert shaper.snapshot(0.0)["circuit"] == "open"


@pytest.mark.parametrize(
    "reply",
    [
        Reply("dns", 0, "4.4.3", network="dns"),  # says nothing about the site
        Reply("rcpt", 0, network="lost"),
        Reply("rcpt", 451, "4.3.0", "Temporarily deferred"),
        NO_SUCH_USER,
    ],
)
def test_what_does_not_trip_the_breaker(reply):
    shaper = shaper_at()
    report(shaper, 0.0, reply, times=10)
    assert shaper.snapshot(0.0)["circuit"] == "closed"


def test_an_answer_starts_the_failure_count_over():
    shaper = shaper_at()
    for _ in range(5):
        shaper.connect_failed(0.0)
        shaper.connect_failed(0.0)
        report(shaper, 0.0, NO_SUCH_USER)
    assert shaper.snapshot(0.0)["circuit"] == "closed"


# -- latency ---------------------------------------------------------------------------------


def test_a_greylisted_wave_grows_the_learned_rate():
    """A backlog's first attempts are all greylisted: the site answers at our pace, so the
    slow start goes on (else the whole wave, p0 first, goes out at 2/s)."""
    shaper = shaper_at()
    greylisted = Reply("rcpt", 450, "4.2.0", "Recipient address rejected: Greylisted")
    now = 0.0
    while now < 4.0:
        now += shaper.send_wait(now)
        shaper.sent(now)
        report(shaper, now, greylisted)
    assert shaper.snapshot(now)["messages_per_minute"] >= 4 * 120
    assert shaper.concurrency.limit == 2  # not a delivery for the concurrency


def slow_round(shaper: DestinationShaper, now: float, dot: float) -> float:
    """MAIL groups at their baseline, replies after the dot taking `dot` seconds, until a
    round of the dot's closes and is reacted to (not ours): the time then."""
    while True:
        now += dot + 0.5
        closed = shaper.timed(now, [("mail", 0.2), ("dot", dot)], 0.0)
        if closed is not None and closed.kind == "dot":
            shaper.react(now, closed, ours=False)
            return now


def test_silent_throttling_cuts_sessions_then_the_rate():
    shaper = shaper_at(pacing=Pacing(max_connections=8, initial_connections=8))
    now = slow_round(shaper, 0.0, 0.2)  # the baselines: 0.2 s
    assert shaper.concurrency.limit == 8
    now = slow_round(shaper, now, 2.0)  # the reply after the dot ten times slower
    assert shaper.concurrency.limit == 4
    snap = shaper.snapshot(now)
    assert snap["mode"] == "normal"  # a cut, not backoff mode
    assert snap["learned"]["phase"] != "paused"  # sessions first: the rate stands
    assert snap["latency"]["slowed"] == {
        "at": now,
        "ratio": 10.0,
        "kind": "dot",
        "from": 8,
        "to": 4,
        "rate_from": None,
        "rate_to": None,
    }
    assert snap["latency"]["last"] == {"kind": "dot", "ratio": 10.0, "verdict": "slow"}
    assert snap["latency"]["rate_per_minute"] is None
    for limit in (2, 1):  # slow again each round: cut again
        now = slow_round(shaper, now, 2.0)
        assert shaper.concurrency.limit == limit
    now = slow_round(shaper, now, 2.0)  # at one connection still slow: the rate it is
    snap = shaper.snapshot(now)
    taken = 60 / 2.5  # a dot every 2.5 s
    assert snap["latency"]["rate_per_minute"] == pytest.approx(pace_cap.BETA * taken)
    assert snap["messages_per_minute"] == pytest.approx(pace_cap.BETA * taken)
    assert snap["latency"]["slowed"]["rate_to"] == pytest.approx(pace_cap.BETA * taken)
    assert snap["learned"]["phase"] != "paused"  # the learned rate is for refusals
    changes = [(c.old, c.new, bool(c.rate_new)) for c in shaper.latency_changes()]
    assert changes == [(8, 4, False), (4, 2, False), (2, 1, False), (1, 1, True)]


def test_slowness_of_our_own_cuts_nothing():
    shaper = shaper_at(pacing=Pacing(max_connections=8, initial_connections=8))
    shaper.timed(0.0, [("dot", 0.2)], 0.0)
    closed = shaper.timed(30.0, [("dot", 2.0)] * 8, 0.0)
    assert closed is not None and closed.verdict == "slow"
    shaper.react(30.0, closed, ours=True)
    assert shaper.concurrency.limit == 8
    assert shaper.snapshot(30.0)["learned"]["phase"] != "paused"


# -- release after a reopening ---------------------------------------------------------------


def test_release_is_spread_soonest_first():
    shaper = shaper_at()
    times = shaper.released(100.0, 10, random.Random(1))
    assert times == sorted(times)
    assert all(100.0 + 3 * i <= t < 100.0 + 3 * (i + 1) for i, t in enumerate(times))
    assert shaper.released(100.0, 0, random.Random(1)) == []


@given(st.integers(1, 5000), st.integers(0, 2**32), st.floats(0, 1e9))
def test_release_is_never_a_herd(count, seed, now):
    """`count` items spread over the release window: in any slice of spread/count seconds
    at most two start, and all start within the window, the first ones soonest."""
    spread = SHAPING.release_spread
    times = shaper_at().released(now, count, random.Random(seed))
    assert len(times) == count
    assert times == sorted(times)
    assert all(now <= t <= now + spread for t in times)
    step = spread / count
    slack = 1e-9 * max(1.0, now)
    for i in range(count - 2):
        assert times[i + 2] - times[i] >= step - slack


# -- operator overrides ----------------------------------------------------------------------


def test_override_and_its_expiry():
    shaper = shaper_at(pacing=Pacing(max_connections=4, initial_connections=4, reserved_p0=0))
    shaper.override(0.0, rate_per_minute=6, concurrency=1, until=100.0)
    snap = shaper.snapshot(0.0)
    assert (snap["max"], snap["limit"], snap["messages_per_minute"]) == (1, 1, 6)
    assert snap["override"] == {"rate_per_minute": 6, "concurrency": 1, "until": 100.0}
    assert shaper.connect_wait(50.0, 1, 0, True) == math.inf
    shaper.sent(50.0)
    assert shaper.send_wait(50.0) == 0  # the burst
    # Expired: the configured limits are back (the limit grows back by successes), and
    # with no configured rate the learned one (slow start, 120/min) paces.
    snap = shaper.snapshot(100.0)
    assert (snap["max"], snap["messages_per_minute"], snap["override"]) == (4, 120, None)
    assert shaper.send_wait(100.0) == 0


def test_override_may_raise_the_ceiling_and_be_cleared():
    shaper = shaper_at()
    shaper.override(0.0, rate_per_minute=None, concurrency=20, until=None)
    assert shaper.snapshot(1e9)["max"] == 20  # no expiry
    shaper.override(0.0, rate_per_minute=None, concurrency=None, until=None)
    assert shaper.snapshot(0.0)["override"] is None
    assert shaper.snapshot(0.0)["max"] == 4


def test_backoff_scales_an_override():
    shaper = shaper_at()
    shaper.override(0.0, rate_per_minute=100, concurrency=None, until=None)
    shaper.force_backoff(0.0, until=10.0)
    assert shaper.snapshot(0.0)["messages_per_minute"] == pytest.approx(25)


def test_the_learned_rate_stays_under_the_ceiling_and_0_is_none():
    shaper = shaper_at(pacing=Pacing(messages_per_minute=30))
    assert shaper.snapshot(0.0)["messages_per_minute"] == pytest.approx(30)
    shaper.override(0.0, rate_per_minute=0, concurrency=None, until=None)
    assert shaper.snapshot(0.0)["messages_per_minute"] == pytest.approx(120)  # still paced


def test_an_operators_concurrency_replaces_the_learned_cap():
    shaper = shaper_at(pacing=Pacing(max_connections=8, initial_connections=8))
    shaper.result(0.0, TOO_MANY, classify(TOO_MANY), active=3)
    assert shaper.snapshot(0.0)["max"] == 2
    shaper.override(0.0, rate_per_minute=None, concurrency=6, until=None)
    assert shaper.snapshot(0.0)["max"] == 6
    shaper.override(0.0, rate_per_minute=None, concurrency=None, until=None)
    assert shaper.snapshot(0.0)["max"] == 2  # what was learned is still there


def test_override_refuses_nonsense():
    shaper = shaper_at()
    with pytest.raises(ValueError):
        shaper.override(0.0, rate_per_minute=None, concurrency=0, until=None)
    with pytest.raises(ValueError):
        shaper.override(0.0, rate_per_minute=-1, concurrency=None, until=None)


def test_snapshot_is_json():
    shaper = shaper_at()
    shaper.override(0.0, rate_per_minute=6, concurrency=None, until=50.0)
    report(shaper, 0.0, TOO_MANY, times=3)
    snap = shaper.snapshot(1.0)
    assert json.loads(json.dumps(snap)) == snap
    assert set(snap) >= {"limit", "max", "mode", "stage", "circuit", "reopen_at", "override"}


# -- pacing by destination -------------------------------------------------------------------


def rules(*destinations: DestinationRule) -> ShapingConfig:
    return ShapingConfig(
        default=Pacing(max_connections=10, burst=7), destinations=list(destinations)
    )


def test_pacing_for_the_default():
    shaping = rules()
    assert pacing_for(shaping, "example.com", ["mx.example.com"]) == shaping.default


def test_pacing_for_a_domain():
    shaping = rules(DestinationRule(domain="Example.COM", max_connections=2))
    pacing = pacing_for(shaping, "example.com.", [])
    assert (pacing.max_connections, pacing.burst) == (2, 7)  # the rest from the default
    assert pacing_for(shaping, "sub.example.com", []) == shaping.default


def test_pacing_for_an_mx_suffix():
    shaping = rules(
        DestinationRule(mx_suffix=".google.com", max_connections=5),
        DestinationRule(mx_suffix="yahoodns.net", max_connections=3),
    )
    assert pacing_for(shaping, "a.test", ["ASPMX.L.GOOGLE.COM."]).max_connections == 5
    assert pacing_for(shaping, "a.test", (h for h in ["x.test", "mta5.am0.yahoodns.net"])) == (
        Pacing(max_connections=3, burst=7)
    )
    assert pacing_for(shaping, "a.test", ["yahoodns.net"]).max_connections == 3
    assert pacing_for(shaping, "a.test", ["notyahoodns.net"]) == shaping.default
    assert pacing_for(shaping, "a.test", ["google.com"]) == shaping.default


def test_pacing_first_match_wins():
    shaping = rules(
        DestinationRule(mx_suffix=".outlook.com", max_connections=5),
        DestinationRule(domain="hotmail.com", max_connections=1),
    )
    assert pacing_for(shaping, "hotmail.com", ["x.olc.protection.outlook.com"]).max_connections == 5
    assert pacing_for(shaping, "hotmail.com", ["mx.other.test"]).max_connections == 1


# -- properties ------------------------------------------------------------------------------

RATE, BURST = 60.0, 3  # messages per minute


class Shaper(RuleBasedStateMachine):
    """Random traffic and feedback: concurrency stays within its bounds, the circuit's
    state and the admission agree, and sends never beat the configured rate."""

    REPLIES = (DELIVERED, THROTTLED, TOO_MANY, REFUSED, NO_SUCH_USER)

    def __init__(self) -> None:
        super().__init__()
        pacing = Pacing(
            max_connections=6, initial_connections=2, messages_per_minute=RATE, burst=BURST
        )
        self.shaper = shaper_at(pacing=pacing)
        self.now = 0.0
        self.open: list[bool] = []  # the connections open: first-class only or not
        self.sends: list[float] = []

    @rule(first_class=st.booleans())
    def connect(self, first_class):
        wait = self.shaper.connect_wait(self.now, len(self.open), sum(self.open), first_class)
        assert wait >= 0
        if wait == 0:
            self.shaper.connected(self.now)
            self.open.append(first_class)

    @rule()
    def close(self):
        if self.open:
            self.open.pop(0)

    @rule()
    def each_takes_work(self):
        """Every connection asks whether it may go on, as workers do between messages:
        afterwards the open ones fit the limit and the ordinary ones their share."""
        for first_class in list(self.open):
            if not self.shaper.keeps(self.now, len(self.open), sum(self.open), first_class):
                self.open.remove(first_class)
        limit = self.shaper.concurrency.limit
        ordinary = len(self.open) - sum(self.open)
        assert len(self.open) <= limit
        assert ordinary <= max(1, limit - self.shaper.pacing.reserved_p0)

    @rule()
    def send(self):
        if self.shaper.send_wait(self.now) == 0:
            self.shaper.sent(self.now)
            self.sends.append(self.now)

    @rule(reply=st.sampled_from(REPLIES))
    def result(self, reply):
        self.shaper.result(self.now, reply, classify(reply))

    @rule()
    def connect_failed(self):
        self.shaper.connect_failed(self.now)

    @rule(seconds=st.floats(0.01, 30), ours=st.booleans())
    def latency(self, seconds, ours):
        closed = self.shaper.timed(self.now, [("dot", seconds)] * 3, 0.0)
        if closed is not None:
            self.shaper.react(self.now, closed, ours)

    @rule(seconds=st.sampled_from([0.1, 1.0, 5.0, 31.0, 300.0, 601.0]))
    def wait(self, seconds):
        self.now += seconds

    @invariant()
    def concurrency_within_bounds(self):
        snap = self.shaper.snapshot(self.now)
        assert 1 <= snap["limit"] <= snap["max"] <= 6

    @invariant()
    def circuit_and_admission_agree(self):
        snap = self.shaper.snapshot(self.now)
        wait = self.shaper.connect_wait(self.now, 0, 0, True)
        cooling = self.shaper.learner.wait(self.now)
        if snap["circuit"] == "open":
            assert wait == pytest.approx(max(snap["reopen_at"] - self.now, cooling))
        elif snap["circuit"] == "closed":
            assert wait == cooling

    @invariant()
    def a_cool_down_holds_every_connection(self):
        """While a throttle episode cools down, no message and no connection goes."""
        cooling = self.shaper.learner.wait(self.now)
        if cooling:
            assert self.shaper.send_wait(self.now) >= cooling
            assert self.shaper.connect_wait(self.now, 0, 0, True) >= cooling

    @invariant()
    def sends_never_beat_the_rate(self):
        for i, first in enumerate(self.sends):
            count = len(self.sends) - i
            assert count <= BURST + RATE / 60 * (self.sends[-1] - first) + 1e-6


TestShaper = Shaper.TestCase


def test_at_rest_only_with_nothing_to_remember():
    shaper = shaper_at()
    assert shaper.at_rest(0.0)
    shaper.override(0.0, rate_per_minute=6, concurrency=None, until=10.0)
    assert not shaper.at_rest(5.0) and shaper.at_rest(10.0)  # until the override ends
    shaper.force_backoff(20.0, 30.0)
    assert not shaper.at_rest(20.0)  # backoff mode
    shaper.force_backoff(21.0, 21.0)  # back to normal
    for _ in range(5):
        shaper.connect_failed(22.0)
    assert not shaper.at_rest(22.0)  # the circuit is open


LISTED = Reply("mail", 554, "5.7.1", "Client host [192.0.2.1] blocked using zen.spamhaus.org")
UNAUTHENTICATED = Reply("rcpt", 550, "5.7.26", "This mail is unauthenticated (DMARC policy)")


def test_our_address_refused_pauses_the_destination_for_the_sender_block_pause():
    shaper = shaper_at(sender_block_pause=1800.0)
    report(shaper, 10.0, LISTED)
    snap = shaper.snapshot(10.0)
    assert (snap["circuit"], snap["reopen_at"]) == ("open", 1810.0)
    assert snap["blocked_by"].startswith("554 5.7.1")
    assert shaper.connect_wait(10.0, 0, 0, True) == pytest.approx(1800.0)
    # The probe after the pause is refused again: paused again, the reply kept.
    assert shaper.connect_wait(1810.0, 0, 0, True) == 0
    shaper.connected(1810.0)
    report(shaper, 1811.0, LISTED)
    assert shaper.snapshot(1811.0)["circuit"] == "open"
    assert shaper.connect_wait(1811.0, 0, 0, True) >= 1800.0
    # Delisted: the probe delivers, the pause and its reply are over.
    shaper.connected(3700.0)
    report(shaper, 3701.0, DELIVERED)
    snap = shaper.snapshot(3701.0)
    assert (snap["circuit"], snap["blocked_by"]) == ("closed", None)


def test_failed_authentication_follows_the_message_and_pauses_nothing():
    shaper = shaper_at()
    report(shaper, 10.0, UNAUTHENTICATED)
    snap = shaper.snapshot(10.0)
    assert (snap["circuit"], snap["blocked_by"]) == ("closed", None)
    assert shaper.connect_wait(10.0, 0, 0, False) == 0


def test_the_knee_and_the_baselines_outlive_a_restart():
    shaper = shaper_at(pacing=Pacing(max_connections=8, initial_connections=3))
    now = slow_round(shaper, 0.0, 0.2)  # calm at 3: the first step up is free
    while shaper.concurrency.limit < 4:
        report(shaper, now, DELIVERED)
    now = slow_round(shaper, now, 2.0)  # 4 slowed it: back to 3, its knee
    assert (shaper.concurrency.limit, shaper.concurrency.knee) == (3, 3)
    saved = rate_learner.encode({"d": shaper.learned(now)})
    learned = rate_learner.decode(saved)[0]["d"]
    assert learned.sessions == 3 and learned.latency["dot"] == 0.2
    again = DestinationShaper(shaper.pacing, SHAPING, now + 60, learned)
    assert again.concurrency.knee == 3
    assert again.slowdown.latency.baseline("dot", now + 60) == 0.2
    assert again.snapshot(now + 60)["latency"]["knee"] == 3


def test_the_rate_ceiling_outlives_a_restart_and_forget_drops_it():
    shaper = shaper_at(pacing=Pacing(max_connections=1, initial_connections=1))
    now = slow_round(shaper, 0.0, 0.2)
    now = slow_round(shaper, now, 2.0)  # slow at one connection: a rate ceiling
    ceiling = shaper.pace.rate
    assert ceiling > 0
    learned = rate_learner.decode(rate_learner.encode({"d": shaper.learned(now)}))[0]["d"]
    assert learned.paced == ceiling
    again = DestinationShaper(shaper.pacing, SHAPING, now + 60, learned)
    assert again.snapshot(now + 60)["latency"]["rate_per_minute"] == round(ceiling * 60, 2)
    assert again.snapshot(now + 60)["messages_per_minute"] == pytest.approx(ceiling * 60)
    again.forget(now + 61)
    assert again.pace.rate == 0.0
    assert again.snapshot(now + 61)["latency"]["rate_per_minute"] is None


def test_a_step_up_that_raised_the_replies_steps_back_to_the_knee():
    """Gentler than a slowdown: 0.25 s after the dot at 3 sessions, 0.45 s at 4 (1.8x,
    under latency_factor): the step up was one too many."""
    shaper = shaper_at(pacing=Pacing(max_connections=8, initial_connections=3))
    now = slow_round(shaper, 0.0, 0.25)
    while shaper.concurrency.limit < 4:
        report(shaper, now, DELIVERED)
    now = slow_round(shaper, now, 0.45)
    assert (shaper.concurrency.limit, shaper.concurrency.knee) == (3, 3)
    assert shaper.snapshot(now)["latency"]["last"]["verdict"] == "rose"
    assert shaper.snapshot(now)["learned"]["phase"] != "paused"  # the rate stands
    now = slow_round(shaper, now, 0.45)  # slower again with no step up: nothing more
    assert shaper.concurrency.limit == 3
