"""The scriptable SMTP peers used by the delivery tests, exercised with real clients."""

from __future__ import annotations

import asyncio
import contextlib
import re
import smtplib
import socket
import threading
import time

import aiosmtplib
import pytest
from smtp_peer import DROP, HANG, Late, Raw, SmtpPeer, peers_on_one_port, self_signed_context

MSG = b"From: a@sender.test\r\nTo: b@rcpt.test\r\nSubject: hi\r\n\r\nHello.\r\n.leading dot\r\n"
CLIENT = "client.test"  # never let a client call getfqdn()


@pytest.fixture
def peer():
    with SmtpPeer("127.0.0.2") as running:
        yield running
        assert running.errors == []


def run(coro):
    return asyncio.run(coro)


async def send(peer: SmtpPeer, sender="a@sender.test", rcpts=("b@rcpt.test",), **kw):
    """One aiosmtplib session, one message; returns sendmail's result."""
    timeout = kw.pop("timeout", 5)
    client = aiosmtplib.SMTP(
        hostname=peer.host, port=peer.port, local_hostname=CLIENT, timeout=timeout
    )
    await client.connect(start_tls=False)
    try:
        return await client.sendmail(sender, list(rcpts), MSG, **kw)
    finally:
        client.close()


def smtplib_client(peer: SmtpPeer, timeout: float = 5) -> smtplib.SMTP:
    return smtplib.SMTP(peer.host, peer.port, local_hostname=CLIENT, timeout=timeout)


# -- default behaviour --------------------------------------------------------------------


def test_default_accept_records_everything(peer):
    refused, reply = run(send(peer, rcpts=["b@rcpt.test", "c@rcpt.test"]))
    assert refused == {}
    assert reply.startswith("2.0.0 Ok: queued as ")
    (msg,) = peer.wait_messages(1)
    assert msg.mail_from == "a@sender.test"
    assert msg.rcpt_tos == ["b@rcpt.test", "c@rcpt.test"]
    assert msg.rcpt_options == [[], []]
    assert msg.content == MSG  # dot-unstuffed, exactly what was sent
    assert msg.size == len(MSG) and len(msg.sha256) == 64
    assert msg.message["Subject"] == "hi"
    assert (msg.client_ip, msg.peer, msg.helo) == ("127.0.0.1", "127.0.0.2", CLIENT)
    assert msg.replied and msg.reply == f"250 {reply}"
    assert abs(msg.time - time.time()) < 5
    assert (peer.connections, peer.transactions) == (1, 1)
    peer.wait_for(lambda: peer.active == 0)
    assert [e.phase for e in peer.log] == [
        "banner", "ehlo", "mail", "rcpt", "rcpt", "data", "data_end", "close",
    ]  # fmt: skip
    assert peer.log[0].reply == "220 peer.test ESMTP"


def test_connection_reuse_and_null_sender_with_smtplib(peer):
    with smtplib_client(peer) as client:
        code, banner_ehlo = client.ehlo()
        assert code == 250 and b"ENHANCEDSTATUSCODES" in banner_ehlo
        client.sendmail("", ["bounce@rcpt.test"], MSG)
        client.sendmail("x@sender.test", ["y@rcpt.test"], MSG)
    first, second = peer.wait_messages(2)
    assert first.mail_from == ""  # the null reverse-path <>
    assert (first.connection, first.txn, second.connection, second.txn) == (1, 1, 1, 2)
    assert peer.connections == 1 and peer.transactions == 2


# -- scripting ------------------------------------------------------------------------------


def test_times_limited_reply_then_default(peer):
    peer.on("mail", "451 4.3.0 Try again later", times=1)
    with pytest.raises(aiosmtplib.SMTPSenderRefused) as info:
        run(send(peer))
    assert info.value.code == 451 and "4.3.0" in info.value.message
    run(send(peer))  # the rule was used up
    assert len(peer.messages) == 1
    assert peer.replies("mail") == ["451 4.3.0 Try again later", "250 2.1.0 Ok"]


