"""Events end to end: the daemon POSTs signed events to a real HTTP receiver.

The receiver (tests/webhook_receiver.py) checks every signature, can fail, and can go
down and come back; mail is delivered to real SMTP peers through the test DNS server.
"""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict

from e2e_helpers import BODY, FAST, MailNet, events, wait_for
from test_metrics_e2e import scrape
from webhook_receiver import WebhookReceiver


def hook_config(receiver: WebhookReceiver, extra: str = "") -> str:
    return (
        f'[[webhooks]]\nurl = "{receiver.url}"\nsecret = "{receiver.secret}"\nname = "app"\n{extra}'
    )


def start(start_daemon, net: MailNet, receiver: WebhookReceiver, extra: str = "", *more: str):
    return start_daemon(*net.daemon_overrides(), *FAST, *more, config=hook_config(receiver, extra))


def by_message(evs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for e in evs:
        out[e["message_id"]].append(e)
    return out


def test_an_application_hears_accepted_deferred_once_delivered_and_bounced(start_daemon):
    with MailNet(["127.0.0.2"]) as net, WebhookReceiver() as receiver:
        net.add_domain("example.org", "127.0.0.2")
        (mx,) = net.peers
        greylisted = "451 4.7.1 Greylisted, please try again later"
        mx.on("rcpt", greylisted, rcpt="bob@example.org", times=2)
        mx.on("rcpt", "550 5.1.1 <gone@example.org>: no such user", rcpt="gone@example.org")
        daemon = start(start_daemon, net, receiver)
        content = b"X-Mtaqueue-Idempotency-Key: order-42\r\n" + BODY
        queue_id = daemon.send("app@sender.test", ["bob@example.org", "gone@example.org"], content)
        wait_for(lambda: receiver.of("delivered"), timeout=30, what="the delivered event")
        evs = [e for e in receiver.events if e["message_id"] == queue_id]
        kinds = [(e["type"], e["recipient"]) for e in evs]
        assert kinds.count(("accepted", "bob@example.org")) == 1
        assert kinds.count(("accepted", "gone@example.org")) == 1
        # Two greylisted attempts, one kind: one "deferred", not one per retry.
        assert kinds.count(("deferred", "bob@example.org")) == 1
        assert ("delivered", "bob@example.org") in kinds
        (bounced,) = [e for e in evs if e["type"] == "bounced"]
        assert bounced["recipient"] == "gone@example.org" and bounced["cause"] == "mailbox"
        assert (bounced["code"], bounced["enhanced"]) == (550, "5.1.1")
        (deferred,) = [e for e in evs if e["type"] == "deferred"]
        assert deferred["kind"] == "greylisting" and deferred["code"] == 451
        assert deferred["next_attempt"] > deferred["time"]
        (delivered,) = [e for e in evs if e["type"] == "delivered"]
        assert delivered["code"] == 250 and delivered["attempt"] == 3
        assert delivered["remote_host"]
        for e in evs:  # the fields every event has, and the receiver's ordering
            assert e["idempotency_key"] == "order-42" and e["class"] == "p1"
            assert e["tenant"] is None and isinstance(e["time"], float)
        assert [e["seq"] for e in evs] == sorted(e["seq"] for e in evs)
        assert len({e["id"] for e in evs}) == len(evs)
        assert receiver.bad_signatures == 0


def test_a_dead_endpoint_keeps_its_backlog_on_disk_and_gets_it_all_after_kill_9(start_daemon):
    with MailNet(["127.0.0.2"]) as net, WebhookReceiver() as receiver:
        net.add_domain("example.org", "127.0.0.2")
        receiver.status = 503
        daemon = start(
            start_daemon,
            net,
            receiver,
            "",
            "metrics.address=127.0.0.1:0",
            "alerts.interval=0.3s",
            'alerts.rules=[{type="webhook_backlog", over="1s"}]',
        )
        ids = [daemon.send("app@sender.test", [f"u{i}@example.org"], BODY) for i in range(30)]
        wait_for(lambda: not daemon.messages(), timeout=30, what="all mail delivered")
        wait_for(lambda: receiver.failed >= 2, what="the endpoint to be tried and fail")
        (row,) = [json.loads(line) for line in daemon.ctl("webhooks", "--json").stdout.splitlines()]
        assert row["name"] == "app" and row["backlog"] >= 60 and row["failures"] >= 2
        assert "503" in row["last_error"]
        samples = scrape(daemon)
        assert samples[("mtaqueue_webhook_backlog_events", (("webhook", "app"),))] >= 60
        assert samples[("mtaqueue_webhook_oldest_event_age_seconds", (("webhook", "app"),))] > 0
        (alert,) = wait_for(lambda: events(daemon, "alert"), what="the backlog alert")
        assert (alert["name"], alert["subject"], alert["state"]) == (
            "webhook_backlog",
            "app",
            "firing",
        )
        # Mail delivery went on while the endpoint failed: nothing waits for it.
        assert len(net.peers[0].messages) == 30
        daemon.kill()
        receiver.status = 200
        daemon.start()
        wait_for(
            lambda: {e["message_id"] for e in receiver.of("delivered")} >= set(ids),
            timeout=40,
            what="every delivered event after the restart",
        )
        seen = by_message(receiver.events)
        for queue_id in ids:
            assert sorted(e["type"] for e in seen[queue_id]) == ["accepted", "delivered"]
        assert receiver.bad_signatures == 0


def test_events_survive_kill_9_while_sending_and_repeat_only_with_their_id(start_daemon):
    with MailNet(["127.0.0.2"]) as net, WebhookReceiver() as receiver:
        net.add_domain("example.org", "127.0.0.2")
        receiver.delay = 0.05  # slow: batches form, and the kill finds some in flight
        daemon = start(start_daemon, net, receiver, "batch_max = 7\n")
        ids = [daemon.send("app@sender.test", [f"k{i}@example.org"], BODY) for i in range(40)]
        wait_for(lambda: len(receiver.events) >= 10, what="some events taken")
        daemon.kill()
        daemon.start()
        wait_for(
            lambda: {e["message_id"] for e in receiver.of("delivered")} >= set(ids),
            timeout=40,
            what="every delivered event",
        )
        assert max(len(body) for body in receiver.requests) > 1  # batched when slow
        assert max(len(body) for body in receiver.requests) <= 7
        # At least once: a repeat is the same event (same id), never a new one.
        ids_of: dict[tuple, set[str]] = defaultdict(set)
        for e in receiver.events:
            ids_of[(e["message_id"], e["type"], e["recipient"])].add(e["id"])
        assert all(len(v) == 1 for v in ids_of.values()), ids_of
        for queue_id in ids:
            assert {t for (m, t, _) in ids_of if m == queue_id} == {"accepted", "delivered"}
        # In order per message: accepted before delivered, as the receiver got them.
        order = [(e["message_id"], e["type"]) for e in receiver.events]
        for queue_id in ids:
            assert order.index((queue_id, "accepted")) < order.index((queue_id, "delivered"))


def test_a_webhook_gets_only_the_types_and_classes_it_asks_for(start_daemon):
    with MailNet(["127.0.0.2"]) as net, WebhookReceiver() as receiver:
        net.add_domain("example.org", "127.0.0.2")
        extra = 'events = ["delivered"]\nclasses = ["p0"]\n'
        daemon = start(start_daemon, net, receiver, extra)
        p0 = daemon.send("app@sender.test", ["a@example.org"], b"X-Mtaqueue-Class: p0\r\n" + BODY)
        daemon.send("app@sender.test", ["b@example.org"], BODY)
        wait_for(lambda: not daemon.messages(), timeout=30, what="both delivered")
        wait_for(lambda: receiver.events, what="the p0 event")
        daemon.stop()  # whatever else was due has been sent by now
        assert [(e["type"], e["message_id"]) for e in receiver.events] == [("delivered", p0)]


def test_a_hard_bounce_and_a_refused_rcpt_are_suppressed_events(start_daemon):
    with MailNet(["127.0.0.2"]) as net, WebhookReceiver() as receiver:
        net.add_domain("example.org", "127.0.0.2")
        net.peers[0].on("rcpt", "550 5.1.1 no such user", rcpt="gone@example.org")
        daemon = start(start_daemon, net, receiver)
        daemon.send("app@sender.test", ["gone@example.org"], BODY)

        def gone() -> list[dict]:
            return [e for e in receiver.of("suppressed") if e["recipient"] == "gone@example.org"]

        wait_for(gone, timeout=30, what="the address suppressed")
        with daemon.smtp() as smtp:
            smtp.mail("app@sender.test")
            code, _ = smtp.rcpt("gone@example.org")
        assert code == 550
        wait_for(lambda: len(gone()) == 2, what="the refusal's event")
        added, refused = gone()
        assert added["message_id"] is None and "refused at RCPT" in refused["reason"]


def test_events_older_than_max_age_are_dropped_and_said_so(start_daemon):
    with MailNet(["127.0.0.2"]) as net, WebhookReceiver() as receiver:
        net.add_domain("example.org", "127.0.0.2")
        receiver.status = 500
        daemon = start(start_daemon, net, receiver, 'max_age = "1s"\n')
        daemon.send("app@sender.test", ["old@example.org"], BODY)
        dropped = wait_for(
            lambda: events(daemon, "webhook_events_dropped"), timeout=30, what="the drop"
        )
        assert dropped[0]["level"] == "error" and dropped[0]["webhook"] == "app"
        receiver.status = 200
        fresh = daemon.send("app@sender.test", ["new@example.org"], BODY)
        wait_for(lambda: receiver.of("delivered"), timeout=30, what="the fresh events")
        assert {e["message_id"] for e in receiver.events} == {fresh}
        (row,) = [json.loads(line) for line in daemon.ctl("webhooks", "--json").stdout.splitlines()]
        assert row["dropped"] >= 1


def test_the_signature_is_what_openssl_computes(start_daemon):
    """The HMAC checked by software we did not write: `openssl dgst -sha256 -hmac`."""
    with MailNet(["127.0.0.2"]) as net, WebhookReceiver() as receiver:
        net.add_domain("example.org", "127.0.0.2")
        daemon = start(start_daemon, net, receiver)
        daemon.send("app@sender.test", ["a@example.org"], BODY)
        wait_for(lambda: receiver.raw, what="a request")
        header, body = receiver.raw[0]
        fields = dict(part.split("=", 1) for part in header.split(","))
        signed = fields["t"].encode() + b"." + body
        out = subprocess.run(
            ["openssl", "dgst", "-sha256", "-hmac", receiver.secret, "-r"],
            input=signed,
            capture_output=True,
            check=True,
        ).stdout.split()[0]
        assert fields["v1"] == out.decode()
        assert json.loads(body)[0]["type"] == "accepted"
