"""After an outage: `flush` and `unsuspend` lift host suspensions and an open breaker,
behind one probe connection (daemon, test DNS, a scriptable peer)."""

from __future__ import annotations

import time

import pytest
from e2e_helpers import BODY, FAST, MailNet, ctl_json, events, wait_for

DOWN = "421 4.3.2 Service not available, closing transmission channel"
# Long enough that only a lift (not the suspension's end) can explain a delivery.
SLOW = ("delivery.host_suspend=120s", "delivery.host_suspend_max=240s", 'retry.schedule=["120s"]')


@pytest.fixture
def net():
    with MailNet(["127.0.0.2"]) as mail:
        mail.add_domain("example.org", "127.0.0.2", host="mx.provider.test")
        yield mail


def banners(peer) -> int:
    return sum(1 for entry in peer.log if entry.phase == "banner")


def suspended_by_outage(net, start_daemon):
    """A daemon whose one message met the provider down: its MX host suspended."""
    mx = net.peers[0]
    mx.on("banner", DOWN)
    daemon = start_daemon(*net.daemon_overrides(), *FAST, *SLOW)
    queue_id = daemon.send("app@sender.test", ["a@example.org"], BODY)
    hosts = wait_for(lambda: ctl_json(daemon, "hosts"), what="the host suspended")
    return daemon, queue_id, hosts


def test_hosts_shows_the_suspension_and_flush_lifts_it(net, start_daemon):
    daemon, queue_id, hosts = suspended_by_outage(net, start_daemon)
    [entry] = hosts
    assert entry["host"] == "mx.provider.test:" + str(net.peers[0].port)
    assert entry["reply"].startswith("421 4.3.2 Service not available")
    assert entry["until"] > time.time() + 60
    assert entry["failures"] == 1
    assert entry["destinations"]  # the provider's destination uses it
    text = daemon.ctl("hosts").stdout
    assert "mx.provider.test" in text and "421 4.3.2" in text

    net.peers[0].on("banner", None)  # the provider is back
    flushed = time.time()
    assert ctl_json(daemon, "flush", "--all") == [{"flushed": 1}]
    wait_for(lambda: queue_id not in daemon.messages(), timeout=10, what="delivery")
    assert time.time() - flushed < 5  # not after the 120 s suspension
    assert ctl_json(daemon, "hosts") == []
    assert [m.rcpt_tos for m in net.peers[0].messages] == [["a@example.org"]]


def test_flush_while_still_down_costs_one_connection(net, start_daemon):
    daemon, _, _ = suspended_by_outage(net, start_daemon)
    # More mail meets the suspension: it waits, no connection is made for it.
    for i in range(5):
        daemon.send("app@sender.test", [f"b{i}@example.org"], BODY)
    time.sleep(1)
    before = banners(net.peers[0])
    assert ctl_json(daemon, "flush", "--all") == [{"flushed": 6}]
    time.sleep(3)
    assert banners(net.peers[0]) == before + 1  # the probe, not a storm
    [entry] = ctl_json(daemon, "hosts")
    assert entry["failures"] == 2  # suspended again, for longer
    assert entry["until"] > time.time() + 200
    assert len(daemon.messages()) == 6  # nothing lost, nothing bounced


def test_unsuspend_by_host_and_by_domain(net, start_daemon):
    daemon, charged, [entry] = suspended_by_outage(net, start_daemon)
    assert daemon.ctl("unsuspend").returncode != 0  # neither a host nor a domain
    assert ctl_json(daemon, "unsuspend", "no-such-host.test") == [{"hosts": [], "destinations": []}]
    # Mail sent meanwhile waits on the suspension (not an attempt); the first message's
    # failed attempt keeps its retry time: unsuspend lifts, flush makes mail due.
    waiting = daemon.send("app@sender.test", ["b@example.org"], BODY)
    time.sleep(1)
    before = banners(net.peers[0])
    # Still down: the probe that follows the lift fails and suspends the host again.
    [lifted] = ctl_json(daemon, "unsuspend", "mx.provider.test")
    assert lifted["hosts"] == [entry["host"]] and lifted["destinations"]
    wait_for(lambda: banners(net.peers[0]) == before + 1, what="the probe")
    wait_for(lambda: ctl_json(daemon, "hosts"), what="suspended again")
    time.sleep(1)
    assert banners(net.peers[0]) == before + 1

    # The probe carried the waiting message: that was an attempt, charged like the first.
    net.peers[0].on("banner", None)
    third = daemon.send("app@sender.test", ["c@example.org"], BODY)
    time.sleep(1)
    lifted_at = time.time()
    [lifted] = ctl_json(daemon, "unsuspend", "--domain", "example.org")
    assert lifted["hosts"] == [entry["host"]]
    wait_for(lambda: third not in daemon.messages(), timeout=10, what="delivery")
    assert time.time() - lifted_at < 5
    assert ctl_json(daemon, "hosts") == []
    queue = daemon.messages()
    for queue_id in (charged, waiting):
        [rcpt] = queue[queue_id]["recipients"]
        assert rcpt["state"] == "deferred" and rcpt["next_attempt"] > time.time() + 60


def test_a_flush_of_many_chunks_still_costs_one_connection(net, start_daemon):
    """A flush walks the queue a chunk at a time (2,000 messages): the destination is
    lifted once for the command, not once a chunk (a dead host would see a probe each)."""
    daemon, _, _ = suspended_by_outage(net, start_daemon)
    with daemon.smtp() as client:
        for i in range(4500):
            assert client.sendmail("app@sender.test", [f"b{i}@example.org"], BODY) == {}
    time.sleep(1)
    before = banners(net.peers[0])
    assert ctl_json(daemon, "flush", "--all") == [{"flushed": 4501}]
    time.sleep(3)
    assert banners(net.peers[0]) == before + 1  # one probe for the whole command
    [entry] = ctl_json(daemon, "hosts")
    assert entry["failures"] == 2
    lifted = [e for e in events(daemon, "destination_lifted") if e.get("by") == "flush"]
    assert len(lifted) == 1
    assert len(daemon.messages()) == 4501