def test_per_recipient_rule_and_rejected_recipient_not_recorded(peer):
    peer.on("rcpt", "550 5.1.1 <gone@rcpt.test>: No such user", rcpt="Gone@RCPT.test")
    refused, _ = run(send(peer, rcpts=["ok@rcpt.test", "gone@rcpt.test"]))
    assert refused["gone@rcpt.test"].code == 550
    (msg,) = peer.messages
    assert msg.rcpt_tos == ["ok@rcpt.test"]


def test_standing_rule_is_a_setter_and_none_restores_default(peer):
    peer.on("data_end", "452 4.3.1 Insufficient system storage")
    with pytest.raises(aiosmtplib.SMTPDataError) as info:
        run(send(peer))
    assert info.value.code == 452
    assert peer.messages == [] and len(peer.rejected) == 1
    assert peer.rejected[0].reply == "452 4.3.1 Insufficient system storage"
    peer.on("data_end", "554 5.7.1 Spam")  # replaces the 452
    with pytest.raises(aiosmtplib.SMTPDataError) as info:
        run(send(peer))
    assert info.value.code == 554
    peer.on("data_end", None)
    run(send(peer))
    assert len(peer.messages) == 1


def test_limited_rules_run_in_order_before_standing(peer):
    peer.on("rcpt", "250 2.1.5 fine")
    peer.on("rcpt", "450 4.2.1 first", times=1)
    peer.on("rcpt", "451 4.3.0 second", times=1)
    codes = []
    for _ in range(3):
        try:
            run(send(peer))
            codes.append(250)
        except aiosmtplib.SMTPRecipientsRefused as error:
            codes.append(error.recipients[0].code)
    assert codes == [450, 451, 250]


def test_callable_sees_context_and_triplet_attempts(peer):
    seen = []

    def script(ctx):
        seen.append((ctx.phase, ctx.rcpt, ctx.mail_from, ctx.attempt, ctx.client_ip))
        return "450 4.7.1 Come back later" if ctx.attempt < 3 else None

    peer.on("rcpt", script)
    for _ in range(2):
        with pytest.raises(aiosmtplib.SMTPRecipientsRefused):
            run(send(peer))
    run(send(peer))
    assert [s[3] for s in seen] == [1, 2, 3]
    assert seen[0] == ("rcpt", "b@rcpt.test", "a@sender.test", 1, "127.0.0.1")
    with pytest.raises(aiosmtplib.SMTPRecipientsRefused):  # another triplet starts at 1
        run(send(peer, sender="other@sender.test"))
    assert seen[-1][3] == 1


def test_data_phase_and_multiline_reply(peer):
    peer.on("data", "554 5.5.1 Error: no valid recipients", times=1)
    with pytest.raises(aiosmtplib.SMTPDataError) as info:
        run(send(peer))
    assert info.value.code == 554
    peer.on("rcpt", "550-5.7.1 first line\n550 5.7.1 second line", times=1)
    with pytest.raises(aiosmtplib.SMTPRecipientsRefused) as refused:
        run(send(peer))
    assert refused.value.recipients[0].message == "5.7.1 first line\n5.7.1 second line"


def test_bad_scripts_are_refused(peer):
    with pytest.raises(ValueError):
        peer.on("helo", "250 ok")
    with pytest.raises(ValueError):
        peer.on("mail", "hello")
    with pytest.raises(ValueError):
        peer.on("mail", "550 no", rcpt="x@y.test")
    with pytest.raises(ValueError):
        peer.on("rcpt", "450 later", times=0)


# -- greylisting ------------------------------------------------------------------------------


def test_greylisting_defers_the_first_triplet_until_the_window_passes(peer):
    peer.greylist(0.4)
    with pytest.raises(aiosmtplib.SMTPRecipientsRefused) as info:
        run(send(peer))
    reply = info.value.recipients[0]
    assert reply.code == 450
    assert re.fullmatch(r"4\.2\.0 Greylisted, try again in \d+ seconds", reply.message)
    with pytest.raises(aiosmtplib.SMTPRecipientsRefused):  # too early: still greylisted
        run(send(peer))
    time.sleep(0.45)
    run(send(peer))
    assert [m.rcpt_tos for m in peer.messages] == [["b@rcpt.test"]]
    with pytest.raises(aiosmtplib.SMTPRecipientsRefused):  # a new triplet is greylisted
        run(send(peer, sender="new@sender.test"))
    peer.greylist(0)
    run(send(peer, sender="new@sender.test"))


