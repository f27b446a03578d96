"""Submission end to end: the daemon as a subprocess, real SMTP clients."""

from __future__ import annotations

import email
import json
import smtplib
import socket
import time

BODY = b"Subject: hello\r\nFrom: app@example.com\r\n\r\nline one\r\n.leading dot\r\nend\r\n"


def test_accepted_messages_survive_restart_with_envelope_and_metadata(daemon):
    plain = daemon.send("app@example.com", ["a@example.org", "b@example.net"], BODY)
    dsn = daemon.send(
        "bounce@example.com",
        ["c@example.org"],
        b"X-Mtaqueue-Class: p0\r\nX-Mtaqueue-Expires: 2h\r\n"
        b"X-Mtaqueue-Idempotency-Key: reset-42\r\n" + BODY,
        mail_options=["RET=HDRS", "ENVID=Env+2BId-Xy"],
        rcpt_options=["NOTIFY=SUCCESS,FAILURE", "ORCPT=rfc822;C+40example.org"],
    )
    null_sender = daemon.send("", ["d@example.org"], BODY)
    assert daemon.restart().port

    queue = daemon.messages()
    assert set(queue) == {plain, dsn, null_sender}
    first = queue[plain]
    assert first["sender"] == "app@example.com"
    assert first["class"] == "p1"  # the default class
    assert [r["address"] for r in first["recipients"]] == ["a@example.org", "b@example.net"]
    assert all(r["state"] == "queued" and r["attempts"] == 0 for r in first["recipients"])
    assert first["held"] is False and first["size"] > len(BODY)
    assert abs(first["created"] - time.time()) < 60

    second = queue[dsn]
    assert second["class"] == "p0"
    assert second["ret"] == "HDRS" and second["envid"] == "Env+Id-Xy"  # case kept
    assert second["idempotency_key"] == "reset-42"
    assert 7000 < second["expires"] - second["created"] < 7400
    rcpt = second["recipients"][0]
    assert rcpt["notify"] == "SUCCESS,FAILURE" and rcpt["orcpt"] == "rfc822;C@example.org"
    assert queue[null_sender]["sender"] == ""

    # The content is what the client sent, plus trace headers, minus ours.
    content = daemon.stored(dsn)
    assert content.endswith(BODY)
    assert b"X-Mtaqueue" not in content
    parsed = email.message_from_bytes(content)
    assert dsn in parsed["Received"] and parsed["Message-ID"] and parsed["Date"]
    assert daemon.stored(plain).endswith(b"\r\n\r\nline one\r\n.leading dot\r\nend\r\n")


