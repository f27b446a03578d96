"""Alert rules (mtaqueue.alerts): each incident is logged once when it starts, once when it
clears."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtaqueue import config
from mtaqueue.alerts import (
    CLEARED,
    FIRING,
    AlertRule,
    Alerts,
    DeferralRate,
    DepthGrowing,
    DestinationStats,
    MemoryGrowing,
    OldestAge,
    ReviewOldestAge,
    ReviewSize,
    SenderBlocked,
    Snapshot,
    SpoolFree,
    WebhookBacklog,
)
from mtaqueue.config.table import convert

GIB = 2**30


def snap(oldest=None, destinations=None, free=10 * GIB) -> Snapshot:
    return Snapshot(oldest or {}, destinations or {}, free)


def stats(depth=0, attempts=0, deferrals=0) -> DestinationStats:
    return DestinationStats(depth, attempts, deferrals)


def states(events: list[dict]) -> list[tuple[str, str, str]]:
    return [(e["name"], e["subject"], e["state"]) for e in events]


def test_oldest_age_fires_once_and_clears_once():
    alerts = Alerts([OldestAge(klass="p0", over=900.0)])
    assert alerts.evaluate(0, snap({"p0": 100.0})) == []
    [event] = alerts.evaluate(10, snap({"p0": 901.0, "p1": 5000.0}))
    assert event == {
        "event": "alert",
        "name": "oldest_age",
        "state": FIRING,
        "subject": "p0",
        "value": 901.0,
        "threshold": 900.0,
    }
    assert alerts.active() == [("oldest_age", "p0")]
    assert alerts.evaluate(20, snap({"p0": 2000.0})) == []  # still firing: no repeat
    [event] = alerts.evaluate(30, snap({}))  # the old message left
    assert (event["state"], event["value"]) == (CLEARED, 0)
    assert alerts.active() == []
    assert alerts.evaluate(40, snap({})) == []


def test_a_star_rule_covers_each_subject_and_a_name_replaces_the_type():
    alerts = Alerts([OldestAge(name="stale", klass="*", over=60.0)])
    events = alerts.evaluate(0, snap({"p0": 61.0, "p1": 10.0, "p2": 3600.0}))
    assert states(events) == [("stale", "p0", FIRING), ("stale", "p2", FIRING)]
    assert alerts.active() == [("stale", "p0"), ("stale", "p2")]


def test_deferral_rate_over_the_window():
    alerts = Alerts([DeferralRate(over=0.5, window=600.0, min_attempts=10)])
    gmail = "gmail-smtp-in.l.google.com"
    assert alerts.evaluate(0, snap(destinations={gmail: stats(5, 0, 0)})) == []
    # 20 attempts, 8 deferred: 40%
    assert alerts.evaluate(60, snap(destinations={gmail: stats(5, 20, 8)})) == []
    # 40 attempts, 28 deferred over the window: 70%
    [event] = alerts.evaluate(120, snap(destinations={gmail: stats(5, 40, 28)}))
    assert (event["subject"], event["state"], event["value"]) == (gmail, FIRING, 0.7)
    assert event["threshold"] == 0.5
    assert alerts.evaluate(300, snap(destinations={gmail: stats(5, 50, 35)})) == []  # no repeat
    # At 720 the window starts after 120: 20 attempts since, 2 deferred.
    [event] = alerts.evaluate(720, snap(destinations={gmail: stats(5, 60, 30)}))
    assert (event["state"], event["value"]) == (CLEARED, 0.1)


def test_deferral_rate_needs_enough_attempts():
    alerts = Alerts([DeferralRate(destination="example.org", over=0.5, window=600.0)])
    assert alerts.evaluate(0, snap(destinations={"example.org": stats(1, 3, 3)})) == []
    events = alerts.evaluate(60, snap(destinations={"example.org": stats(1, 12, 12)}))
    assert states(events) == [("deferral_rate", "example.org", FIRING)]


def test_deferral_rate_counts_a_new_destination_from_zero_and_survives_a_reset():
    alerts = Alerts([DeferralRate(over=0.5, window=600.0)])
    # First seen with 10 attempts already made: all of them are recent.
    [event] = alerts.evaluate(0, snap(destinations={"a": stats(1, 10, 9)}))
    assert event["state"] == FIRING
    # The counters started over (metrics forgot the destination): a new count, not negative.
    assert alerts.evaluate(60, snap(destinations={"a": stats(1, 12, 12)})) == []
    [event] = alerts.evaluate(120, snap(destinations={"a": stats(1, 3, 0)}))
    assert event["state"] == CLEARED  # 3 attempts since the restart: too few to tell


def test_a_destination_that_leaves_the_snapshot_clears():
    alerts = Alerts([DeferralRate(over=0.5, window=600.0)])
    alerts.evaluate(0, snap(destinations={"a": stats(1, 10, 10)}))
    assert alerts.active() == [("deferral_rate", "a")]
    [event] = alerts.evaluate(60, snap())
    assert (event["subject"], event["state"], event["value"]) == ("a", CLEARED, 0)


def test_depth_growing_for_a_period():
    alerts = Alerts([DepthGrowing(destination="*", period=1800.0, over=10)])
    for minute, depth in enumerate([5, 8, 8, 20, 30]):
        assert alerts.evaluate(minute * 60, snap(destinations={"d": stats(depth)})) == []
    [event] = alerts.evaluate(1800, snap(destinations={"d": stats(40)}))
    assert event == {
        "event": "alert",
        "name": "depth_growing",
        "state": FIRING,
        "subject": "d",
        "value": 1800.0,
        "threshold": 1800.0,
    }
    assert alerts.evaluate(1860, snap(destinations={"d": stats(40)})) == []  # flat: still on
    [event] = alerts.evaluate(1920, snap(destinations={"d": stats(39)}))  # went down
    assert event["state"] == CLEARED


def test_depth_growing_needs_growth_and_the_minimum_depth():
    flat = Alerts([DepthGrowing(period=60.0)])
    for t in (0, 60, 120):
        assert flat.evaluate(t, snap(destinations={"d": stats(50)})) == []
    small = Alerts([DepthGrowing(period=60.0, over=10)])
    for t, depth in ((0, 1), (60, 5), (120, 9)):
        assert small.evaluate(t, snap(destinations={"d": stats(depth)})) == []


def test_spool_free():
    alerts = Alerts([SpoolFree(under=GIB)])
    assert alerts.evaluate(0, snap(free=2 * GIB)) == []
    [event] = alerts.evaluate(1, snap(free=GIB - 1))
    assert (event["subject"], event["value"], event["threshold"]) == ("spool", GIB - 1, GIB)
    [event] = alerts.evaluate(2, snap(free=GIB))
    assert event["state"] == CLEARED


def test_a_reload_keeps_the_alerts_of_rules_that_stay_and_clears_the_others():
    stale, low = OldestAge(klass="p0", over=60.0), SpoolFree(under=GIB)
    alerts = Alerts([stale, low])
    assert len(alerts.evaluate(0, snap({"p0": 100.0}, free=1))) == 2
    # The same rule, decoded again, is the same rule: still firing, nothing to say.
    [event] = alerts.reconfigure([OldestAge(klass="p0", over=60.0)])
    assert (event["name"], event["state"], event["threshold"]) == ("spool_free", CLEARED, GIB)
    assert alerts.active() == [("oldest_age", "p0")]
    assert alerts.evaluate(60, snap({"p0": 160.0}, free=1)) == []


def test_the_review_queue_alerts_on_its_size_and_on_its_longest_wait():
    alerts = Alerts([ReviewSize(over=2), ReviewOldestAge(name="review_stale", over=3600.0)])
    assert alerts.evaluate(0, Snapshot({}, {}, GIB, review_size=2, review_oldest_age=60)) == []
    [event] = alerts.evaluate(10, Snapshot({}, {}, GIB, review_size=3, review_oldest_age=70))
    assert event == {
        "event": "alert",
        "name": "review_size",
        "state": FIRING,
        "subject": "review",
        "value": 3,
        "threshold": 2,
    }
    # Nobody acted for an hour: the owner is paged, once.
    [event] = alerts.evaluate(20, Snapshot({}, {}, GIB, review_size=3, review_oldest_age=3601))
    assert (event["name"], event["state"], event["value"]) == ("review_stale", FIRING, 3601)
    assert alerts.evaluate(30, Snapshot({}, {}, GIB, review_size=3, review_oldest_age=4000)) == []
    assert alerts.active() == [("review_size", "review"), ("review_stale", "review")]
    events = alerts.evaluate(40, snap())  # the review queue emptied
    assert states(events) == [
        ("review_size", "review", CLEARED),
        ("review_stale", "review", CLEARED),
    ]


def test_a_webhook_backlog_alerts_while_its_oldest_event_waits_too_long():
    alerts = Alerts([WebhookBacklog(over=900.0)])
    hooks = {"app": 100.0, "crm": 0.0}
    assert alerts.evaluate(0, Snapshot({}, {}, GIB, webhooks=hooks)) == []
    [event] = alerts.evaluate(10, Snapshot({}, {}, GIB, webhooks={"app": 901.0, "crm": 0.0}))
    assert (event["name"], event["subject"], event["state"]) == ("webhook_backlog", "app", FIRING)
    [event] = alerts.evaluate(20, Snapshot({}, {}, GIB, webhooks={"app": 0.0, "crm": 0.0}))
    assert (event["subject"], event["state"]) == ("app", CLEARED)


def test_a_destination_that_refused_our_address_alerts_until_it_takes_mail_again():
    alerts = Alerts([SenderBlocked()])
    blocked = DestinationStats(5, 1, 1, blocked=True)
    assert alerts.evaluate(0, snap(destinations={"mx.example.org": stats(5)})) == []
    events = alerts.evaluate(1, snap(destinations={"mx.example.org": blocked}))
    assert states(events) == [("sender_blocked", "mx.example.org", FIRING)]
    assert alerts.evaluate(2, snap(destinations={"mx.example.org": blocked})) == []
    events = alerts.evaluate(3, snap(destinations={"mx.example.org": stats(0, 2, 1)}))
    assert states(events) == [("sender_blocked", "mx.example.org", CLEARED)]


def test_the_shipped_default_alerts_on_a_blocked_sender_and_a_leak():
    assert config.Config().alerts.rules == [SenderBlocked(), MemoryGrowing()]


def test_rules_decode_from_the_config_with_its_units():
    raw = [
        {"type": "oldest_age", "class": "p0", "over": "15m"},
        {"type": "deferral_rate", "over": 0.3, "window": "10m", "name": "gmail_4xx"},
        {"type": "depth_growing", "destination": "mx.example", "for": "30m", "over": 100},
        {"type": "spool_free", "under": "1GiB"},
        {"type": "review_size", "over": 50},
        {"type": "review_oldest_age", "over": "4h"},
        {"type": "webhook_backlog", "webhook": "app", "over": "15m"},
    ]
    rules = convert(raw, list[AlertRule], "alerts.rules")
    assert rules == [
        OldestAge(klass="p0", over=900.0),
        DeferralRate(name="gmail_4xx", over=0.3, window=600.0),
        DepthGrowing(destination="mx.example", period=1800.0, over=100),
        SpoolFree(under=GIB),
        ReviewSize(over=50),
        ReviewOldestAge(over=4 * 3600.0),
        WebhookBacklog(webhook="app", over=900.0),
    ]
    with pytest.raises(config.ConfigError, match=r"alerts\.rules\[0\]\.over: expected float"):
        convert(
            [{"type": "deferral_rate", "over": 2, "window": "1m"}], list[AlertRule], "alerts.rules"
        )
    with pytest.raises(config.ConfigError, match=r"alerts\.rules\[0\]\.klass: unknown key"):
        convert([{"type": "oldest_age", "klass": "p0", "over": 1}], list[AlertRule], "alerts.rules")


# -- any sequence of snapshots: firing and cleared alternate, and active() agrees ------------

RULES = [
    OldestAge(klass="*", over=100.0),
    OldestAge(name="p0_stale", klass="p0", over=10.0),
    DeferralRate(over=0.5, window=120.0, min_attempts=3),
    DeferralRate(name="a_4xx", destination="a", over=0.2, window=30.0, min_attempts=1),
    DepthGrowing(period=60.0, over=2),
    SpoolFree(under=100),
    ReviewSize(over=1),
    ReviewOldestAge(over=60.0),
]


@st.composite
def snapshots(draw) -> Snapshot:
    oldest = draw(st.dictionaries(st.sampled_from(["p0", "p1"]), st.floats(0, 300)))
    destinations = {}
    for name in draw(st.sets(st.sampled_from(["a", "b", "c"]))):
        attempts = draw(st.integers(0, 50))
        deferrals = draw(st.integers(0, attempts))
        destinations[name] = stats(draw(st.integers(0, 20)), attempts, deferrals)
    review = draw(st.integers(0, 3))
    age = draw(st.floats(0, 120)) if review else 0.0
    return Snapshot(oldest, destinations, draw(st.integers(0, 200)), review, age)


reloads = st.lists(st.sampled_from(RULES), unique=True).map(lambda rules: ("reload", rules))
evaluations = st.tuples(st.just("evaluate"), st.tuples(st.floats(1, 90), snapshots()))


@given(st.lists(evaluations | reloads, max_size=40))
def test_alerts_alternate_firing_and_cleared(steps):
    alerts = Alerts(RULES)
    last: dict[tuple[str, str], str] = {}
    now = 0.0
    for action, arg in steps:
        if action == "reload":
            events = alerts.reconfigure(arg)
        else:
            step, snapshot = arg
            now += step
            events = alerts.evaluate(now, snapshot)
        for event in events:
            key = (event["name"], event["subject"])
            expected = CLEARED if last.get(key) == FIRING else FIRING
            assert event["state"] == expected, (key, event)
            last[key] = event["state"]
        assert alerts.active() == sorted(k for k, state in last.items() if state == FIRING)


MIB = 2**20


def memory(rss: dict[str, int], queued: int) -> Snapshot:
    return Snapshot({}, {}, 10 * GIB, resident=rss, queued=queued)


def run_memory(rule: MemoryGrowing, daemon, writer, queued, minutes: int) -> list[dict]:
    """An evaluation a minute; each series is a function of the minute."""
    alerts, events = Alerts([rule]), []
    for m in range(minutes + 1):
        rss = {"daemon": daemon(m), "writer": writer(m)}
        events += alerts.evaluate(60.0 * m, memory(rss, queued(m)))
    return events


def test_memory_that_keeps_rising_while_the_queue_is_level_fires_for_that_process():
    rule = MemoryGrowing(over=64 * MIB, period=3600.0)
    events = run_memory(
        rule,
        daemon=lambda m: 100 * MIB + m * 2 * MIB,  # +120 MiB an hour, straight
        writer=lambda m: 50 * MIB,
        queued=lambda m: 200 + m % 7,
        minutes=90,
    )
    assert states(events)[0] == ("memory_growing", "daemon", FIRING)
    assert {e["subject"] for e in events} == {"daemon"}
    assert events[0]["value"] > 64 * MIB and events[0]["threshold"] == 64 * MIB


def test_a_step_after_a_burst_or_memory_that_follows_the_queue_does_not_fire():
    rule = MemoryGrowing(over=64 * MIB, period=3600.0)
    step = run_memory(  # a burst at minute 30: the allocator keeps the memory, flat after
        rule,
        daemon=lambda m: 100 * MIB if m < 30 else 300 * MIB,
        writer=lambda m: 50 * MIB,
        queued=lambda m: 200,
        minutes=180,
    )
    assert step == []
    load = run_memory(  # memory rises with the queue: load, not a leak
        rule,
        daemon=lambda m: 100 * MIB + m * 2 * MIB,
        writer=lambda m: 50 * MIB,
        queued=lambda m: 200 + m * 1000,
        minutes=180,
    )
    assert load == []


def test_memory_growing_waits_for_its_window():
    rule = MemoryGrowing(over=64 * MIB, period=3600.0)
    early = run_memory(
        rule,
        daemon=lambda m: 100 * MIB + m * 10 * MIB,
        writer=lambda m: 50 * MIB,
        queued=lambda m: 200,
        minutes=59,  # not an hour of samples yet
    )
    assert early == []