# -- connection-level behaviour ---------------------------------------------------------------


def test_banner_421_closes_the_connection(peer):
    peer.banner = "421 4.7.0 Too busy"
    with pytest.raises(aiosmtplib.SMTPConnectResponseError) as info:
        run(send(peer))
    assert info.value.code == 421
    with pytest.raises(smtplib.SMTPConnectError) as error:
        smtplib_client(peer)
    assert error.value.smtp_code == 421
    peer.wait_for(lambda: peer.active == 0)
    peer.banner = "220 peer.test ESMTP ready"
    peer.on("banner", "421 4.7.0 Once more", times=1)
    with pytest.raises(aiosmtplib.SMTPConnectResponseError):
        run(send(peer))
    run(send(peer))
    assert peer.replies("banner")[-1] == "220 peer.test ESMTP ready"


def test_421_at_mail_closes_the_connection(peer):
    peer.on("mail", "421 4.7.0 Rate limited, closing connection", times=1)
    with pytest.raises(aiosmtplib.SMTPResponseException) as info:
        run(send(peer))
    assert info.value.code == 421
    peer.wait_for(lambda: peer.active == 0)


def test_hang_makes_the_client_time_out(peer):
    peer.hang("banner", times=1)
    silent = socket.create_connection((peer.host, peer.port), timeout=0.3)
    with silent, pytest.raises(TimeoutError):
        silent.recv(100)  # no greeting
    peer.hang("data_end")
    with pytest.raises(aiosmtplib.SMTPTimeoutError):
        run(send(peer, timeout=0.3))
    (msg,) = peer.messages  # read completely, never answered
    assert msg.replied is False and msg.reply is None and msg.content == MSG
    assert peer.replies("data_end") == [HANG]
    peer.wait_for(lambda: peer.active == 0)  # the client gave up; the peer let go


def test_drop_after_the_final_dot_is_the_ambiguous_case(peer):
    peer.drop("data_end")
    with pytest.raises(aiosmtplib.SMTPServerDisconnected):
        run(send(peer))
    with smtplib_client(peer) as client, pytest.raises(smtplib.SMTPServerDisconnected):
        client.sendmail("a@sender.test", ["c@rcpt.test"], MSG)
    assert [(m.rcpt_tos, m.replied) for m in peer.messages] == [
        (["b@rcpt.test"], False),
        (["c@rcpt.test"], False),
    ]
    assert peer.replies("data_end") == [DROP, DROP]


def test_drop_at_rcpt_for_one_recipient(peer):
    peer.drop("rcpt", rcpt="boom@rcpt.test")
    run(send(peer, rcpts=["fine@rcpt.test"]))
    with pytest.raises(aiosmtplib.SMTPServerDisconnected):
        run(send(peer, rcpts=["boom@rcpt.test"]))
    assert len(peer.messages) == 1


def test_refuse_connections_and_resume(peer):
    peer.refuse_connections()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((peer.host, peer.port), timeout=2)
    with pytest.raises(aiosmtplib.SMTPConnectError):
        run(send(peer))
    peer.resume()
    run(send(peer))
    assert len(peer.messages) == 1


def test_stop_closes_open_connections_and_joins_the_thread():
    peer = SmtpPeer("127.0.0.2").start()
    peer.hang("mail")
    idle = socket.create_connection((peer.host, peer.port), timeout=2)
    hung = smtplib_client(peer)
    hung.ehlo()
    hung.putcmd("MAIL", "FROM:<a@sender.test>")
    peer.wait_for(lambda: peer.active == 2)
    threads = threading.active_count()
    peer.stop()
    assert threading.active_count() == threads - 1
    with idle:
        assert idle.recv(100).startswith(b"220")
        assert idle.recv(100) == b""  # closed by the peer
    with pytest.raises(smtplib.SMTPServerDisconnected):
        hung.getreply()
    hung.close()
    assert peer.active == 0 and peer.errors == []
    peer.stop()  # idempotent


