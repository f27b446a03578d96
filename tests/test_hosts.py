"""Per-host suspend timers (mtaqueue.policy.hosts)."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mtaqueue.policy.hosts import HostSuspensions, host_key
from mtaqueue.policy.replies import Reply

BASE, MAX = 60.0, 3600.0


@pytest.fixture
def hosts() -> HostSuspensions:
    return HostSuspensions(BASE, MAX)


def fail_at_each_release(hosts: HostSuspensions, host: str, times: int, now: float = 0.0):
    """Fail `host` again the moment each suspension ends; the suspension lengths."""
    lengths = []
    for _ in range(times):
        until = hosts.failed(host, now)
        lengths.append(until - now)
        now = until
    return lengths


def test_suspension_doubles_up_to_the_maximum(hosts):
    lengths = fail_at_each_release(hosts, "mx1", 9)
    assert lengths == [60, 120, 240, 480, 960, 1920, 3600, 3600, 3600]


def test_a_success_resets(hosts):
    fail_at_each_release(hosts, "mx1", 3)
    hosts.succeeded("mx1")
    assert not hosts.suspended("mx1", 0.0)
    assert hosts.failed("mx1", 10_000.0) == 10_000 + BASE
    hosts.succeeded("unknown.example")  # nothing to forget: fine


def test_suspended_until_the_release(hosts):
    until = hosts.failed("mx1", 100.0)
    assert until == 160
    assert hosts.suspended("mx1", 100.0)
    assert hosts.suspended("mx1", 159.999)
    assert not hosts.suspended("mx1", 160.0)
    assert not hosts.suspended("mx2", 100.0)


def test_failures_while_suspended_are_the_same_outage(hosts):
    # Five connections in flight when the host broke all report it.
    until = hosts.failed("mx1", 100.0)
    assert [hosts.failed("mx1", 100.0 + i) for i in range(5)] == [until] * 5
    # The next failure after the release is the second of the streak.
    assert hosts.failed("mx1", until + 1) == until + 1 + 2 * BASE


def test_a_streak_is_forgotten_after_a_quiet_maximum(hosts):
    assert fail_at_each_release(hosts, "mx1", 3) == [60, 120, 240]  # released at 420
    # Failing again within `maximum` of the release continues the streak ...
    again = HostSuspensions(BASE, MAX)
    fail_at_each_release(again, "mx1", 3)
    assert again.failed("mx1", 420 + MAX - 1) == 420 + MAX - 1 + 480
    # ... after that it starts over.
    assert hosts.failed("mx1", 420 + MAX) == 420 + MAX + BASE


def test_available_keeps_the_order(hosts):
    hosts.failed("mx2", 0.0)
    assert hosts.available(["mx1", "mx2", "mx3"], 10.0) == ["mx1", "mx3"]
    assert hosts.available(["mx3", "mx2", "mx1"], 10.0) == ["mx3", "mx1"]
    assert hosts.available(["mx1", "mx2", "mx3"], 60.0) == ["mx1", "mx2", "mx3"]
    assert hosts.available([], 10.0) == []
    assert hosts.available(iter(["mx2", "mx4"]), 10.0) == ["mx4"]


def test_next_release(hosts):
    hosts.failed("mx1", 0.0)  # until 60
    fail_at_each_release(hosts, "mx2", 2, now=-60.0)  # until 60 + 120 = 120
    assert hosts.next_release(["mx1", "mx2", "mx3"], 10.0) is None  # mx3 is there
    assert hosts.next_release(["mx1", "mx2"], 10.0) == 60
    assert hosts.next_release(["mx2"], 10.0) == 120
    assert hosts.next_release(iter(["mx2", "mx1"]), 10.0) == 60
    assert hosts.next_release(["mx1", "mx2"], 60.0) is None  # mx1 is back
    assert hosts.next_release([], 10.0) is None


def test_snapshot(hosts):
    hosts.failed("mx1", 0.0)
    assert hosts.snapshot(10.0) == {"mx1": 60.0}
    hosts.failed("mx2", 30.0)
    assert hosts.snapshot(40.0) == {"mx1": 60.0, "mx2": 90.0}
    assert hosts.snapshot(70.0) == {"mx2": 90.0}
    assert hosts.snapshot(90.0) == {}


def test_a_host_is_a_name_and_a_port(hosts):
    # Two servers behind one address on different ports: one failing leaves the other be.
    assert host_key("mx1.example", 25) == "mx1.example"
    assert host_key("127.0.0.1", 2526) == "127.0.0.1:2526"
    assert host_key("::1", 2526) == "[::1]:2526"
    hosts.failed(host_key("127.0.0.1", 2526), 0.0)
    assert hosts.suspended("127.0.0.1:2526", 1.0)
    assert not hosts.suspended(host_key("127.0.0.1", 2527), 1.0)
    assert hosts.snapshot(1.0) == {"127.0.0.1:2526": 60.0}


def test_the_reason_is_the_failure_that_started_the_outage(hosts):
    refused = Reply("connect", 0, network="refused")
    hosts.failed("mx1", 0.0, refused)
    hosts.failed("mx1", 10.0, Reply("connect", 0, network="timeout"))  # the same outage
    assert hosts.reason("mx1") == refused
    assert hosts.reason("mx2") is None
    hosts.succeeded("mx1")
    assert hosts.reason("mx1") is None


def test_expired_entries_are_forgotten_lazily(hosts):
    for i in range(10):
        hosts.failed(f"mx{i}", 0.0)
    assert len(hosts) == 10
    hosts.snapshot(100.0)  # released, still on a streak
    assert len(hosts) == 10
    assert not hosts.suspended("mx0", 60 + MAX)  # a look forgets a stale one
    assert len(hosts) == 9
    assert hosts.snapshot(60 + MAX) == {}
    assert len(hosts) == 0


def test_memory_is_bounded():
    hosts = HostSuspensions(BASE, MAX, limit=100)
    for i in range(1000):
        hosts.failed(f"mx{i}.example", float(i))
        assert len(hosts) <= 100
    # The newest failures are the ones kept.
    assert hosts.suspended("mx999.example", 999.0)
    assert not hosts.suspended("mx0.example", 999.0)


def test_a_zero_base_never_suspends():
    hosts = HostSuspensions(0.0, 0.0)
    assert hosts.failed("mx1", 5.0) == 5.0
    assert not hosts.suspended("mx1", 5.0)


def test_a_long_streak_does_not_overflow():
    hosts = HostSuspensions(BASE, MAX)
    assert fail_at_each_release(hosts, "mx1", 2000)[-1] == MAX


# -- per (source, host) ------------------------------------------------------------------------

A, B, C = "192.0.2.11", "192.0.2.12", "192.0.2.13"
REFUSED = Reply("connect", 0, network="refused")
TIMEOUT = Reply("banner", 0, network="timeout")
NOT_YOU = Reply("banner", 554, "5.7.1", f"{A} no SMTP service for you")


def test_a_host_that_answers_one_source_with_a_refusal_is_suspended_for_it_alone(hosts):
    until = hosts.failed("mx1", 0.0, NOT_YOU, source=A)
    assert until == 60.0 and hosts.suspended("mx1", 10.0, A)
    assert not hosts.suspended("mx1", 10.0, B) and not hosts.suspended("mx1", 10.0)
    assert hosts.available(["mx1", "mx2"], 10.0, B) == ["mx1", "mx2"]
    assert (
        hosts.next_release(["mx1"], 10.0, A) == 60.0
        and hosts.next_release(["mx1"], 10.0, B) is None
    )
    assert hosts.reason("mx1", A) == NOT_YOU and hosts.reason("mx1", B) is None
    assert hosts.snapshot(10.0, A) == {"mx1": 60.0} and hosts.snapshot(10.0, B) == {}
    # Another source answered too: still each its own, never the host for all.
    hosts.failed("mx1", 5.0, Reply("banner", 554, "", f"{B} go away"), source=B)
    hosts.failed("mx1", 6.0, REFUSED, source=C)
    assert not hosts.suspended("mx1", 10.0) and not hosts.suspended("mx1", 10.0, "192.0.2.14")


def test_a_host_silent_to_two_sources_is_down_for_every_source(hosts):
    hosts.failed("mx1", 0.0, REFUSED, source=A)
    assert not hosts.suspended("mx1", 1.0, B)  # one address refused: perhaps only it
    until = hosts.failed("mx1", 1.0, TIMEOUT, source=B)
    assert until == 61.0
    for source in (C, ""):  # sources yet to try it skip it
        assert hosts.until("mx1", 2.0, source) == 61.0
        assert hosts.reason("mx1", source) == TIMEOUT
    assert hosts.until("mx1", 2.0, A) == 61.0  # the later of its own and the host's
    # Connections in flight when it broke: the same outage, not a longer one.
    assert hosts.failed("mx1", 3.0, REFUSED, source=C) == 61.0
    # Still down after its release: the streak doubles for every source.
    hosts.failed("mx1", 61.0, REFUSED, source=A)
    hosts.failed("mx1", 62.0, REFUSED, source=C)
    assert hosts.until("mx1", 63.0, "192.0.2.14") == 62.0 + 2 * BASE


def test_a_success_from_any_source_ends_the_outage_but_not_anothers_refusal(hosts):
    hosts.failed("mx1", 0.0, NOT_YOU, source=A)
    hosts.failed("mx1", 0.0, REFUSED, source=B)
    hosts.failed("mx1", 0.0, REFUSED, source=C)
    assert hosts.suspended("mx1", 1.0, "")
    hosts.succeeded("mx1", source="")
    assert not hosts.suspended("mx1", 1.0, "") and not hosts.suspended("mx1", 1.0, "x")
    assert hosts.suspended("mx1", 1.0, A) and hosts.suspended("mx1", 1.0, B)
    hosts.succeeded("mx1", source=A)
    assert not hosts.suspended("mx1", 1.0, A) and hosts.suspended("mx1", 1.0, B)
    assert len(hosts) == 1


def test_the_quorum_is_of_suspensions_running_at_once(hosts):
    hosts.failed("mx1", 0.0, REFUSED, source=A)  # until 60
    hosts.failed("mx1", 60.0, REFUSED, source=B)  # A's is over
    assert not hosts.suspended("mx1", 61.0, C)


@given(
    st.lists(
        st.tuples(st.sampled_from([A, B, C, ""]), st.sampled_from([REFUSED, TIMEOUT, NOT_YOU])),
        max_size=20,
    ),
    st.floats(0, 200),
)
def test_a_source_that_never_failed_is_kept_only_by_a_host_silent_to_two_others(failures, later):
    hosts = HostSuspensions(BASE, MAX)
    for i, (source, reply) in enumerate(failures):
        hosts.failed("mx1", float(i), reply, source)
    silent_to = {source for source, reply in failures if reply.code == 0}
    if len(silent_to) < 2:
        assert not hosts.suspended("mx1", len(failures) + later, "192.0.2.99")


# -- properties -------------------------------------------------------------------------------

times = st.floats(0, 1e9, allow_nan=False)


@given(
    st.floats(0, 1e4),
    st.floats(0, 1e6),
    st.lists(st.floats(0, 1), min_size=1, max_size=40),
)
def test_suspensions_grow_and_are_capped(base, maximum, gaps):
    """Fail again some time after each release (within `maximum`): each suspension is
    base * 2**(n-1) capped at maximum, so they never shrink."""
    hosts = HostSuspensions(base, maximum)
    now, lengths = 0.0, []
    for n, gap in enumerate(gaps, 1):
        until = hosts.failed("mx", now)
        lengths.append(until - now)
        nominal = min(maximum, base * 2.0 ** (n - 1))
        assert until - now == pytest.approx(nominal, abs=1e-9 * max(1.0, now))
        now = until + gap * maximum * 0.999
    slack = 1e-9 * max(1.0, now)  # `until - now` rounds at the scale of `now`
    assert all(b >= a - slack for a, b in pairwise(lengths))
    assert all(length <= maximum + slack for length in lengths)


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), times), max_size=30), times)
def test_available_and_next_release_agree(failures, now):
    hosts = HostSuspensions(BASE, MAX)
    for host, at in sorted(failures, key=lambda f: f[1]):
        hosts.failed(host, at)
    names = ["a", "b", "c", "d", "e"][: 1 + len(failures) % 5]
    available = hosts.available(names, now)
    release = hosts.next_release(names, now)
    snapshot = hosts.snapshot(now)
    assert available == [h for h in names if h not in snapshot]
    if available or not names:
        assert release is None
    else:
        assert release == min(snapshot[h] for h in names)
        assert release > now
        assert hosts.available(names, release)  # at the release someone is back


class Suspensions(RuleBasedStateMachine):
    """Random failures, successes and the passing of time against a simple model of the
    documented rules."""

    HOSTS = ("mx1", "mx2", "mx3")

    def __init__(self) -> None:
        super().__init__()
        self.hosts = HostSuspensions(BASE, MAX)
        self.now = 0.0
        self.model: dict[str, tuple[int, float]] = {}  # host -> (streak, until)

    @rule(host=st.sampled_from(HOSTS))
    def fail(self, host):
        streak, until = self.model.get(host, (0, 0.0))
        if self.now >= until:
            streak = 1 if self.now >= until + MAX else streak + 1
            until = self.now + min(MAX, BASE * 2 ** (streak - 1))
        self.model[host] = (streak, until)
        assert self.hosts.failed(host, self.now) == until

    @rule(host=st.sampled_from(HOSTS))
    def succeed(self, host):
        self.model.pop(host, None)
        self.hosts.succeeded(host)

    @rule(seconds=st.sampled_from([1.0, 30.0, 59.0, 60.0, 61.0, 600.0, MAX, 2 * MAX]))
    def wait(self, seconds):
        self.now += seconds

    @precondition(lambda self: any(until > self.now for _, until in self.model.values()))
    @rule()
    def wait_for_the_next_release(self):
        self.now = self.hosts.next_release(
            [h for h, (_, until) in self.model.items() if until > self.now], self.now
        )

    @invariant()
    def agrees_with_the_model(self):
        expected = {h: until for h, (_, until) in self.model.items() if until > self.now}
        assert self.hosts.snapshot(self.now) == expected
        for host in self.HOSTS:
            assert self.hosts.suspended(host, self.now) == (host in expected)
        assert self.hosts.available(self.HOSTS, self.now) == [
            h for h in self.HOSTS if h not in expected
        ]
        release = self.hosts.next_release(self.HOSTS, self.now)
        if len(expected) == len(self.HOSTS):
            assert release == min(expected.values())
        else:
            assert release is None

    @invariant()
    def suspensions_are_bounded(self):
        for until in self.hosts.snapshot(self.now).values():
            assert self.now < until <= self.now + MAX


TestSuspensions = Suspensions.TestCase


def test_lift_releases_every_source_now_and_keeps_the_streak(hosts):
    down = Reply("banner", 421, "4.3.2", "Service not available")
    hosts.failed("mx.example.org", 0.0, down, "192.0.2.1")
    hosts.failed("mx.example.org", 0.0, down, "192.0.2.2")
    assert [s.source for s in hosts.suspensions(1.0)] == ["192.0.2.1", "192.0.2.2"]
    assert hosts.suspensions(1.0)[0].reason == down
    assert hosts.lift("mx.example.org", 1.0)
    assert not hosts.suspended("mx.example.org", 1.0, "192.0.2.1")
    assert hosts.suspensions(1.0) == []
    assert not hosts.lift("mx.example.org", 1.0)  # nothing left to lift
    assert not hosts.lift("other.example.org", 1.0)
    # Failing again at once: the streak goes on, the suspension doubles.
    assert hosts.failed("mx.example.org", 1.0, down, "192.0.2.1") == 1.0 + 2 * BASE
    [entry] = hosts.suspensions(2.0)
    assert entry.failures == 2 and entry.until == 1.0 + 2 * BASE


def test_suspensions_lists_those_in_force_latest_release_last(hosts):
    hosts.failed("b.example.org", 10.0)
    hosts.failed("a.example.org", 0.0)
    assert [s.host for s in hosts.suspensions(20.0)] == ["a.example.org", "b.example.org"]
    assert [s.host for s in hosts.suspensions(65.0)] == ["b.example.org"]
    assert hosts.suspensions(75.0) == []


def test_held_is_any_source_in_force(hosts):
    assert not hosts.held("mx.example.org", 0.0)
    hosts.failed("mx.example.org", 0.0, None, "192.0.2.7")
    assert hosts.held("mx.example.org", 1.0)  # for one source: held all the same
    assert not hosts.held("mx.example.org", BASE + 1.0)
