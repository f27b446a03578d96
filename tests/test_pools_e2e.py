"""Source pools, end to end: the daemon as a subprocess binds its connections to the pool's
127.0.0.x sources, and the receiving peer (127.0.0.2, mx.example.org) sees which one.
"""

from __future__ import annotations

import importlib.util
import json
import time
from datetime import datetime
from pathlib import Path

import pytest
from e2e_helpers import BODY, FAST, MailNet, events, wait_for
from smtp_peer import Context, Late

from mtaqueue.policy.warmup import DAY, day_of

A, B = "127.0.0.11", "127.0.0.12"
POOL = (
    f'pools.bulk.sources=["{A}", {{address = "{B}", helo = "b.sender.test"}}]',
    "classes.p2.pool=bulk",
    "delivery.helo_name=default.sender.test",
)
P2 = b"X-Mtaqueue-Class: p2\r\n" + BODY
P0 = b"X-Mtaqueue-Class: p0\r\n" + BODY
P1 = b"X-Mtaqueue-Class: p1\r\n" + BODY


@pytest.fixture
def net():
    with MailNet(["127.0.0.2"]) as n:
        n.add_domain("example.org", "127.0.0.2")
        yield n


def destinations(daemon) -> dict[str, dict]:
    result = daemon.ctl("domains", "--json")
    assert result.returncode == 0, result.stderr
    return {d["destination"]: d for d in map(json.loads, result.stdout.splitlines())}


def test_a_class_with_a_pool_uses_every_source_each_with_its_helo(net, start_daemon):
    (peer,) = net.peers
    daemon = start_daemon(*net.daemon_overrides(), *FAST, *POOL)
    for i in range(12):
        daemon.send("app@sender.test", [f"bulk{i}@example.org"], P2)
    daemon.send("app@sender.test", ["reset@example.org"], P0)
    received = peer.wait_messages(13)
    by_rcpt = {m.rcpt_tos[0]: m for m in received}
    bulk = [m for r, m in by_rcpt.items() if r.startswith("bulk")]
    assert {m.client_ip for m in bulk} == {A, B}
    assert min(sum(m.client_ip == ip for m in bulk) for ip in (A, B)) >= 3  # spread
    assert {m.helo for m in bulk if m.client_ip == A} == {"default.sender.test"}
    assert {m.helo for m in bulk if m.client_ip == B} == {"b.sender.test"}
    # p0 has no pool: the default source (the system's choice of address).
    assert by_rcpt["reset@example.org"].client_ip not in (A, B)
    # Each (source, destination) is a destination of its own: its pacing, its state.
    mx = f"mx.example.org:{peer.port}"
    wait_for(lambda: len(events(daemon, "delivery")) == 13)
    names = {e["destination"] for e in events(daemon, "delivery")}
    assert names == {mx, f"{mx}@{A}", f"{mx}@{B}"}
    shown = destinations(daemon)
    assert shown[f"{mx}@{B}"]["source"] == B and shown[mx]["source"] is None


def test_a_blocklisted_source_leaves_that_destination_while_the_other_delivers(net, start_daemon):
    (peer,) = net.peers

    def listed(ctx: Context) -> str | None:
        if ctx.client_ip == A:
            return (
                f"554 5.7.1 Service unavailable; Client host [{A}] blocked using zen.spamhaus.org"
            )
        return None

    peer.on("rcpt", listed)
    daemon = start_daemon(*net.daemon_overrides(), *FAST, *POOL)
    for i in range(10):
        daemon.send("app@sender.test", [f"bulk{i}@example.org"], P2)
    received = peer.wait_messages(10)
    assert {m.client_ip for m in received} == {B}
    (blocked,) = wait_for(lambda: events(daemon, "source_blocklisted"))
    mx = f"mx.example.org:{peer.port}"
    assert blocked["source"] == A and blocked["destination"] == mx
    # Nothing bounced or waited for a retry: the refused went to the other source at once.
    wait_for(
        lambda: len([e for e in events(daemon, "delivery") if e["outcome"] == "delivered"]) == 10
    )
    assert not [e for e in events(daemon, "delivery") if e["outcome"] != "delivered"]
    assert not daemon.messages()
    shown = destinations(daemon)
    assert shown[f"{mx}@{A}"]["source_excluded_until"] > blocked["until"] - 1

    # The hold survives a restart: A is not tried again for that destination.
    def refused() -> int:
        return sum(e.client_ip == A and e.reply.startswith("554") for e in peer.log)

    before = refused()
    assert before >= 1
    daemon.restart()
    for i in range(4):
        daemon.send("app@sender.test", [f"after{i}@example.org"], P2)
    late = peer.wait_messages(14)[10:]
    assert {m.client_ip for m in late} == {B}
    assert refused() == before


