"""The delivery client (mtaqueue.smtp.client) against a real peer, without a daemon: what
it sends for content the submission side accepts but SMTP cannot carry as it is."""

from __future__ import annotations

import asyncio
import email
import email.policy
import ssl

import pytest
from smtp_peer import SmtpPeer, self_signed_cert, self_signed_context

from mtaqueue.config import TimeoutsConfig
from mtaqueue.model import Message, Recipient
from mtaqueue.policy.classify import classify
from mtaqueue.routing.relays import IMPLICIT, STARTTLS
from mtaqueue.smtp.client import ClientSettings, ConnectFailed, Smarthost, SmtpConnection

TIMEOUTS = TimeoutsConfig()
SETTINGS = ClientSettings("mx.test", TIMEOUTS, "off")


@pytest.fixture
def peer():
    with SmtpPeer("127.0.0.2") as running:  # aiosmtpd: lines over 1000 octets are refused
        yield running
        assert running.errors == []


def deliver(peer: SmtpPeer, content: bytes) -> str:
    message = Message("q1", "app@sender.test", (Recipient("a@example.org"),), 0.0, 0, "p1")

    async def run() -> str:
        conn = await SmtpConnection.open("mx.example.org", peer.host, peer.port, SETTINGS)
        try:
            (reply,) = await conn.send(
                message, list(message.recipients), content, SETTINGS.timeouts
            )
        finally:
            await conn.quit()
        return reply.line()

    return asyncio.run(run())


def test_long_lines_are_made_legal_on_the_way_out(peer):
    # What swaks sends with 1001 recipients on one To: line, and an app's minified HTML.
    to = "To: " + ", ".join(f"user{i}@example.org" for i in range(1001))
    html = "<p>" + "x" * 5000 + "</p>"
    content = f"Subject: long\r\n{to}\r\nContent-Type: text/html\r\n\r\n{html}\r\n".encode()
    assert deliver(peer, content).startswith("250 ")
    (received,) = peer.messages
    assert max(map(len, received.content.split(b"\r\n"))) <= 998
    message = email.message_from_bytes(received.content, policy=email.policy.default)
    assert message["To"] == to.removeprefix("To: ")  # folded, unfolds to the same
    assert message["Content-Transfer-Encoding"] == "quoted-printable"
    assert message.get_content() == html + "\r\n"


def test_an_address_that_cannot_be_sent_fails_alone_as_a_local_error(peer):
    # A lone surrogate is what undecodable UTF-8 became: it cannot go on the wire.
    bad, good = Recipient("a\udcff@example.org"), Recipient("b@example.org")
    message = Message("q1", "app@sender.test", (bad, good), 0.0, 0, "p1", smtputf8=True)

    async def run():
        conn = await SmtpConnection.open("mx.example.org", peer.host, peer.port, SETTINGS)
        try:
            return await conn.send(message, [bad, good], b"Subject: x\r\n\r\nx\r\n", TIMEOUTS)
        finally:
            await conn.quit()

    refused, accepted = asyncio.run(run())
    assert (refused.phase, refused.network) == ("rcpt", "local")
    assert classify(refused).outcome == "transient"  # charged and retried, never a loop
    assert accepted.code == 250
    assert [m.rcpt_tos for m in peer.messages] == [["b@example.org"]]


def open_smarthost(peer: SmtpPeer, smarthost: Smarthost) -> str:
    """How opening a connection to `peer` as a smarthost ends: "open" or the reply."""

    async def run() -> str:
        try:
            conn = await SmtpConnection.open(
                "smarthost.test", peer.host, peer.port, SETTINGS, smarthost=smarthost
            )
        except ConnectFailed as failed:
            return f"{failed.reply.phase}: {failed.reply.line()} ({classify(failed.reply).kind})"
        await conn.quit()
        return "open"

    return asyncio.run(run())


@pytest.fixture
def tls(tmp_path):
    cert, _ = self_signed_cert(tmp_path, "smarthost.test")
    server = self_signed_context(tmp_path, "smarthost.test")
    return server, ssl.create_default_context(cafile=str(cert))


def test_a_smarthost_without_plain_or_login_gets_no_credentials(tls):
    server, client = tls
    with SmtpPeer("127.0.0.2", starttls=server, auth={"u": "p"}, auth_mechanisms=()) as peer:
        outcome = open_smarthost(peer, Smarthost(STARTTLS, client, "u", "p"))
    assert (
        outcome == "auth: smarthost.test offers no AUTH: AUTH PLAIN or LOGIN is needed for u (auth)"
    )
    assert peer.auth_attempts == []


def test_required_starttls_is_verified_and_auth_follows(tls):
    server, client = tls
    with SmtpPeer("127.0.0.2", starttls=server, auth={"u": "p"}) as peer:
        assert open_smarthost(peer, Smarthost(STARTTLS, client, "u", "p")) == "open"
        unverified = ssl.create_default_context()  # the system's CAs: not this certificate
        refused = open_smarthost(peer, Smarthost(STARTTLS, unverified, "u", "p"))
    assert refused.startswith("starttls: TLS session failed: TLS failed: [SSL: CERTIFICATE_VERIFY")
    assert [(a.user, a.ok, a.tls) for a in peer.auth_attempts] == [("u", True, True)]


def test_implicit_tls_is_verified_from_the_first_byte(tls):
    server, client = tls
    with SmtpPeer("127.0.0.2", implicit_tls=server, auth={"u": "p"}) as peer:
        assert open_smarthost(peer, Smarthost(IMPLICIT, client, "u", "p")) == "open"
        refused = open_smarthost(peer, Smarthost(IMPLICIT, ssl.create_default_context(), "u", "p"))
    assert refused.startswith("banner: TLS failed: [SSL: CERTIFICATE_VERIFY_FAILED]")
    assert refused.endswith("(tls)")
    assert [(a.user, a.ok, a.tls) for a in peer.auth_attempts] == [("u", True, True)]
