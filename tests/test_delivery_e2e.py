"""Delivery end to end: the daemon, a real DNS server and real SMTP peers on loopback.

Test zones: `example.org` (recipients) has MX hosts on 127.0.0.2 / 127.0.0.3;
`sender.test` (where DSNs go back to) has its MX on 127.0.0.9. All peers share
one port, which the daemon uses as delivery.port. Retry times are scaled down.
"""

from __future__ import annotations

import email
import email.policy
import json
import time

import pytest
from e2e_helpers import BODY, FAST, MailNet, events, wait_for

from mtaqueue.smtp.addresses import xtext_decode


class World(MailNet):
    """The test zones of the module docstring, their peers, and a daemon using them."""

    def __init__(self, start_daemon) -> None:
        super().__init__(["127.0.0.2", "127.0.0.3", "127.0.0.9"])
        self.mx1, self.mx2, self.home = self.peers
        self.add_domain("example.org", "127.0.0.2", "127.0.0.3")  # mx1 (10), mx2 (20)
        self.add_domain("sender.test", "127.0.0.9")
        self._start_daemon = start_daemon

    def daemon(self, *overrides: str):
        return self._start_daemon(*self.daemon_overrides(), *FAST, *overrides)


@pytest.fixture
def world(start_daemon):
    with World(start_daemon) as w:
        yield w


def dsn_parts(received) -> tuple[email.message.Message, list]:
    report = email.message_from_bytes(received.content, policy=email.policy.default)
    assert report.get_content_type() == "multipart/report"
    assert report.get_param("report-type") == "delivery-status"
    parts = list(report.iter_parts())
    status = parts[1]
    assert status.get_content_type() == "message/delivery-status"
    return report, status.get_payload()


def test_delivered_to_the_preferred_mx_and_removed_from_the_queue(world):
    daemon = world.daemon()
    queue_id = daemon.send(
        "app@sender.test", ["bob@example.org"], b"X-Mtaqueue-Class: p0\r\n" + BODY
    )
    (received,) = wait_for(lambda: world.mx1.messages, what="delivery")
    assert received.mail_from == "app@sender.test" and received.rcpt_tos == ["bob@example.org"]
    assert received.content.endswith(b"\r\n\r\nhello world\r\n")
    assert b"X-Mtaqueue" not in received.content
    wait_for(lambda: not daemon.messages(), what="message to leave the queue")
    (event,) = wait_for(lambda: events(daemon, "delivery"))
    assert event["id"] == queue_id and event["outcome"] == "delivered"
    assert event["mx"] == "mx1.example.org" and event["ip"] == "127.0.0.2"
    assert event["code"] == 250 and event["attempt"] == 1
    assert world.mx2.messages == []


def test_next_mx_when_the_first_refuses_connections(world):
    world.mx1.refuse_connections()
    daemon = world.daemon()
    daemon.send("app@sender.test", ["bob@example.org"], BODY)
    wait_for(lambda: world.mx2.messages, what="delivery through mx2")
    assert world.mx1.messages == []
    suspended = wait_for(lambda: events(daemon, "host_suspended"))
    assert suspended[0]["host"] == "mx1.example.org"


def test_greylisted_then_delivered_after_the_window(world):
    world.mx1.greylist(3.0)
    daemon = world.daemon("retry.greylist_min=3s")
    queue_id = daemon.send("app@sender.test", ["bob@example.org"], BODY)
    first = wait_for(lambda: events(daemon, "delivery"), what="first attempt")[0]
    assert first["outcome"] == "transient" and first["kind"] == "greylisting"
    rcpt = daemon.messages()[queue_id]["recipients"][0]
    assert rcpt["state"] == "deferred" and rcpt["attempts"] == 1
    assert rcpt["last_reply"].startswith("450")
    assert rcpt["next_attempt"] >= time.time() + 1.0  # not retried before the window
    wait_for(lambda: world.mx1.messages, timeout=15, what="second attempt")
    tries = [e for e in world.mx1.log if e.phase == "rcpt"]
    assert tries[1].time - tries[0].time >= 3.0 * 0.94  # the window, within jitter