# -- host suspensions per (source, host) (policy/hosts.py) ----------------------------------


REFUSAL = f"554 5.7.1 {A}: no SMTP service for your address"


def refused_at_a(net, start_daemon, refusal):
    """Ten messages through the pool, the peer refusing source A at its greeting; the
    suspension lasts 1 h, so that mail waiting for it would fail: all must leave via B."""
    (peer,) = net.peers
    peer.on("banner", lambda ctx: refusal if ctx.client_ip == A else None)
    daemon = start_daemon(*net.daemon_overrides(), *FAST, *POOL, "delivery.host_suspend=1h")
    for i in range(10):
        daemon.send("app@sender.test", [f"bulk{i}@example.org"], P2)
    received = peer.wait_messages(10, timeout=20)
    assert {m.client_ip for m in received} == {B}
    wait_for(lambda: not daemon.messages(), what="the queue empty")
    return daemon, peer


def test_a_host_that_refuses_one_source_is_still_tried_from_the_other(net, start_daemon):
    daemon, peer = refused_at_a(net, start_daemon, REFUSAL)
    (suspended,) = events(daemon, "host_suspended")
    assert suspended["source"] == A and suspended["every_source"] is False
    assert suspended["host"] == "mx.example.org"
    # The mail A failed with went to B at its retry.
    assert sum(e.phase == "banner" and e.client_ip == A for e in peer.log) == 1
    mx = f"mx.example.org:{peer.port}"
    shown = destinations(daemon)
    assert list(shown[f"{mx}@{A}"]["suspended_hosts"]) == [mx]
    assert shown[f"{mx}@{B}"]["suspended_hosts"] == {}


def test_mail_queued_behind_a_refused_source_moves_to_the_other_at_once(net, start_daemon):
    """A slow refusal (1 s) lets mail queue at A's destination before A is suspended
    there: it goes to B, not into a wait for A's suspension."""
    refused_at_a(net, start_daemon, Late(1.0, REFUSAL))


def test_a_host_down_for_both_sources_is_down_for_every_source(net, start_daemon):
    (peer,) = net.peers
    peer.refuse_connections()
    daemon = start_daemon(*net.daemon_overrides(), *FAST, *POOL)
    for i in range(4):
        daemon.send("app@sender.test", [f"bulk{i}@example.org"], P2)
    daemon.send("app@sender.test", ["reset@example.org"], P0)  # the default source
    down = wait_for(lambda: [e for e in events(daemon, "host_suspended") if e["every_source"]])
    assert {e["source"] for e in events(daemon, "host_suspended")} >= {A, B} - {down[0]["source"]}
    peer.resume()  # back up: everything goes once the suspension ends (3 s)
    received = peer.wait_messages(5, timeout=30)
    assert {m.client_ip for m in received} >= {A, B}


# -- IPv6 and IPv4 (the test DNS publishes both for mx.example.org: ::1 and 127.0.0.2) ----

GMAIL_IPV6 = (
    "550-5.7.1 [::1] Our system has detected that this message does\n"
    "550-5.7.1 not meet IPv6 sending guidelines regarding PTR records and\n"
    "550 5.7.1 authentication. https://support.google.com/mail/?p=IPv6AuthError"
)


def dual_stack(addresses: list[str]) -> MailNet:
    net = MailNet(addresses)
    net.dns.add("example.org", "MX", "10 mx.example.org")
    net.dns.add("mx.example.org", "A", "127.0.0.2")
    net.dns.add("mx.example.org", "AAAA", "::1")
    return net


