"""Source pools, end to end: the daemon as a subprocess binds its connections to the pool's
127.0.0.x sources, and the receiving peer (127.0.0.2, mx.example.org) sees which one.
"""

from __future__ import annotations

import json

import pytest
from e2e_helpers import BODY, FAST, MailNet, events, wait_for
from smtp_peer import Context

A, B = "127.0.0.11", "127.0.0.12"
POOL = (
    f'pools.bulk.sources=["{A}", {{address = "{B}", helo = "b.sender.test"}}]',
    "classes.p2.pool=bulk",
    "delivery.helo_name=default.sender.test",
)
P2 = b"X-Mtaqueue-Class: p2\r\n" + BODY
P0 = b"X-Mtaqueue-Class: p0\r\n" + BODY


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
