"""What goes on the wire (the daemon, the test DNS, real peers): SMTPUTF8, 8BITMIME, and
content converted for a hop that cannot take it as it is."""

from __future__ import annotations

import email
import email.policy

from e2e_helpers import FAST, MailNet, events, wait_for

UTF8_BODY = "Subject: gr\u00fc\u00dfe\r\nFrom: j\u00f6rg@sender.test\r\n\r\nH\u00e9llo\r\n".encode()
MIME_8BIT = (
    b"Subject: hello\r\nFrom: app@sender.test\r\nMIME-Version: 1.0\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n\r\n"
    + "H\u00e9llo, w\u00f6rld = 1\r\n".encode()
)


def decoded(content: bytes) -> str:
    return email.message_from_bytes(content, policy=email.policy.default).get_content()


def test_smtputf8_mail_is_delivered_to_a_server_with_smtputf8(start_daemon):
    with MailNet(["127.0.0.4"]) as net:
        (peer,) = net.peers
        net.add_domain("utf8.test", "127.0.0.4")
        daemon = start_daemon(*net.daemon_overrides(), *FAST)
        daemon.send(
            "j\u00f6rg@sender.test",
            ["\u00fcn\u00ef@utf8.test"],
            UTF8_BODY,
            mail_options=["SMTPUTF8"],
        )
        (received,) = wait_for(lambda: peer.messages, what="the delivery")
        assert received.mail_from == "j\u00f6rg@sender.test"
        assert received.rcpt_tos == ["\u00fcn\u00ef@utf8.test"]
        assert "SMTPUTF8" in received.mail_params
        assert received.mail_params["BODY"] == "8BITMIME"
        assert received.content.endswith(UTF8_BODY)  # byte for byte, after our own fields
        wait_for(lambda: not daemon.messages(), what="the message to leave the queue")


def test_8bit_content_gets_body_8bitmime_even_when_the_client_did_not_say(start_daemon):
    with MailNet(["127.0.0.4"]) as net:
        (peer,) = net.peers
        net.add_domain("eight.test", "127.0.0.4")
        daemon = start_daemon(*net.daemon_overrides(), *FAST)
        daemon.send("app@sender.test", ["a@eight.test"], MIME_8BIT)  # no BODY= given
        (received,) = wait_for(lambda: peer.messages, what="the delivery")
        assert received.mail_params["BODY"] == "8BITMIME"
        assert received.content.endswith(MIME_8BIT)


def test_8bit_content_is_converted_for_a_server_without_8bitmime(start_daemon):
    with MailNet(["127.0.0.5"], eightbitmime=False, smtputf8=False) as net:
        (peer,) = net.peers
        net.add_domain("seven.test", "127.0.0.5")
        daemon = start_daemon(*net.daemon_overrides(), *FAST)
        daemon.send("app@sender.test", ["a@seven.test"], MIME_8BIT, mail_options=["BODY=8BITMIME"])
        (received,) = wait_for(lambda: peer.messages, what="the delivery")
        assert "BODY" not in received.mail_params
        assert received.content.isascii()
        message = email.message_from_bytes(received.content, policy=email.policy.default)
        assert message["Content-Transfer-Encoding"] == "quoted-printable"
        assert decoded(received.content) == decoded(MIME_8BIT) == "H\u00e9llo, w\u00f6rld = 1\r\n"


def test_8bit_header_for_a_server_without_8bitmime_bounces_with_5_6_3(start_daemon):
    with MailNet(["127.0.0.5"], eightbitmime=False, smtputf8=False) as net:
        (peer,) = net.peers
        net.add_domain("seven.test", "127.0.0.5")
        daemon = start_daemon(*net.daemon_overrides(), *FAST)
        content = "Subject: gr\u00fc\u00dfe\r\n\r\nascii body\r\n".encode()
        daemon.send("app@sender.test", ["a@seven.test"], content)
        (event,) = wait_for(
            lambda: [e for e in events(daemon, "delivery") if e["rcpt"] == "a@seven.test"],
            what="the attempt",
        )
        assert event["outcome"] == "permanent" and event["enhanced"] == "5.6.3"
        assert "8-bit characters in a header (Subject)" in event["text"]
        wait_for(lambda: events(daemon, "dsn_queued"), what="the bounce")
        assert peer.messages == [] and peer.transactions == 0


def test_long_lines_accepted_at_submission_leave_legal_and_decode_the_same(start_daemon):
    # Submission takes what Postfix takes (a 1001-recipient To: line, a minified HTML part
    # of 300 KB on one line: larger than the inline conversion size); the peer, aiosmtpd,
    # refuses any line over 1000 octets, so the delivery proves the lines were made legal.
    to_line = "To: " + ", ".join(f"user{i}@rcpt.test" for i in range(1001))
    html = "<html><body>" + "<p>caf\u00e9</p>" * 25_000 + "</body></html>"
    content = (
        f"{to_line}\r\nSubject: minified\r\nMIME-Version: 1.0\r\n"
        "Content-Type: text/html; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n\r\n"
        f"{html}\r\n"
    ).encode()
    with MailNet(["127.0.0.5"], eightbitmime=False, smtputf8=False) as net:
        (peer,) = net.peers
        net.add_domain("long.test", "127.0.0.5")
        daemon = start_daemon(*net.daemon_overrides(), *FAST)
        daemon.send("app@sender.test", ["a@long.test"], content)
        (received,) = wait_for(lambda: peer.messages, what="the delivery", timeout=30)
        assert received.content.isascii()
        assert max(map(len, received.content.split(b"\r\n"))) <= 998
        message = email.message_from_bytes(received.content, policy=email.policy.default)
        assert message.get_content() == html + "\r\n"
        assert len(message["To"].addresses) == 1001