def test_ipv6_first_falls_back_to_ipv4_in_the_same_attempt(start_daemon):
    with dual_stack(["127.0.0.2"]) as net:  # nothing listens on ::1: refused at once
        (peer,) = net.peers
        daemon = start_daemon(*net.daemon_overrides(), *FAST, "delivery.address_order=ipv6-first")
        daemon.send("app@sender.test", ["a@example.org"], BODY)
        peer.wait_messages(1)
        (delivery,) = wait_for(lambda: events(daemon, "delivery"))
        assert delivery["outcome"] == "delivered" and delivery["attempt"] == 1
        assert delivery["ip"] == "127.0.0.2"


def test_a_site_that_refuses_our_ipv6_gets_ipv4_at_once_and_from_then_on(start_daemon):
    with dual_stack(["::1", "127.0.0.2"]) as net:
        six, four = net.peers
        six.on("rcpt", GMAIL_IPV6)
        daemon = start_daemon(*net.daemon_overrides(), *FAST, "delivery.address_order=ipv6-first")
        daemon.send("app@sender.test", ["a@example.org"], BODY)
        (first,) = four.wait_messages(1)
        assert first.rcpt_tos == ["a@example.org"]
        refused = wait_for(lambda: events(daemon, "ipv6_refused"))
        assert refused[0]["destination"] == f"mx.example.org:{four.port}"
        (delivery,) = wait_for(lambda: events(daemon, "delivery"))
        assert delivery["outcome"] == "delivered" and delivery["attempt"] == 1  # not bounced
        connections = len({e.connection for e in six.log})
        daemon.restart()  # remembered (egress.json): IPv4 straight away
        daemon.send("app@sender.test", ["b@example.org"], BODY)
        four.wait_messages(2)
        assert len({e.connection for e in six.log}) == connections
        shown = destinations(daemon)[f"mx.example.org:{four.port}"]
        assert shown["ipv4_only"] is True


def test_a_dual_stack_pool_binds_each_family_to_its_own_source(start_daemon):
    with dual_stack(["::1", "127.0.0.2"]) as net:
        six, four = net.peers
        daemon = start_daemon(
            *net.daemon_overrides(),
            *FAST,
            'pools.bulk.sources=["127.0.0.11", "::1"]',
            "classes.p2.pool=bulk",
        )
        for i in range(6):
            daemon.send("app@sender.test", [f"bulk{i}@example.org"], P2)
        wait_for(lambda: len(six.messages) + len(four.messages) == 6)
        assert six.messages and four.messages
        assert {m.client_ip for m in six.messages} == {"::1"}
        assert {m.client_ip for m in four.messages} == {"127.0.0.11"}


# -- warm-up (policy/warmup.py) --------------------------------------------------------------


def warming(schedule: str, *others: str) -> tuple[str, ...]:
    sources = ", ".join((f'{{address = "{A}", warmup = {schedule}}}', *others))
    return (f"pools.bulk.sources=[{sources}]", "classes.p2.pool=bulk")


def test_a_warming_source_carries_its_allowance_and_a_warm_one_the_rest(net, start_daemon):
    (peer,) = net.peers
    daemon = start_daemon(*net.daemon_overrides(), *FAST, *warming("[3, 30]", f'"{B}"'))
    for i in range(10):
        daemon.send("app@sender.test", [f"bulk{i}@example.org"], P2)
    received = peer.wait_messages(10)
    by_source = [m.client_ip for m in received]
    assert 1 <= by_source.count(A) <= 3 and by_source.count(B) == 10 - by_source.count(A)
    warm = destinations(daemon)[f"mx.example.org:{peer.port}@{A}"]["warmup"]
    assert warm["step"] == 1 and warm["allowance"] == 3
    assert warm["sent_today"] == by_source.count(A) and not warm["held"]