def test_hard_bounce_sends_a_dsn_and_suppresses_the_address(world):
    world.mx1.on("rcpt", "550 5.1.1 <gone@example.org>: user unknown", rcpt="gone@example.org")
    daemon = world.daemon()
    queue_id = daemon.send(
        "app@sender.test",
        ["gone@example.org"],
        BODY,
        mail_options=["ENVID=Abc+2B1", "RET=HDRS"],
        rcpt_options=["NOTIFY=FAILURE", "ORCPT=rfc822;gone@example.org"],
    )
    (dsn,) = wait_for(lambda: world.home.messages, what="the DSN")
    assert dsn.mail_from == "" and dsn.rcpt_tos == ["app@sender.test"]
    report, groups = dsn_parts(dsn)
    per_message, per_recipient = groups[0], groups[1]
    assert per_message["Original-Envelope-Id"] == "Abc+1"  # decoded (RFC 3461 6.3)
    assert per_message["Reporting-MTA"] == "dns; mx.test"
    assert per_recipient["Final-Recipient"] == "rfc822; gone@example.org"
    assert per_recipient["Action"] == "failed" and per_recipient["Status"] == "5.1.1"
    assert "550 5.1.1" in per_recipient["Diagnostic-Code"]
    assert per_recipient["Remote-MTA"] == "dns; mx1.example.org"
    assert list(report.iter_parts())[2].get_content_type() == "text/rfc822-headers"  # RET=HDRS
    assert queue_id not in daemon.messages()

    listed = daemon.ctl("suppress", "list", "--json")
    assert json.loads(listed.stdout)["address"] == "gone@example.org"
    with daemon.smtp() as client:
        client.mail("app@sender.test")
        code, reply = client.rcpt("gone@example.org")
        assert code == 550 and b"suppressed" in reply
    assert daemon.ctl("suppress", "remove", "gone@example.org").returncode == 0
    with daemon.smtp() as client:
        client.mail("app@sender.test")
        assert client.rcpt("gone@example.org")[0] == 250


def test_expiry_sends_a_dsn_with_the_last_real_error(world):
    world.mx1.on("rcpt", "451 4.3.0 mailbox temporarily locked")
    world.mx2.on("rcpt", "451 4.3.0 mailbox temporarily locked")
    daemon = world.daemon("classes.p1.lifetime=5s")
    daemon.send("app@sender.test", ["bob@example.org"], BODY)
    (dsn,) = wait_for(lambda: world.home.messages, timeout=25, what="the expiry DSN")
    _, groups = dsn_parts(dsn)
    assert groups[1]["Action"] == "failed"
    assert "451 4.3.0 mailbox temporarily locked" in groups[1]["Diagnostic-Code"]
    assert groups[1]["Status"] == "4.3.0"
    assert wait_for(lambda: events(daemon, "expired"))[0]["action"] == "bounce"
    wait_for(lambda: not daemon.messages(), what="the expired message to leave")


def test_null_sender_never_gets_a_dsn(world):
    world.mx1.on("rcpt", "550 5.1.1 no such user")
    daemon = world.daemon()
    daemon.send("", ["nobody@example.org"], BODY)
    wait_for(lambda: events(daemon, "delivery"))
    wait_for(lambda: not daemon.messages(), what="the bounce to finish")
    time.sleep(1.0)
    assert events(daemon, "dsn_queued") == [] and world.home.messages == []