def test_show_and_status(daemon):
    queue_id = daemon.send("app@example.com", ["a@example.org"], BODY)
    shown = daemon.ctl("show", queue_id, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["id"] == queue_id
    status = json.loads(daemon.ctl("status", "--json").stdout)
    assert status["messages"] == 1
    assert status["by_state"]["queued"] == 1 and status["by_class"]["p1"] == 1
    missing = daemon.ctl("show", "0000000000000000")
    assert missing.returncode != 0 and len(missing.stderr.strip().splitlines()) == 1


def test_idempotency_key_returns_first_id(daemon):
    content = b"X-Mtaqueue-Idempotency-Key: order-7\r\n" + BODY
    first = daemon.send("app@example.com", ["a@example.org"], content)
    again = daemon.send("app@example.com", ["a@example.org"], content)
    assert again == first
    daemon.restart()  # the key is durable
    assert daemon.send("app@example.com", ["a@example.org"], content) == first
    assert list(daemon.messages()) == [first]
    other = daemon.send("app@example.com", ["a@example.org"], BODY)
    assert other != first


def test_idempotency_window_expires(start_daemon):
    daemon = start_daemon("submission.dedupe_window=1s")
    content = b"X-Mtaqueue-Idempotency-Key: k\r\n" + BODY
    first = daemon.send("app@example.com", ["a@example.org"], content)
    time.sleep(1.2)
    assert daemon.send("app@example.com", ["a@example.org"], content) != first


def test_unknown_class_refused_at_data(daemon):
    with daemon.smtp() as client:
        client.mail("app@example.com")
        client.rcpt("a@example.org")
        code, reply = client.data(b"X-Mtaqueue-Class: urgent\r\n" + BODY)
    assert code == 554 and b"urgent" in reply and b"p0" in reply
    assert daemon.messages() == {}


def test_limits_size_recipients_relay(start_daemon):
    daemon = start_daemon(
        "listen.max_message_size=4096",
        "listen.max_recipients=2",
        'listen.mynetworks=["10.0.0.0/8"]',
    )
    with daemon.smtp() as client:
        code, _ = client.mail("app@example.com")
        code, reply = client.rcpt("a@example.org")
        assert code == 554 and b"Relay access denied" in reply
    relaying = start_daemon(
        "listen.max_message_size=4096", "listen.max_recipients=2", workdir=daemon.workdir / "b"
    )
    with relaying.smtp() as client:
        code, reply = client.docmd("MAIL FROM:<app@example.com> SIZE=100000")
        assert code == 552 and b"5.3.4" in reply
        client.mail("app@example.com")
        assert client.rcpt("a@example.org")[0] == 250
        assert client.rcpt("b@example.org")[0] == 250
        code, reply = client.rcpt("c@example.org")
        assert code == 452 and b"4.5.3" in reply
        code, reply = client.data(BODY + b"x" * 5000 + b"\r\n")
        assert code == 552
        client.rset()
        client.mail("app@example.com")
        client.rcpt("a@example.org")
        assert client.data(BODY)[0] == 250  # the session goes on after a refusal
    assert len(relaying.messages()) == 1


def test_bad_addresses_get_501(daemon):
    with daemon.smtp() as client:
        code, reply = client.docmd("MAIL FROM:<no-domain>")
        assert code == 501 and b"5.1.7" in reply
        client.mail("app@example.com")
        for bad in ("<a@@b.org>", "<a@-bad-.org>", "a@b.org", "<>"):
            code, reply = client.docmd(f"RCPT TO:{bad}")
            assert code == 501, (bad, reply)


def test_xtext_that_is_not_utf8_gets_501_and_the_spool_goes_on(daemon):
    # ENVID=+FF once decoded to a lone surrogate: 250 to MAIL, then the spool wedged
    # (no reply after any final dot, ever) and SIGTERM never finished.
    with daemon.smtp() as client:
        code, reply = client.docmd("MAIL FROM:<a@sender.test> ENVID=+FF")
        assert code == 501 and reply.startswith(b"5.5.4"), reply
        assert client.mail("a@sender.test")[0] == 250
        code, reply = client.docmd("RCPT TO:<b@x.test> ORCPT=rfc822;x+F9+EF")
        assert code == 501 and reply.startswith(b"5.5.4"), reply
        assert client.rcpt("b@x.test")[0] == 250
        code, reply = client.data(BODY)
        assert code == 250, reply
    queue_id = daemon.send("a@sender.test", ["c@x.test"], BODY, mail_options=["ENVID=+C3+A9"])
    assert daemon.messages()[queue_id]["envid"] == "é"
    assert daemon.stop() == 0


def test_smuggling_never_makes_two_messages(daemon):
    for ending in (b"\n.\n", b"\r.\r", b"\n.\r\n", b"\r\n.\n"):
        payload = (
            b"Subject: one\r\n\r\nfirst" + ending + b"MAIL FROM:<evil@example.com>\r\n"
            b"RCPT TO:<victim@example.org>\r\nDATA\r\nSubject: smuggled\r\n\r\nsecond\r\n.\r\n"
        )
        envelope = b"MAIL FROM:<app@example.com>\r\nRCPT TO:<a@example.org>\r\nDATA\r\n"
        sock, reader = daemon.open_data(envelope, timeout=10)
        with sock:
            sock.sendall(payload)
            assert reader.readline().startswith(b"250 ")
            sock.sendall(b"QUIT\r\n")
            assert reader.readline().startswith(b"221")  # no replies for a second message
    queue = daemon.messages()
    assert len(queue) == 4
    for message in queue.values():
        assert [r["address"] for r in message["recipients"]] == ["a@example.org"]
        assert b"MAIL FROM:<evil@example.com>" in daemon.stored(message["id"])


def test_connection_cap_answers_421(start_daemon):
    daemon = start_daemon("listen.max_connections=2")
    first, second = daemon.smtp(), daemon.smtp()
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as third:
        assert third.makefile("rb").readline().startswith(b"421 4.7.0")
    first.quit()
    time.sleep(0.1)
    fourth = daemon.smtp()
    assert fourth.noop()[0] == 250
    second.quit()
    fourth.quit()


def test_idle_session_times_out(start_daemon):
    daemon = start_daemon("listen.command_timeout=1s")
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        reader = sock.makefile("rb")
        reader.readline()
        assert reader.readline().startswith(b"421 4.4.2")
        assert reader.readline() == b""  # closed


def test_sigterm_lets_message_in_transfer_finish(daemon):
    client = daemon.smtp()
    client.mail("app@example.com")
    client.rcpt("a@example.org")
    client.putcmd("data")
    assert client.getreply()[0] == 354
    client.send(b"Subject: slow\r\n\r\npart one\r\n")
    daemon.proc.send_signal(15)
    time.sleep(0.5)
    client.send(b"part two\r\n.\r\n")
    code, reply = client.getreply()
    assert code == 250
    queue_id = reply.decode().rsplit(" ", 1)[1]
    assert daemon.proc.wait(30) == 0
    with smtplib.SMTP() as late:
        try:
            late.connect("127.0.0.1", daemon.port)
            raise AssertionError("still accepting after SIGTERM")
        except OSError:
            pass
    daemon.start()
    assert queue_id in daemon.messages()


def test_bad_config_exits_2_naming_the_key(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "mtaqueue.daemon", "-o", "listen.bogus=1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "mtaqueue: listen.bogus: unknown key"