def test_over_the_allowance_mail_waits_uncharged_and_a_restart_keeps_the_count(net, start_daemon):
    (peer,) = net.peers
    daemon = start_daemon(*net.daemon_overrides(), *FAST, *warming("[2]"))
    for i in range(5):
        daemon.send("app@sender.test", [f"bulk{i}@example.org"], P2)
    assert {m.client_ip for m in peer.wait_messages(2)} == {A}
    waits = wait_for(lambda: (w := events(daemon, "warmup_wait")) and len(w) == 3 and w)
    today = day_of(time.time())
    assert all(day_of(w["until"]) == today + 1 for w in waits)  # early the next UTC day

    def waiting() -> list[dict]:
        return [r for m in daemon.messages().values() for r in m["recipients"]]  # delivered: gone

    assert len(waiting()) == 3 and {r["attempts"] for r in waiting()} == {0}
    # ctl list says why mail that looks ready waits (its record has no next attempt).
    held = [m["waiting"] for m in daemon.messages().values()]
    assert [w["reason"] for w in held] == ["warmup"] * 3
    assert {w["until"] for w in held} == {w["until"] for w in waits}
    assert daemon.ctl("list").stdout.count("waiting for the warm-up allowance at") == 3
    key = f"mx.example.org:{peer.port}@{A}"
    assert destinations(daemon)[key]["warmup"]["sent_today"] == 2
    daemon.restart()
    daemon.send("app@sender.test", ["late@example.org"], P2)
    wait_for(lambda: len(waiting()) == 4)
    time.sleep(1.0)  # let it be placed: it waits too
    assert len(peer.messages) == 2 and {r["attempts"] for r in waiting()} == {0}
    shown = daemon.ctl("domains")
    assert "step 1/1: sent today 2 of 2" in shown.stdout


def test_with_a_spread_of_0s_waiting_mail_is_due_at_the_next_utc_midnight(net, start_daemon):
    (peer,) = net.peers
    spread = 'pools.bulk.warmup_spread="0s"'
    daemon = start_daemon(*net.daemon_overrides(), *FAST, *warming("[1]"), spread)
    for i in range(3):
        daemon.send("app@sender.test", [f"bulk{i}@example.org"], P2)
    peer.wait_messages(1)
    waits = wait_for(lambda: (w := events(daemon, "warmup_wait")) and len(w) == 2 and w)
    assert {w["until"] for w in waits} == {(day_of(time.time()) + 1) * DAY}


def libfaketime() -> Path:
    """The libfaketime that the `libfaketime` test dependency's wheel carries (found, not
    imported: importing it would set up its own clock patching)."""
    spec = importlib.util.find_spec("libfaketime")
    assert spec is not None and spec.origin, "pip install -e '.[test]' installs libfaketime"
    path = Path(spec.origin).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    assert path.is_file(), f"the libfaketime package has no {path.name}: {path}"
    return path