def test_restart_keeps_due_times(world):
    world.mx1.on("rcpt", "451 4.3.0 try later")
    world.mx2.on("rcpt", "451 4.3.0 try later")
    daemon = world.daemon('retry.schedule=["30s"]')
    queue_id = daemon.send("app@sender.test", ["bob@example.org"], BODY)
    wait_for(lambda: events(daemon, "delivery"))
    due = daemon.messages()[queue_id]["recipients"][0]["next_attempt"]
    assert due > time.time() + 20
    daemon.restart()
    assert daemon.messages()[queue_id]["recipients"][0]["next_attempt"] == due
    connections = world.mx1.connections + world.mx2.connections
    time.sleep(3)  # overdue mail would have been tried within restart_spread
    assert world.mx1.connections + world.mx2.connections == connections


def test_dns_null_mx_and_nxdomain_bounce_servfail_defers(world):
    world.dns.add("nullmx.test", "MX", "0 .")
    world.dns.servfail("broken.test")
    daemon = world.daemon()
    daemon.send("app@sender.test", ["a@nullmx.test"], BODY)
    daemon.send("app@sender.test", ["a@nowhere.test"], BODY)
    broken = daemon.send("app@sender.test", ["a@broken.test"], BODY)
    dsns = wait_for(lambda: len(world.home.messages) == 2 and world.home.messages, what="DSNs")
    statuses = sorted(dsn_parts(d)[1][1]["Status"] for d in dsns)
    assert statuses == ["5.1.10", "5.1.2"]
    rcpt = wait_for(lambda: daemon.messages().get(broken))["recipients"][0]
    wait_for(lambda: daemon.messages()[broken]["recipients"][0]["state"] == "deferred")
    rcpt = daemon.messages()[broken]["recipients"][0]
    assert "4.4.3" in rcpt["last_reply"]


def test_dsn_parameters_passed_on_or_stripped_with_a_relayed_notice(world):
    world.mx2.refuse_connections()
    daemon = world.daemon()
    daemon.send(
        "app@sender.test",
        ["bob@example.org"],
        BODY,
        mail_options=["ENVID=QQ+2Bid", "RET=FULL"],
        rcpt_options=["NOTIFY=SUCCESS,FAILURE", "ORCPT=rfc822;Bob+40example.org"],
    )
    (received,) = wait_for(lambda: world.mx1.messages)
    # Passed on unchanged in meaning (xtext may be re-encoded canonically).
    assert xtext_decode(received.mail_params["ENVID"]) == "QQ+id"
    assert received.mail_params["RET"] == "FULL"
    params = received.rcpt_params("bob@example.org")
    assert params["NOTIFY"] == "SUCCESS,FAILURE"
    assert xtext_decode(params["ORCPT"]) == "rfc822;Bob@example.org"
    assert world.home.messages == []  # the next hop handles DSNs from here


def test_success_notice_when_the_next_hop_has_no_dsn(start_daemon):
    with MailNet(["127.0.0.4", "127.0.0.9"], dsn=False) as net:
        plain, home = net.peers
        net.add_domain("nodsn.test", "127.0.0.4")
        net.add_domain("sender.test", "127.0.0.9")
        daemon = start_daemon(*net.daemon_overrides(), *FAST)
        daemon.send("app@sender.test", ["c@nodsn.test"], BODY, rcpt_options=["NOTIFY=SUCCESS"])
        (received,) = wait_for(lambda: plain.messages)
        assert received.rcpt_options == [[]]  # no DSN parameters to a server without DSN
        (notice,) = wait_for(lambda: home.messages, what="the relayed notice")
        _, groups = dsn_parts(notice)
        assert groups[1]["Action"] == "relayed"


def test_connection_lost_after_the_dot_is_ambiguous_and_retried(world):
    world.mx1.drop("data_end")
    world.mx2.refuse_connections()
    daemon = world.daemon()
    queue_id = daemon.send("app@sender.test", ["bob@example.org"], BODY)
    first = wait_for(lambda: events(daemon, "delivery"))[0]
    assert first["outcome"] == "ambiguous" and first["phase"] == "data_end"
    world.mx1.on("data_end", "250 2.0.0 ok")  # the peer recovers
    wait_for(lambda: not daemon.messages(), timeout=15, what="the retry")
    assert len(world.mx1.messages) == 2  # the price of "retry": a possible duplicate
    assert queue_id


