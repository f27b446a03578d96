"""Messages too large to hold, end to end: written to the spool as they arrive, stored as
a message held whole would be, delivered; nothing left of one refused or cut off."""

from __future__ import annotations

import random
import re
import threading
import time
from pathlib import Path

from e2e_helpers import FAST, MailNet, queue_id, wait_for

from mtaqueue.spool.layout import SpoolLayout

ENVELOPE = b"MAIL FROM:<app@sender.test>\r\nRCPT TO:<bob@example.org>\r\nDATA\r\n"
STREAMED = "spool.stream_threshold=64KiB"
MiB = 1 << 20


def awkward_content(size: int) -> bytes:
    """What a client may send, dot-stuffed already: bare LFs and CRs, lines to unstuff,
    8-bit text, long lines; about `size` octets."""
    header = (
        b"Subject: big\r\nFrom: app@sender.test\r\nX-Mtaqueue-Class: p0\r\n"
        b"Message-ID: <big@sender.test>\r\nDate: Mon, 30 Nov 2026 10:00:00 +0000\r\n\r\n"
    )
    rng = random.Random(7)
    lines = [
        b"..a line that started with a dot\r\n",
        b"plain text, na\xc3\xafve \xe2\x82\xac\r\n",
        b"bare LF\n",
        b"bare CR\r",
        b"\n..after a bare LF\r\n",
        b"<p>" + b"minified " * 100 + b"</p>\r\n",
    ]
    body = bytearray()
    while len(body) < size:
        body += rng.choice(lines)
    return header + bytes(body) + b"\r\n"


def send_raw(daemon, data: bytes, seed: int = 1) -> bytes:
    """Send `data` (dot-stuffed) in reads of random sizes, then the final dot; the reply."""
    sock, reader = daemon.open_data(ENVELOPE, 60)
    with sock:
        rng = random.Random(seed)
        at = 0
        while at < len(data):
            step = rng.choice([1, 7, 1000, 65536, 300_000])
            sock.sendall(data[at : at + step])
            at += step
        sock.sendall(b".\r\n")
        reply = reader.readline()
        sock.sendall(b"QUIT\r\n")
    return reply


def stored(daemon, queue_id: str) -> bytes:
    """The stored content without our Received header (it names the queue id)."""
    return re.sub(rb"\AReceived: .*?\r\n(?![ \t])", b"", daemon.stored(queue_id), flags=re.S)


def temp_files(daemon) -> list[Path]:
    return list(SpoolLayout(daemon.spool).messages.glob("*/*/*.tmp"))


def test_a_streamed_message_is_stored_as_one_held_whole_and_delivered(start_daemon, tmp_path):
    data = awkward_content(3 * MiB)
    assert data.count(b"\r\n") > 1000
    held = start_daemon("spool.stream_threshold=64MiB", workdir=tmp_path / "held")
    whole = stored(held, queue_id(send_raw(held, data)))
    held.kill()
    with MailNet(["127.0.0.2"]) as net:
        net.add_domain("example.org", "127.0.0.2")
        daemon = start_daemon(STREAMED, workdir=tmp_path / "streamed")
        streamed_id = queue_id(send_raw(daemon, data, seed=2))
        accepted = daemon.wait_event("accepted")
        assert accepted["cls"] == "p0"  # its header was read
        assert accepted["size"] > 3 * MiB
        assert stored(daemon, streamed_id) == whole  # byte for byte
        assert daemon.stop() == 0
        daemon = start_daemon(STREAMED, *net.daemon_overrides(), *FAST, workdir=daemon.workdir)
        (received,) = wait_for(lambda: net.peers[0].messages, 60, "delivery")
        body = whole.split(b"\r\n\r\n", 1)[1]
        assert received.content.endswith(b"\r\n\r\n" + body) or body in received.content
        assert b"X-Mtaqueue-Class" not in received.content
        wait_for(lambda: not daemon.messages(), 30, "the queue to empty")
    assert temp_files(daemon) == []


def test_a_streamed_message_refused_at_the_dot_leaves_nothing(start_daemon):
    daemon = start_daemon(STREAMED, "listen.max_message_size=1MiB")
    big = b"Subject: big\r\n\r\n" + (b"z" * 78 + b"\r\n") * (3 * MiB // 80)
    assert send_raw(daemon, big) == b"552 5.3.4 Error: message too big for system\r\n"
    unknown_class = b"X-Mtaqueue-Class: nosuch\r\n" + big[: 16 + 80 * 10_000]  # whole lines
    assert send_raw(daemon, unknown_class).startswith(b"554 5.6.0 Unknown class 'nosuch'")
    wait_for(lambda: not temp_files(daemon), 10, "the temp files to go")
    assert daemon.messages() == {}
    assert queue_id(send_raw(daemon, b"Subject: small\r\n\r\nok\r\n"))


def test_a_client_that_stalls_or_goes_away_mid_stream_leaves_nothing(start_daemon):
    daemon = start_daemon(STREAMED, "listen.data_timeout=1s")
    for stalls in (True, False):
        sock, reader = daemon.open_data(ENVELOPE, 60)
        with sock:
            sock.sendall(b"Subject: s\r\n\r\n" + (b"s" * 78 + b"\r\n") * 20_000)
            wait_for(lambda: temp_files(daemon), 10, "the message to be written as it comes")
            if stalls:
                assert reader.readline().startswith(b"421 4.4.2 ")  # its deadline
        wait_for(lambda: not temp_files(daemon), 10, "the temp file to go")
    assert daemon.messages() == {}


def test_kill_9_mid_stream_leaves_no_message_and_no_temp_file(start_daemon):
    daemon = start_daemon(STREAMED)
    sock, _ = daemon.open_data(ENVELOPE, 60)
    with sock:
        sock.sendall(b"Subject: cut off\r\n\r\n" + (b"w" * 78 + b"\r\n") * 50_000)
        tmp = wait_for(lambda: [p for p in temp_files(daemon) if p.stat().st_size > MiB], 20)
        daemon.kill()
    assert tmp[0].exists()  # what the crash left
    daemon.start()
    swept = daemon.wait_event("spool_swept", 20)
    assert swept["temp_removed"] == 1
    assert daemon.messages() == {} and temp_files(daemon) == []


def rss_kib(pid: int) -> int:
    """Resident memory of `pid` and its children (the spool writer), KiB."""
    total = 0
    for task in [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]:
        for line in Path(f"/proc/{task}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


def test_memory_does_not_grow_with_the_size_of_messages_in_flight(start_daemon):
    # Four 16 MiB messages at once took the daemon and its writer up by ~600 MiB: the
    # data was held whole several times over (session, unstuffed copy, header copy,
    # the batch to the writer, the writer's copy).
    daemon = start_daemon()
    assert daemon.send("app@sender.test", ["bob@example.org"], b"Subject: warm\r\n\r\nup\r\n")
    idle = rss_kib(daemon.proc.pid)
    data = b"Subject: big\r\n\r\n" + (b"m" * 1022 + b"\r\n") * (16 * MiB // 1024)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_kib(daemon.proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    replies: list[bytes] = []
    clients = [
        threading.Thread(target=lambda seed=seed: replies.append(send_raw(daemon, data, seed)))
        for seed in range(4)
    ]
    try:
        for client in clients:
            client.start()
        for client in clients:
            client.join(120)
    finally:
        done.set()
        sampler.join()
    assert len(replies) == 4 and all(reply.startswith(b"250 ") for reply in replies), replies
    assert peak[0] - idle < 48 * 1024, (idle, peak[0])  # ~1 MiB a session at most, and slack