def test_at_the_utc_midnight_waiting_mail_goes_with_the_next_steps_allowance(net, start_daemon):
    """The daemon's wall clock (libfaketime) starts seconds before a UTC midnight; its
    timers (the monotonic clock) run as ever. The next day's allowance goes to the mail
    of the first class waiting, then to the mail that has waited longest."""
    (peer,) = net.peers
    lead = 8.0
    midnight = (day_of(time.time()) + 1) * DAY
    offset = midnight - lead - time.time()
    clock = {
        "LD_PRELOAD": str(libfaketime()),
        "FAKETIME": f"{offset:+.6f}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    spread = 'pools.bulk.warmup_spread="1s"'
    daemon = start_daemon(
        *net.daemon_overrides(),
        *FAST,
        *warming("[2, 3]"),
        "classes.p1.pool=bulk",
        spread,
        env=clock,
    )
    for i in range(5):
        daemon.send("app@sender.test", [f"bulk{i}@example.org"], P2)
    daemon.send("app@sender.test", ["alert@example.org"], P1)  # the youngest, of p1
    assert {m.client_ip for m in peer.wait_messages(2)} == {A}
    waits = wait_for(lambda: (w := events(daemon, "warmup_wait")) and len(w) == 4 and w)
    key = f"mx.example.org:{peer.port}@{A}"
    day1 = destinations(daemon)[key]["warmup"]
    assert time.time() + offset < midnight, "the daemon took too long to start"
    assert (day1["step"], day1["allowance"], day1["sent_today"]) == (1, 2, 2)
    assert all(midnight <= w["until"] <= midnight + 1 for w in waits)
    # Past the daemon's midnight, 3 of the 4 waiting go (day 2: step 2), none charged:
    # the p1 message, then the 2 oldest p2 that waited; the youngest waits for day 3.
    # (Day 1's two went to the first two placed: messages accepted a few ms apart are
    # routed concurrently, so on a loaded machine those need not be bulk0 and bulk1.)
    day1_rcpts = [r for m in peer.messages[:2] for r in m.rcpt_tos]
    waited = [f"bulk{i}@example.org" for i in range(5) if f"bulk{i}@example.org" not in day1_rcpts]
    received = peer.wait_messages(5, timeout=lead + 15)
    delivered = wait_for(lambda: (d := events(daemon, "delivery")) and len(d) == 5 and d)
    assert len(waited) == 3
    day2_rcpts = [r for m in received[2:] for r in m.rcpt_tos]
    order = [(m.rcpt_tos, round(m.time + offset - midnight, 3)) for m in received]
    assert sorted(day2_rcpts) == sorted(["alert@example.org", *waited[:2]]), order

    def at(event: dict) -> float:
        return datetime.fromisoformat(event["timestamp"]).timestamp()

    assert sorted(at(e) >= midnight for e in delivered) == [False] * 2 + [True] * 3
    assert max(at(e) for e in delivered) < midnight + 10  # at midnight, not later
    assert {(e["outcome"], e["attempt"]) for e in delivered} == {("delivered", 1)}
    (advanced,) = events(daemon, "warmup_advanced")
    assert (advanced["step"], advanced["allowance"], advanced["sent"]) == (2, 3, 2)
    assert advanced["deferred"] == 0 and not events(daemon, "warmup_held")
    day2 = destinations(daemon)[key]["warmup"]
    assert (day2["step"], day2["allowance"], day2["sent_today"]) == (2, 3, 3)
    (left,) = daemon.messages().values()
    assert [r["address"] for r in left["recipients"]] == [waited[2]], (left, order)


def ramps(daemon, *args: str) -> list[dict]:
    result = daemon.ctl("warmup", *args, "--json")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_an_operator_finishes_a_ramp_and_restarts_it(net, start_daemon):
    (peer,) = net.peers
    daemon = start_daemon(*net.daemon_overrides(), *FAST, *warming("[2, 100]"))
    for i in range(4):
        daemon.send("app@sender.test", [f"bulk{i}@example.org"], P2)
    assert {m.client_ip for m in peer.wait_messages(2)} == {A}
    wait_for(lambda: len(events(daemon, "warmup_wait")) == 2, what="the surplus waiting")
    base = f"mx.example.org:{peer.port}"
    (ramp,) = ramps(daemon, "show")
    assert ramp == {
        "source": A,
        "destination": base,
        "step": 1,
        "steps": 2,
        "allowance": 2,
        "sent_today": 2,
        "deferred_today": 0,
        "held": False,
        "last_rate": 0.0,
    }

    # Finished (named by a domain it serves): no limit, and the mail that waited for the
    # next day goes now, with more after it.
    (done,) = ramps(daemon, "finish", A, "--destination", "example.org")
    assert done["destination"] == base and done["step"] == 3 and done["allowance"] is None
    (logged,) = wait_for(lambda: events(daemon, "warmup_finished"))
    assert logged["source"] == A and logged["base"] == base and logged["allowance"] is None
    peer.wait_messages(4)
    for i in range(3):
        daemon.send("app@sender.test", [f"more{i}@example.org"], P2)
    peer.wait_messages(7)
    assert len(events(daemon, "warmup_wait")) == 2

    # Restarted (every destination of the source): the first step's allowance again, and
    # today's 7 count against it, so new mail waits for the next day.
    (again,) = ramps(daemon, "restart", A)
    assert again["step"] == 1 and again["allowance"] == 2
    wait_for(lambda: ramps(daemon, "show", A)[0]["sent_today"] == 7)
    (restarted,) = wait_for(lambda: events(daemon, "warmup_restarted"))
    assert restarted["step"] == 1 and restarted["allowance"] == 2
    daemon.send("app@sender.test", ["late@example.org"], P2)
    wait_for(lambda: len(events(daemon, "warmup_wait")) == 3, what="new mail waiting")
    assert len(peer.messages) == 7

    # Kept in egress.json: a restart of the daemon keeps the first step.
    daemon.restart()
    (kept,) = ramps(daemon, "show")
    assert kept["step"] == 1 and kept["allowance"] == 2 and kept["sent_today"] == 7
    assert "step 1/2: sent today 7 of 2" in daemon.ctl("warmup", "show").stdout
    time.sleep(1.0)  # the waiting message is placed again: it still waits
    assert len(peer.messages) == 7

    # What names no ramp is refused in one line.
    for args in (("finish", "127.0.0.99"), ("restart", A, "--destination", "nowhere.test")):
        result = daemon.ctl("warmup", *args)
        assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
