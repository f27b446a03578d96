"""Listener limits end to end: slow and many clients against the daemon, real sockets."""

from __future__ import annotations

import contextlib
import select
import socket
import time
from pathlib import Path

BODY = b"Subject: limits\r\n\r\nbody\r\n"


def connect(daemon, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(
        ("127.0.0.1", daemon.port), timeout=10, source_address=(source, 0)
    )


def reply(sock: socket.socket) -> bytes:
    """The next reply (all its lines), or what came before the daemon closed the connection."""
    data = b""
    while True:
        lines = data.split(b"\r\n")
        if len(lines) > 1 and lines[-2][3:4] != b"-":  # the last complete line is the final one
            return data
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk


def dribble_until_cut(socks: list[socket.socket], byte_chunk: bytes, start: float) -> dict:
    """Send `byte_chunk` to every socket each 0.25 s; return {index: (seconds since start,
    reply)} of the ones the daemon answered (and closed), until all were or 15 s passed."""
    cut: dict[int, tuple[float, bytes]] = {}
    while len(cut) < len(socks) and time.monotonic() - start < 15:
        for i, sock in enumerate(socks):
            if i not in cut:
                with contextlib.suppress(OSError):  # closed under us: its reply is read below
                    sock.sendall(byte_chunk)
        readable, _, _ = select.select(
            [s for i, s in enumerate(socks) if i not in cut], [], [], 0.25
        )
        for sock in readable:
            cut[socks.index(sock)] = (time.monotonic() - start, sock.recv(4096))
    return cut


def test_slow_command_lines_are_cut_at_their_deadline_and_free_the_slots(start_daemon):
    # Clients sending one byte now and then held their connections forever (each byte
    # restarted the timeout), filled max_connections, and everyone else got 421.
    daemon = start_daemon("listen.max_connections=5", "listen.command_timeout=2s")
    start = time.monotonic()  # before the daemon starts any of their deadlines
    slow = [connect(daemon) for _ in range(5)]
    assert all(reply(s).startswith(b"220 ") for s in slow)
    with connect(daemon) as extra:
        assert reply(extra).startswith(b"421 4.7.0")  # the total cap holds meanwhile
    cut = dribble_until_cut(slow, b"N", start)
    assert sorted(cut) == list(range(5)), cut
    for seconds, text in cut.values():
        assert text.startswith(b"421 4.4.2"), text
        assert 2 <= seconds < 8, seconds  # 2 s, plus the 1 s sweep, plus a loaded machine
    for sock in slow:
        sock.close()
    assert daemon.send("app@example.com", ["a@example.org"], BODY)


def test_data_below_the_minimum_rate_is_cut_and_a_fast_sender_is_not(start_daemon):
    # 40 bytes/s against min_data_rate 500: its deadline (3 s) is barely extended and
    # runs out; 4000 bytes/s earns more than it spends and may take longer than 3 s.
    daemon = start_daemon("listen.data_timeout=3s")  # min_data_rate: the default, 500
    socks = [connect(daemon), connect(daemon)]  # fast first: slow's deadline starts last
    for sock in socks:
        assert reply(sock).startswith(b"220 ")
        sock.sendall(b"EHLO c\r\n")
        assert reply(sock).startswith(b"250")
        for command in (b"MAIL FROM:<a@example.com>", b"RCPT TO:<b@example.org>", b"DATA"):
            sock.sendall(command + b"\r\n")
            assert reply(sock)[:1] in (b"2", b"3")
    fast, slow = socks
    start = time.monotonic()
    slow_cut = fast_reply = None
    while time.monotonic() - start < 8:  # the fast one sends for over twice data_timeout
        fast.sendall(b"x" * 998 + b"\r\n")
        if slow_cut is None:
            slow.sendall(b"0123456789")
            if select.select([slow], [], [], 0)[0]:
                slow_cut = (time.monotonic() - start, slow.recv(4096))
        time.sleep(0.25)
    fast.sendall(b".\r\n")
    fast_reply = reply(fast)
    assert fast_reply.startswith(b"250 2.0.0 Ok: queued as "), fast_reply
    assert slow_cut is not None
    seconds, text = slow_cut
    assert text.startswith(b"421 4.4.2"), text
    assert 2.5 < seconds < 7.5, seconds  # 3 / (1 - 40/500) s, the 1 s sweep, a loaded machine
    assert len(daemon.messages()) == 1


def test_per_client_cap_spares_mynetworks_and_the_total_cap_still_holds(start_daemon):
    # Every local app comes from 127.0.0.1: during a flood 9 of 10 of them got 421.
    daemon = start_daemon(
        "listen.max_connections=6",
        "listen.max_connections_per_client=2",
        'listen.mynetworks=["127.0.0.1/32"]',
    )
    outside = [connect(daemon, "127.0.0.2") for _ in range(3)]
    assert [reply(s)[:9] for s in outside] == [b"220 mx.te", b"220 mx.te", b"421 4.7.0"]
    local = [connect(daemon) for _ in range(4)]  # 2 + 4 = max_connections
    assert all(reply(s).startswith(b"220 ") for s in local)
    with connect(daemon) as one_more:
        assert reply(one_more).startswith(b"421 4.7.0")
    for sock in outside + local:
        sock.close()


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:", 1)[1].split()[0])


def test_client_that_reads_no_replies_cannot_grow_our_buffers_or_keep_its_slot(start_daemon):
    # Pipelined NOOPs from a client that never reads: each 6 bytes in made 15 bytes of
    # replies that waited in our write buffer, without bound; after the deadline the 421
    # waited there too, and the connection kept its slot for good.
    daemon = start_daemon("listen.max_connections=1", "listen.command_timeout=2s")
    before = rss_kib(daemon.proc.pid)
    sock = connect(daemon)
    sock.settimeout(0.5)
    chunk = b"NOOP\r\n" * 10_000
    sent = 0
    start = time.monotonic()
    cut = False
    while sent < 100_000_000 and time.monotonic() - start < 20:
        try:
            sent += sock.send(chunk)
        except TimeoutError:
            continue  # the daemon stopped reading: good, wait for it to give up on us
        except OSError:
            cut = True
            break
    grown = rss_kib(daemon.proc.pid) - before
    sock.close()
    assert cut, f"still connected after {sent} bytes"
    assert sent < 20_000_000, sent
    assert grown < 30_000, f"daemon RSS grew {grown} KiB"
    assert daemon.send("app@example.com", ["a@example.org"], BODY)  # the slot is free
