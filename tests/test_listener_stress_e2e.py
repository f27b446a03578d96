"""Under a flood, everyone else is still served: the listener's stress mode end to end
(the daemon, real sockets from several loopback addresses)."""

from __future__ import annotations

import contextlib
import time

from e2e_helpers import events, wait_for
from test_listener_limits_e2e import BODY, connect, reply
from test_metrics_e2e import scrape

SLOTS = 20


def transaction(sock) -> bytes:
    """One message on a greeted connection; the reply to the final dot."""
    for line in (b"EHLO client.test", b"MAIL FROM:<app@example.com>", b"RCPT TO:<a@example.org>"):
        sock.sendall(line + b"\r\n")
        reply(sock)
    sock.sendall(b"DATA\r\n")
    reply(sock)
    sock.sendall(BODY + b".\r\n")
    return reply(sock)


def test_a_flood_from_mynetworks_does_not_lock_out_other_clients(start_daemon):
    daemon = start_daemon(
        f"listen.max_connections={SLOTS}", "delivery.enabled=false", "metrics.address=127.0.0.1:0"
    )
    # A leaking connection pool on 127.0.0.1 (in mynetworks: no per-client cap) takes every
    # slot and says nothing; one of its sessions is in the middle of DATA meanwhile.
    flood = [connect(daemon) for _ in range(SLOTS - 1)]
    assert all(reply(s).startswith(b"220") for s in flood)
    busy = connect(daemon)
    assert reply(busy).startswith(b"220")
    for line in (b"EHLO pool.test", b"MAIL FROM:<app@example.com>", b"RCPT TO:<b@example.org>"):
        busy.sendall(line + b"\r\n")
        assert reply(busy)[:1] == b"2"
    busy.sendall(b"DATA\r\n")
    assert reply(busy).startswith(b"354")
    [stress] = wait_for(lambda: events(daemon, "listener_stress"), what="stress")
    assert stress["state"] == "entered" and stress["busiest"] == "127.0.0.1"
    time.sleep(1.2)  # the flood's sessions are quiet now
    try:
        # Another address, and the flooding address itself: each gets a slot at once, all
        # three together (the flood's quiet sessions give way), and is served.
        newcomers = []
        for source in ("127.0.0.2", "127.0.0.3", "127.0.0.1"):
            started = time.monotonic()
            sock = connect(daemon, source)
            newcomers.append(sock)
            assert reply(sock).startswith(b"220"), source
            assert time.monotonic() - started < 2
        for sock in newcomers:
            answer = transaction(sock)
            assert answer.startswith(b"250 2.0.0 Ok: queued as"), answer
        shed = events(daemon, "session_shed")
        assert len(shed) == 3 and {e["client"] for e in shed} == {"127.0.0.1"}
        # The session in the middle of DATA was not one that gave way.
        busy.sendall(BODY + b".\r\n")
        assert reply(busy).startswith(b"250 2.0.0 Ok: queued as")
        # The sessions that gave way were told why.
        told = []
        for sock in flood:
            sock.settimeout(0.2)
            with contextlib.suppress(OSError):
                told.append(sock.recv(4096))
        assert sum(t.startswith(b"421 4.3.2") for t in told) == 3
        metrics = scrape(daemon)
        assert metrics[("mtaqueue_listener_stress", ())] == 1
        assert metrics[("mtaqueue_listener_shed_total", ())] == 3
        for sock in newcomers:
            sock.close()
    finally:
        for sock in [*flood, busy]:
            sock.close()
    wait_for(
        lambda: [e for e in events(daemon, "listener_stress") if e["state"] == "left"],
        what="stress over",
    )
    assert scrape(daemon)[("mtaqueue_listener_stress", ())] == 0


def test_slowloris_sessions_give_way_and_their_deadline_shrinks(start_daemon):
    daemon = start_daemon(
        "listen.max_connections=10", "listen.stress_command_timeout=3s", "delivery.enabled=false"
    )
    slow = [connect(daemon, "127.0.0.4") for _ in range(10)]
    assert all(reply(s).startswith(b"220") for s in slow)
    started = time.monotonic()
    while time.monotonic() - started < 1.5:  # a byte at a time, never a whole line
        for sock in slow:
            sock.sendall(b"E")
        time.sleep(0.3)
    with connect(daemon, "127.0.0.2") as sock:
        assert reply(sock).startswith(b"220")  # one of them gave way
        assert transaction(sock).startswith(b"250 2.0.0 Ok: queued as")
    # Under stress a command line gets 3 s, not 5 minutes: the rest are cut by then.
    cut = 0
    for sock in slow:
        sock.settimeout(5)
        with contextlib.suppress(OSError):
            data = sock.recv(4096)
            cut += data.startswith((b"421 4.4.2", b"421 4.3.2"))
    assert cut == 10 and time.monotonic() - started < 8
    for sock in slow:
        sock.close()


def test_under_stress_a_message_that_stalls_is_cut_sooner(start_daemon):
    daemon = start_daemon(
        "listen.max_connections=5", "listen.stress_data_timeout=2s", "delivery.enabled=false"
    )
    idle = [connect(daemon) for _ in range(4)]  # 4 of 5: stress
    assert all(reply(s).startswith(b"220") for s in idle)
    with connect(daemon, "127.0.0.2") as sock:
        assert reply(sock).startswith(b"220")
        for line in (b"EHLO c.test", b"MAIL FROM:<a@example.com>", b"RCPT TO:<b@example.org>"):
            sock.sendall(line + b"\r\n")
            reply(sock)
        sock.sendall(b"DATA\r\n")
        assert reply(sock).startswith(b"354")
        sock.sendall(b"Subject: half a message\r\n")  # then nothing: 10 minutes normally
        started = time.monotonic()
        sock.settimeout(10)
        assert reply(sock).startswith(b"421 4.4.2")
        assert time.monotonic() - started < 4
    for sock in idle:
        sock.close()
