"""What the listener makes of odd message content, end to end (daemon subprocess, sockets)."""

from __future__ import annotations

from e2e_helpers import queue_id

ENVELOPE = b"MAIL FROM:<app@example.com>\r\nRCPT TO:<a@example.org>\r\nDATA\r\n"


def raw_transaction(daemon, data: bytes) -> bytes:
    """Send the envelope, `data` as it is and the final dot; the reply to the dot."""
    sock, reader = daemon.open_data(ENVELOPE)
    with sock:
        sock.sendall(data + b"\r\n.\r\n")
        reply = reader.readline()
        sock.sendall(b"QUIT\r\n")
        return reply


def test_long_header_and_body_lines_are_accepted(daemon):
    # swaks --to with 1001 recipients writes them on one To: line; apps send minified
    # HTML on one line. Both got 550 5.6.0 (over 998 characters); Postfix takes them.
    recipients = [f"user{i}@example.org" for i in range(1001)]
    to = ("To: " + ", ".join(recipients)).encode()
    html = b"<html>" + b"<div class=x>minified</div>" * 8000 + b"</html>"
    content = to + b"\r\nSubject: long\r\nContent-Type: text/html\r\n\r\n" + html + b"\r\n"
    assert len(to) > 20_000 and len(html) > 200_000
    assert daemon.stored(daemon.send("app@example.com", ["a@example.org"], content)).endswith(
        content
    )


def test_a_bare_cr_in_a_header_cannot_inject_a_steering_header(daemon):
    # Under bare_newline = "normalize" the CR became CRLF: X-Mtaqueue-Class was read.
    reply = raw_transaction(daemon, b"Subject: hi\rX-Mtaqueue-Class: p0\r\n\r\nbody")
    message = daemon.messages()[queue_id(reply)]
    assert message["class"] == "p1"  # the default: no steering header was read
    assert daemon.stored(message["id"]).endswith(
        b"Subject: hi X-Mtaqueue-Class: p0\r\n\r\nbody\r\n"
    )


def test_lf_only_client_keeps_one_dot(daemon):
    reply = raw_transaction(daemon, b"Subject: lf\n\nline\n..x\n..")
    assert daemon.stored(queue_id(reply)).endswith(b"Subject: lf\r\n\r\nline\r\n.x\r\n.\r\n")


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
