"""Revalidation before a late send, expiry that notifies, and the review queue, end to end:
the daemon as a subprocess, a real DNS server and SMTP peers on loopback, and the
application's revalidation endpoint as a real HTTP server in the test (http_endpoint.py)
that checks each request's signature, and its webhook receiver (webhook_receiver.py) for
the events it compensates on.

`example.org` (recipients) has its MX on 127.0.0.2; `sender.test` (where DSNs would go)
on 127.0.0.9. Classes revalidate after 1 s, so a message's first attempt (at once) goes
unchecked and its retry (FAST: 2 s later) is checked: the peer defers each first RCPT.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from e2e_helpers import BODY, FAST, MailNet, events, wait_for
from http_endpoint import HANG, HttpEndpoint
from prometheus_client.parser import text_string_to_metric_families
from webhook_receiver import WebhookReceiver

import mtaqueue

SECRET = "app-shared-secret"


class World(MailNet):
    def __init__(self, start_daemon) -> None:
        super().__init__(["127.0.0.2", "127.0.0.9"])
        self.mx, self.home = self.peers
        self.add_domain("example.org", "127.0.0.2")
        self.add_domain("example.net", "127.0.0.2", host="mx.example.org")
        self.add_domain("sender.test", "127.0.0.9")
        self.endpoint = HttpEndpoint(SECRET).start()
        self.hooks = WebhookReceiver().start()
        self._start_daemon = start_daemon

    def daemon(self, *overrides: str):
        hooks = f'[[webhooks]]\nurl = "{self.hooks.url}"\nsecret = "{self.hooks.secret}"\n'
        return self._start_daemon(
            *self.daemon_overrides(),
            *FAST,
            f'revalidate.url="{self.endpoint.url}"',
            f'revalidate.secret="{SECRET}"',
            "revalidate.timeout=0.5s",
            *overrides,
            config=hooks,
        )

    def defer_first(self, *addresses: str) -> None:
        for address in addresses:
            self.mx.on("rcpt", "451 4.3.0 try again later", times=1, rcpt=address)

    def delivered_to(self, address: str) -> list:
        return [m for m in self.mx.messages if address in m.rcpt_tos]

    def told(self, kind: str, message_id: str) -> list[dict]:
        """The webhook events of `kind` about the message."""
        return [e for e in self.hooks.of(kind) if e["message_id"] == message_id]

    def close(self) -> None:
        self.endpoint.stop()
        self.hooks.stop()
        super().close()


@pytest.fixture
def world(start_daemon):
    with World(start_daemon) as w:
        yield w


def no_dsn(world, daemon) -> None:
    # A DSN is durable before the record of the message it reports ends (Outcomes.apply),
    # so once the message is gone a DSN would have been queued already.
    assert events(daemon, "dsn_queued") == []
    assert world.home.messages == []


def test_a_late_retry_asks_the_application_200_sends_and_410_cancels(world):
    daemon = world.daemon("classes.p1.revalidate_after=1s")
    # keep's three recipients (two domains) come due a little apart (jitter): one check.
    keepers = ["keep@example.org", "keep2@example.org", "keep@example.net"]
    world.defer_first(*keepers, "gone@example.org")
    keep = daemon.send(
        "app@sender.test", keepers, b"X-Mtaqueue-Idempotency-Key: order-42\r\n" + BODY
    )
    gone = daemon.send("app@sender.test", ["gone@example.org"], BODY)
    world.endpoint.answers[gone] = 410  # before its retry, 2 s away

    wait_for(lambda: all(world.delivered_to(k) for k in keepers), what="the revalidated retries")
    wait_for(lambda: not daemon.messages(), what="both messages to leave the queue")
    assert world.delivered_to("gone@example.org") == []  # cancelled, never sent
    no_dsn(world, daemon)

    # Each asked once, before its retry only (the first attempt was young), signed.
    (asked,) = world.endpoint.about(keep)
    assert asked.signed
    # Named as the webhooks are (it was aiohttp's "Python/3.11 aiohttp/..." in the
    # application's access log: bench/revalidation_django.py).
    assert asked.user_agent == f"mtaqueue/{mtaqueue.__version__}"
    assert asked.body["idempotency_key"] == "order-42" and asked.body["class"] == "p1"
    assert asked.body["tenant"] is None and 1.0 <= asked.body["age"] < 10
    retried = [e for e in events(daemon, "delivery") if e["id"] == keep]
    assert [e["outcome"] for e in retried] == ["transient"] * 3 + ["delivered"] * 3
    (asked_gone,) = world.endpoint.about(gone)
    assert asked_gone.signed

    outcomes = {e["id"]: e for e in events(daemon, "revalidated")}
    assert (outcomes[keep]["status"], outcomes[keep]["decision"]) == (200, "send")
    assert (outcomes[gone]["status"], outcomes[gone]["decision"]) == (410, "cancel")
    (removed,) = [e for e in events(daemon, "deleted") if e["id"] == gone]
    assert removed["reason"] == "cancelled by revalidation"
    assert events(daemon, "revalidation_failed") == []
    # What the application hears: the cancel, with its reason.
    (cancelled,) = wait_for(lambda: world.told("cancelled", gone), what="the cancelled event")
    assert cancelled["reason"] == "cancelled by revalidation"
    assert len(wait_for(lambda: world.told("delivered", keep), what="delivered events")) == 3


def test_mail_of_a_class_that_does_not_revalidate_is_not_checked(world):
    daemon = world.daemon("classes.p0.revalidate_after=1s")  # p1 (the default) does not
    world.defer_first("bob@example.org")
    daemon.send("app@sender.test", ["bob@example.org"], BODY)
    wait_for(lambda: world.delivered_to("bob@example.org"), what="the retry")
    assert world.endpoint.requests == []


@pytest.mark.parametrize("on_error", ["send", "hold"])
def test_an_endpoint_that_does_not_answer_in_time_follows_on_error(world, on_error):
    world.endpoint.default = HANG
    world.endpoint.hang_for = 5.0
    daemon = world.daemon("classes.p1.revalidate_after=1s", f"revalidate.on_error={on_error}")
    world.defer_first("bob@example.org")
    queue_id = daemon.send("app@sender.test", ["bob@example.org"], BODY)
    (failed,) = wait_for(lambda: events(daemon, "revalidation_failed"), what="the timeout")
    assert failed["id"] == queue_id and failed["decision"] == on_error
    assert failed["status"] is None and "0.5s" in failed["error"]
    assert failed["seconds"] < 3  # revalidate.timeout, not the endpoint's hang

    if on_error == "send":
        wait_for(lambda: world.delivered_to("bob@example.org"), what="delivery all the same")
        return
    held = wait_for(lambda: daemon.messages()[queue_id]["held"] and daemon.messages()[queue_id])
    assert held["held_reason"] == "revalidation"
    assert held["recipients"][0]["state"] == "held"
    (entry,) = map(json.loads, daemon.ctl("review", "--json").stdout.splitlines())
    assert (entry["id"], entry["reason"]) == (queue_id, "revalidation")
    assert world.delivered_to("bob@example.org") == []
    (told,) = wait_for(lambda: world.told("held", queue_id), what="the held event")
    assert told["reason"] == "revalidation"

    # The application is back: released from review, it is asked again, and goes.
    world.endpoint.default = 200
    assert daemon.ctl("release", "--review").stdout.strip() == "released 1 message"
    wait_for(lambda: world.delivered_to("bob@example.org"), what="delivery after release")
    assert [r.body["message_id"] for r in world.endpoint.requests] == [queue_id, queue_id]
    assert len(world.delivered_to("bob@example.org")) == 1


def scrape(daemon) -> dict[str, float]:
    (address,) = next(e for e in daemon.events if e.get("event") == "metrics_listening")["address"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def test_expiry_notify_sends_no_dsn_and_hold_puts_mail_in_review_with_its_alerts(world):
    world.mx.on("rcpt", "450 4.2.0 Greylisted, try again later")  # every attempt
    daemon = world.daemon(
        "classes.p1.lifetime=1s",
        "classes.p1.expire_action=notify",
        "classes.p2.lifetime=1s",
        "classes.p2.expire_action=hold",
        "metrics.address=127.0.0.1:0",
        "alerts.interval=0.3s",
        'alerts.rules=[{type="review_size", over=0},'
        ' {type="review_oldest_age", name="review_stale", over="1s"}]',
    )
    # Both expire at their first attempt: the retry (the greylist window, 2 s) would pass
    # their 1 s lifetime.
    notified = daemon.send("app@sender.test", ["n@example.org"], BODY)
    review = daemon.send("app@sender.test", ["r@example.org"], b"X-Mtaqueue-Class: p2\r\n" + BODY)

    wait_for(lambda: notified not in daemon.messages(), what="the notify expiry")
    (expired,) = [e for e in events(daemon, "expired") if e["id"] == notified]
    assert expired["action"] == "notify" and expired["last_reply"].startswith("450 4.2.0")
    no_dsn(world, daemon)
    # The application's cue to compensate: the expired event, with the action and reply.
    (told,) = wait_for(lambda: world.told("expired", notified), what="the expired event")
    assert told["action"] == "notify" and (told["code"], told["kind"]) == (450, "greylisting")

    wait_for(lambda: daemon.messages()[review]["held"], what="the hold at expiry")
    (told,) = wait_for(lambda: world.told("held", review), what="the held event")
    assert told["reason"] == "expired"
    (entry,) = map(json.loads, daemon.ctl("review", "--json").stdout.splitlines())
    assert (entry["id"], entry["class"], entry["reason"]) == (review, "p2", "expired")
    (rcpt,) = entry["recipients"]
    assert rcpt["address"] == "r@example.org" and rcpt["attempts"] == 1
    assert rcpt["last_reply"].startswith("450 4.2.0") and rcpt["cause"] == "greylisting"
    text = daemon.ctl("review").stdout
    assert review in text and "cause greylisting: 450 4.2.0" in text
    assert "-- 1 message in review, the longest " in text
    assert daemon.ctl("review", "--class", "p1", "--json").stdout == ""

    alerts = lambda: {e["name"]: e for e in events(daemon, "alert")}  # noqa: E731
    fired = wait_for(lambda: len(alerts()) == 2 and alerts(), what="both review alerts")
    assert fired["review_size"]["state"] == "firing" and fired["review_size"]["value"] == 1
    assert fired["review_stale"]["subject"] == "review"
    samples = scrape(daemon)
    assert samples["mtaqueue_review_messages"] == 1
    assert samples["mtaqueue_review_oldest_age_seconds"] > 1

    # The owner decides: deleted from review (no notice), the alerts clear.
    assert daemon.ctl("delete", "--review").stdout.strip() == "deleted 1 message"
    cleared = wait_for(
        lambda: (
            len(c := [e for e in events(daemon, "alert") if e["state"] == "cleared"]) == 2 and c
        ),
        what="the alerts to clear",
    )
    assert {e["name"] for e in cleared} == {"review_size", "review_stale"}
    assert daemon.messages() == {}
    no_dsn(world, daemon)