# -- extensions -------------------------------------------------------------------------------


def test_dsn_parameters_recorded_per_recipient_exactly(peer):
    async def session():
        client = aiosmtplib.SMTP(
            hostname=peer.host, port=peer.port, local_hostname=CLIENT, timeout=5
        )
        async with client:
            await client.ehlo()
            assert client.supports_extension("dsn")
            await client.mail("a@sender.test", options=["RET=HDRS", "ENVID=QQ314159.aB"])
            await client.rcpt(
                "b@rcpt.test", options=["NOTIFY=SUCCESS,FAILURE", "ORCPT=rfc822;B@rcpt.test"]
            )
            await client.rcpt("c@rcpt.test", options=["NOTIFY=NEVER"])
            await client.rcpt("d@rcpt.test")
            await client.data(MSG)

    run(session())
    (msg,) = peer.messages
    assert msg.mail_options == ["RET=HDRS", "ENVID=QQ314159.aB"]
    assert msg.mail_params["ENVID"] == "QQ314159.aB"  # case kept
    assert msg.rcpt_options == [
        ["NOTIFY=SUCCESS,FAILURE", "ORCPT=rfc822;B@rcpt.test"],
        ["NOTIFY=NEVER"],
        [],
    ]
    assert msg.rcpt_params("B@RCPT.test") == {
        "NOTIFY": "SUCCESS,FAILURE",
        "ORCPT": "rfc822;B@rcpt.test",
    }
    assert msg.rcpt_params("d@rcpt.test") == {}


def test_bad_notify_is_a_syntax_error(peer):
    with smtplib_client(peer) as client:
        client.ehlo()
        client.mail("a@sender.test")
        assert client.rcpt("b@rcpt.test", ["NOTIFY=NEVER,SUCCESS"])[0] == 501
        assert client.rcpt("b@rcpt.test", ["XFOO=1"])[0] == 555


def test_without_dsn_the_parameters_are_refused():
    with SmtpPeer("127.0.0.2", dsn=False) as peer, smtplib_client(peer) as client:
        client.ehlo()
        assert not client.has_extn("dsn")
        assert client.mail("a@sender.test", ["ENVID=x1"])[0] == 555
        assert client.mail("a@sender.test")[0] == 250
        code, text = client.rcpt("b@rcpt.test", ["NOTIFY=SUCCESS"])
        assert code == 555 and text.startswith(b"5.5.4")
        assert client.rcpt("b@rcpt.test")[0] == 250


def test_smtputf8_only_when_enabled():
    utf8_rcpt = "jos\u00e9@r\u00e9cipient.test"
    with SmtpPeer("127.0.0.2") as peer:
        refused, _ = run(send(peer, rcpts=[utf8_rcpt], mail_options=["SMTPUTF8"]))
        assert refused == {} and peer.messages[0].rcpt_tos == [utf8_rcpt]
        assert peer.messages[0].mail_params["SMTPUTF8"] is True
    with SmtpPeer("127.0.0.2", smtputf8=False) as peer:
        with pytest.raises(aiosmtplib.SMTPNotSupported):
            run(send(peer, rcpts=[utf8_rcpt], mail_options=["SMTPUTF8"]))
        with smtplib_client(peer) as client:
            client.ehlo()
            assert not client.has_extn("smtputf8")


def test_starttls(tmp_path):
    context = self_signed_context(tmp_path)
    with SmtpPeer("127.0.0.2", starttls=context, pipelining=True) as peer:

        async def session():
            client = aiosmtplib.SMTP(
                hostname=peer.host, port=peer.port, local_hostname=CLIENT, timeout=5
            )
            await client.connect(start_tls=False)
            await client.ehlo()
            assert client.supports_extension("starttls")
            assert client.supports_extension("pipelining")
            await client.starttls(validate_certs=False)
            assert not client.supports_extension("starttls")
            await client.sendmail("a@sender.test", ["b@rcpt.test"], MSG)
            await client.quit()

        run(session())
        (msg,) = peer.messages
        assert msg.tls and msg.content == MSG
        assert peer.connections == 1
        assert peer.errors == []


