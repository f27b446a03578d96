"""The daemon's delivery pipelines (issue 30): against a server that answers only where RFC
2920 lets a client wait (tests/group_peer.py, here in a thread of its own), a backlog goes
over one connection at one round trip a message, each message's commands written behind
the final dot of the one before, where a round trip costs something (a delay at the
peer; on loopback the daemon does not write ahead: nothing to save). A server that drops
what was written ahead is learned: its mail goes in lock-step, and the lesson outlives a
restart (learned.json)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
from e2e_helpers import FAST, events, wait_for
from group_peer import GroupPeer

MESSAGES = 30


class PeerThread:
    """A GroupPeer served by an event loop in a thread of its own."""

    def __init__(self, peer: GroupPeer) -> None:
        self.peer = peer
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> PeerThread:
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.peer.start(), self.loop).result(10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self.peer.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def relay_to():
    """Factory: relay_to(peer) -> the daemon's overrides for a relayhost on that peer."""
    running: list[PeerThread] = []

    def start(peer: GroupPeer) -> tuple[str, ...]:
        served = PeerThread(peer).__enter__()
        running.append(served)
        return (
            *FAST,
            f"delivery.relayhost=[127.0.0.2]:{served.port}",
            "delivery.tls=off",
            "shaping.default.max_connections=1",
            "shaping.default.initial_connections=1",
            "shaping.default.reserved_p0=0",
        )

    yield start
    for served in running:
        served.__exit__()


def backlog(start_daemon, overrides: tuple[str, ...], count: int) -> Iterator:
    """A daemon with `count` messages (3 recipients each) queued while delivery was off,
    started again with delivery on, the whole backlog due at once (no restart spread)."""
    daemon = start_daemon(*overrides, "retry.restart_spread=0s", "delivery.enabled=false")
    for i in range(count):
        rcpts = [f"r{j}@example.org" for j in range(3)]
        daemon.send("app@sender.test", rcpts, f"Subject: m{i}\r\n\r\nbody {i}\r\n".encode())
    assert daemon.stop() == 0
    daemon.overrides.append("delivery.enabled=true")
    return daemon.start()


def test_a_backlog_goes_at_one_round_trip_a_message(start_daemon, relay_to):
    peer = GroupPeer(delay=0.02)  # a round trip worth saving (shaper.FOLLOW_LATENCY)
    daemon = backlog(start_daemon, relay_to(peer), MESSAGES)
    wait_for(lambda: not daemon.messages(), timeout=60, what="the backlog delivered")
    assert sorted(peer.messages) == sorted(f"m{i}" for i in range(MESSAGES))
    # Banner, EHLO, the first group, then one flush a message (its dot and the next group),
    # on each connection that carried mail (not a stray one's).
    carried = [x for x in peer.sessions if x.delivered]
    assert sum(x.flushes for x in carried) <= 3 * len(carried) + MESSAGES, peer.flushes
    assert not any(c.startswith("RSET") for c in peer.commands)
    delivered = [e for e in events(daemon, "delivery") if e["outcome"] == "delivered"]
    assert len(delivered) == 3 * MESSAGES


def test_where_a_round_trip_costs_nothing_nothing_is_written_ahead(start_daemon, relay_to):
    peer = GroupPeer()  # loopback: a round trip is microseconds
    daemon = backlog(start_daemon, relay_to(peer), 10)
    wait_for(lambda: not daemon.messages(), timeout=60, what="the backlog delivered")
    assert len(peer.messages) == 10
    carried = [s for s in peer.sessions if s.delivered]  # (not a stray connection's)
    # Banner and EHLO per connection; each message's group, then its content.
    assert sum(s.flushes for s in carried) == 2 * len(carried) + 2 * 10


def test_a_server_that_drops_commands_written_ahead_gets_them_one_at_a_time(start_daemon, relay_to):
    peer = GroupPeer(drop_ahead=True)
    overrides = (*relay_to(peer), "delivery.timeouts.rcpt=1s")
    daemon = backlog(start_daemon, overrides, 2)
    learned = daemon.wait_event("pipelining_out_of_step", timeout=20)
    assert learned["ip"] == "127.0.0.2"
    wait_for(lambda: not daemon.messages(), timeout=60, what="the retry, in lock-step")
    assert sorted(peer.messages) == ["m0", "m1"]
    first = [e for e in events(daemon, "delivery") if e["outcome"] != "delivered"]
    assert first and all(e["phase"] == "rcpt" and e["network"] == "timeout" for e in first)
    assert daemon.stop() == 0  # the lesson is saved with the learned limits
    saved = json.loads((daemon.spool / "learned.json").read_bytes())
    assert "127.0.0.2" in saved["lockstep"]