def test_ambiguous_assume_delivered(world):
    world.mx1.drop("data_end")
    daemon = world.daemon("delivery.ambiguous=assume-delivered")
    daemon.send("app@sender.test", ["bob@example.org"], BODY)
    wait_for(lambda: not daemon.messages(), what="assumed delivery")
    time.sleep(1)
    assert len(world.mx1.messages) == 1


def test_421_greeting_suspends_the_host(world):
    world.mx1.banner = "421 4.7.0 mx1 too busy"
    daemon = world.daemon()
    daemon.send("app@sender.test", ["bob@example.org"], BODY)
    wait_for(lambda: world.mx2.messages, what="delivery through mx2")
    assert events(daemon, "host_suspended")[0]["host"] == "mx1.example.org"
    daemon.send("app@sender.test", ["carol@example.org"], BODY)
    wait_for(lambda: len(world.mx2.messages) == 2)
    assert world.mx1.connections == 1  # suspended: not tried again


def test_too_many_recipients_go_in_another_transaction(world):
    def limit(ctx):
        return "452 4.5.3 Too many recipients" if len(ctx.rcpt_tos) >= 2 else None

    world.mx1.on("rcpt", limit)
    daemon = world.daemon()
    rcpts = [f"u{i}@example.org" for i in range(5)]
    daemon.send("app@sender.test", rcpts, BODY)
    wait_for(lambda: not daemon.messages(), what="all recipients")
    got = sorted(r for m in world.mx1.messages for r in m.rcpt_tos)
    assert got == rcpts and len(world.mx1.messages) == 3


def test_smtputf8_message_to_a_server_without_it_bounces(start_daemon):
    with MailNet(["127.0.0.4"], smtputf8=False) as net:
        (plain,) = net.peers
        net.add_domain("ascii.test", "127.0.0.4")
        daemon = start_daemon(*net.daemon_overrides(), *FAST)
        daemon.send("jörg@ascii.test", ["c@ascii.test"], BODY, mail_options=["SMTPUTF8"])
        event = wait_for(lambda: events(daemon, "delivery"))[0]
        assert event["outcome"] == "permanent" and event["enhanced"] == "5.6.7"
        assert plain.messages == []


def test_messages_to_one_server_share_a_connection(world):
    daemon = world.daemon(
        "shaping.default.max_connections=1",
        "shaping.default.initial_connections=1",
        "shaping.default.reserved_p0=0",
    )
    for i in range(5):
        daemon.send("app@sender.test", [f"r{i}@example.org"], BODY)
    wait_for(lambda: len(world.mx1.messages) == 5, what="five deliveries")
    assert world.mx1.transactions == 5
    assert world.mx1.connections == 1  # one worker kept its connection for the next message


def test_all_hosts_suspended_waits_without_charging_attempts(world):
    world.mx1.refuse_connections()
    world.mx2.refuse_connections()
    daemon = world.daemon("delivery.host_suspend=30s")
    first = daemon.send("app@sender.test", ["a@example.org"], BODY)
    wait_for(lambda: len(events(daemon, "host_suspended")) == 2, what="both hosts suspended")
    assert daemon.messages()[first]["recipients"][0]["attempts"] == 1
    second = daemon.send("app@sender.test", ["b@example.org"], BODY)
    time.sleep(1.5)
    rcpt = daemon.messages()[second]["recipients"][0]
    assert rcpt["attempts"] == 0 and rcpt["state"] == "queued"  # an internal wait
    assert len(events(daemon, "delivery")) == 1


