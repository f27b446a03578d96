"""What the listener makes of odd message content, end to end (daemon subprocess, sockets)."""

from __future__ import annotations

import socket

from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.message_file import read_message_file

ENVELOPE = b"MAIL FROM:<app@example.com>\r\nRCPT TO:<a@example.org>\r\nDATA\r\n"


def stored(daemon, queue_id: str) -> bytes:
    _, content = read_message_file(SpoolLayout(daemon.spool).message_path(queue_id))
    return content


def raw_transaction(daemon, data: bytes) -> bytes:
    """Send the envelope and `data` (raw: smtplib would fix its line endings) and the
    final dot; return the reply to the dot."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as sock:
        reader = sock.makefile("rb")
        reader.readline()
        sock.sendall(b"EHLO c\r\n")
        while not reader.readline().startswith(b"250 "):
            pass
        sock.sendall(ENVELOPE)
        assert [reader.readline()[:3] for _ in range(3)] == [b"250", b"250", b"354"]
        sock.sendall(data + b"\r\n.\r\n")
        reply = reader.readline()
        sock.sendall(b"QUIT\r\n")
        return reply


def queue_id(reply: bytes) -> str:
    assert reply.startswith(b"250 2.0.0 Ok: queued as "), reply
    return reply.split()[-1].decode()


def test_long_header_and_body_lines_are_accepted(daemon):
    # swaks --to with 1001 recipients writes them on one To: line; apps send minified
    # HTML on one line. Both got 550 5.6.0 (over 998 characters); Postfix takes them.
    recipients = [f"user{i}@example.org" for i in range(1001)]
    to = ("To: " + ", ".join(recipients)).encode()
    html = b"<html>" + b"<div class=x>minified</div>" * 8000 + b"</html>"
    content = to + b"\r\nSubject: long\r\nContent-Type: text/html\r\n\r\n" + html + b"\r\n"
    assert len(to) > 20_000 and len(html) > 200_000
    assert stored(daemon, daemon.send("app@example.com", ["a@example.org"], content)).endswith(
        content
    )


def test_a_bare_cr_in_a_header_cannot_inject_a_steering_header(daemon):
    # Under bare_newline = "normalize" the CR became CRLF: X-Mtaqueue-Class was read.
    reply = raw_transaction(daemon, b"Subject: hi\rX-Mtaqueue-Class: p0\r\n\r\nbody")
    message = daemon.messages()[queue_id(reply)]
    assert message["class"] == "p1"  # the default: no steering header was read
    assert stored(daemon, message["id"]).endswith(
        b"Subject: hi X-Mtaqueue-Class: p0\r\n\r\nbody\r\n"
    )


def test_lf_only_client_keeps_one_dot(daemon):
    reply = raw_transaction(daemon, b"Subject: lf\n\nline\n..x\n..")
    assert stored(daemon, queue_id(reply)).endswith(b"Subject: lf\r\n\r\nline\r\n.x\r\n.\r\n")


def test_nul_is_refused_in_reject_mode(start_daemon):
    daemon = start_daemon("listen.bare_newline=reject")
    reply = raw_transaction(daemon, b"Subject: nul\r\n\r\na\0b")
    assert reply == b"550 5.6.0 Error: NUL character in message content (RFC 5322 2.3)\r\n"
    assert daemon.messages() == {}
    assert daemon.send("app@example.com", ["a@example.org"], b"Subject: ok\r\n\r\nok\r\n")


def test_unqualified_hostname_is_warned_about_at_start(start_daemon, tmp_path):
    for name in ("localhost", "mailhost"):
        daemon = start_daemon(f"listen.hostname={name}", workdir=tmp_path / name)
        event = daemon.wait_event("hostname_unqualified")
        assert event["level"] == "warning"
        assert event["key"] == "listen.hostname" and event["hostname"] == name
        with daemon.smtp() as client:
            assert client.ehlo_resp.startswith(name.encode())
    qualified = start_daemon(workdir=tmp_path / "qualified")  # listen.hostname = mx.test
    assert not [e for e in qualified.events if e.get("event") == "hostname_unqualified"]