def test_starttls_can_be_refused(tmp_path):
    with SmtpPeer("127.0.0.2", starttls=self_signed_context(tmp_path)) as peer:
        peer.on("starttls", "454 4.7.0 TLS not available due to local problem")
        with smtplib_client(peer) as client, pytest.raises(smtplib.SMTPResponseException) as info:
            client.starttls()
        assert info.value.smtp_code == 454
        assert peer.replies("starttls") == ["454 4.7.0 TLS not available due to local problem"]


# -- several peers, load ------------------------------------------------------------------------


def test_peers_on_one_port_each_get_their_own_mail():
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    peers = peers_on_one_port(hosts, hostname="mx.test")
    try:
        assert len({p.port for p in peers}) == 1
        for p in peers:
            run(send(p, rcpts=[f"user@{p.host}.test"]))
        for p in peers:
            assert [m.rcpt_tos for m in p.messages] == [[f"user@{p.host}.test"]]
            assert [m.peer for m in p.messages] == [p.host]
            assert p.errors == []
    finally:
        for p in peers:
            p.stop()


def test_lean_mode_many_messages():
    with SmtpPeer("127.0.0.2", keep_content=False, track_attempts=False, log_limit=50) as peer:
        with smtplib_client(peer) as client:
            for i in range(300):
                client.sendmail("a@sender.test", [f"r{i}@rcpt.test"], MSG)
        peer.wait_messages(300)
        assert all(m.content is None and m.size == len(MSG) for m in peer.messages)
        assert len({m.sha256 for m in peer.messages}) == 1
        assert len(peer.log) == 50 and peer.transactions == 300
        with pytest.raises(ValueError):
            _ = peer.messages[0].message


def test_max_active_counts_concurrent_connections(peer):
    async def many():
        await asyncio.gather(*(send(peer, rcpts=[f"r{i}@rcpt.test"]) for i in range(8)))

    run(many())
    assert len(peer.messages) == 8 and peer.connections == 8
    assert 1 <= peer.max_active <= 8


# -- misbehaving peers --------------------------------------------------------------------


def raw_session(peer: SmtpPeer, *lines: bytes, wait: float = 2.0) -> bytes:
    """Send command lines one by one, reading what comes back after each."""
    with socket.create_connection((peer.host, peer.port), timeout=5) as sock:
        got = b""
        sock.settimeout(wait)
        for line in (None, *lines):
            if line is not None:
                sock.sendall(line + b"\r\n")
            with contextlib.suppress(TimeoutError):
                got += sock.recv(65536)
        return got


def test_a_2xx_out_of_step_is_sent_and_the_session_goes_on(peer):
    peer.banner = "250 not a greeting"
    peer.on("mail", "252 2.1.0 Ok?")
    peer.on("data", "250 2.0.0 Ok?")
    got = raw_session(peer, b"EHLO c.test", b"MAIL FROM:<a@sender.test>", b"RCPT TO:<b@x>", b"DATA")
    replies = [line[:3] for line in got.split(b"\r\n")[:-1] if line[3:4] != b"-"]
    assert replies[:1] == [b"250"] and replies[-3:] == [b"252", b"250", b"250"]
    assert peer.messages == []  # DATA was "answered": no content was read


def test_raw_bytes_and_late_replies(peer):
    peer.on("mail", Late(0.5, "250 2.1.0 late"))
    peer.on("rcpt", Raw(b"garbage without a code\r\n"))
    started = time.monotonic()
    got = raw_session(peer, b"HELO c.test", b"MAIL FROM:<a@sender.test>", b"RCPT TO:<b@x>")
    assert got.endswith(b"\r\n250 2.1.0 late\r\ngarbage without a code\r\n")
    assert time.monotonic() - started >= 0.5
    assert [e.reply for e in peer.log if e.phase == "rcpt"] == ["garbage without a code\r\n"]


def test_late_reply_after_the_dot_is_recorded_as_sent(peer):
    peer.on("data_end", Late(1.0, "250 2.0.0 late"))
    with pytest.raises(aiosmtplib.SMTPTimeoutError):
        run(send(peer, timeout=0.5))
    (msg,) = peer.wait_messages(1)
    assert msg.replied and msg.reply == "250 2.0.0 late"