@pytest.mark.parametrize("action", ["discard", "hold"])
def test_expiry_actions_discard_and_hold(world, action):
    world.mx1.on("rcpt", "451 4.3.0 later")
    world.mx2.on("rcpt", "451 4.3.0 later")
    daemon = world.daemon("classes.p2.lifetime=3s", f"classes.p2.expire_action={action}")
    queue_id = daemon.send(
        "app@sender.test", ["bob@example.org"], b"X-Mtaqueue-Class: p2\r\n" + BODY
    )
    if action == "discard":
        wait_for(lambda: not daemon.messages(), what="the discarded message to leave")
        assert wait_for(lambda: events(daemon, "expired"))[0]["action"] == "discard"
    else:
        held = wait_for(lambda: daemon.messages()[queue_id]["held"], what="the message held")
        assert held and daemon.messages()[queue_id]["recipients"][0]["state"] == "held"
        attempts = len(events(daemon, "delivery"))
        time.sleep(3)
        assert len(events(daemon, "delivery")) == attempts  # held mail is not tried
    time.sleep(0.5)
    assert world.home.messages == []  # no DSN for either


def test_one_delay_notice_when_asked(world):
    world.mx1.on("rcpt", "452 4.2.2 mailbox full")
    world.mx2.on("rcpt", "452 4.2.2 mailbox full")
    daemon = world.daemon("dsn.delay_after=1s")
    daemon.send("app@sender.test", ["bob@example.org"], BODY, rcpt_options=["NOTIFY=DELAY,FAILURE"])
    (notice,) = wait_for(lambda: world.home.messages, timeout=15, what="the delay notice")
    _, groups = dsn_parts(notice)
    assert groups[1]["Action"] == "delayed" and groups[1]["Will-Retry-Until"]
    assert groups[1]["Status"].startswith("4.")
    time.sleep(5)  # more retries, but only one notice
    assert len(world.home.messages) == 1


def test_starttls_used_when_offered(start_daemon, tmp_path):
    from smtp_peer import self_signed_context

    with MailNet(["127.0.0.5"], starttls=self_signed_context(tmp_path)) as net:
        (secure,) = net.peers
        net.add_domain("tls.test", "127.0.0.5")
        daemon = start_daemon(*net.daemon_overrides(), *FAST)
        daemon.send("app@sender.test", ["t@tls.test"], BODY)
        (received,) = wait_for(lambda: secure.messages)
        assert received.tls


def test_failed_tls_handshake_falls_back_to_clear_text(start_daemon, tmp_path):
    import ssl

    from smtp_peer import self_signed_cert

    cert, key = self_signed_cert(tmp_path)
    picky = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    picky.load_cert_chain(cert, key)
    picky.verify_mode = ssl.CERT_REQUIRED  # wants a client certificate: our handshake fails
    picky.load_verify_locations(cert)
    with MailNet(["127.0.0.6"], starttls=picky) as net:
        (peer,) = net.peers
        net.add_domain("picky.test", "127.0.0.6")
        daemon = start_daemon(*net.daemon_overrides(), *FAST)
        daemon.send("app@sender.test", ["p@picky.test"], BODY)
        (received,) = wait_for(lambda: peer.messages, what="delivery in clear text")
        assert not received.tls and peer.connections == 2


def test_show_lists_the_attempt_history(world):
    world.mx1.on("rcpt", "451 4.3.0 busy", times=1)
    world.mx2.refuse_connections()
    daemon = world.daemon('retry.schedule=["1s"]', 'retry.then=["60s", "60s"]')
    world.mx1.on("data_end", "451 4.3.0 still busy", times=1)
    queue_id = daemon.send("app@sender.test", ["h@example.org"], BODY)
    wait_for(lambda: len(events(daemon, "delivery")) == 2, what="two attempts")
    shown = daemon.ctl("show", queue_id, "--json")
    (rcpt,) = json.loads(shown.stdout)["recipients"]
    history = rcpt["history"]
    assert [a["reply"] for a in history] == ["451 4.3.0 busy", "451 4.3.0 still busy"]
    assert all(a["mx"] == "mx1.example.org" and a["outcome"] == "transient" for a in history)
    human = daemon.ctl("show", queue_id).stdout
    assert human.count("\n  attempt ") == 2 and "still busy" in human
