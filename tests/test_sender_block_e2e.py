"""A site that refuses our address (a block list, our reputation): the mail stays ours,
the destination pauses, an operator is told (daemon, test DNS, scriptable peers)."""

from __future__ import annotations

import time

import pytest
from e2e_helpers import BODY, FAST, MailNet, ctl_json, events, wait_for

# Spamhaus-style refusal as Postfix's postscreen/smtpd write it, at MAIL FROM.
LISTED = (
    "554 5.7.1 Service unavailable; Client host [127.0.0.1] blocked using zen.spamhaus.org;"
    " https://www.spamhaus.org/query/ip/127.0.0.1"
)
FAST_ALERTS = ("alerts.interval=0.5s", "shaping.release_spread=1s")


@pytest.fixture
def net():
    with MailNet(["127.0.0.2", "127.0.0.9"]) as mail:
        mail.add_domain("example.org", "127.0.0.2", host="mx.provider.test")
        mail.add_domain("sender.test", "127.0.0.9")  # where DSNs would go
        yield mail


def listed(net, start_daemon, *overrides: str):
    """The provider refuses our address at MAIL FROM; a daemon with `overrides`."""
    mx, home = net.peers
    mx.on("mail", LISTED)
    return mx, home, start_daemon(*net.daemon_overrides(), *FAST, *overrides)


def mails(peer) -> int:
    return sum(1 for entry in peer.log if entry.phase == "mail")


def test_a_5xx_about_us_at_mail_keeps_every_message_and_pauses(net, start_daemon):
    mx, home, daemon = listed(net, start_daemon, *FAST_ALERTS)
    ids = [
        daemon.send("app@sender.test", [f"a{i}@example.org", f"b{i}@example.org"], BODY)
        for i in range(6)
    ]
    [blocked] = wait_for(lambda: events(daemon, "sender_blocked"), what="sender_blocked")
    assert blocked["reply"].startswith("554 5.7.1 Service unavailable")
    assert "example.org" in blocked["domains"] and blocked["until"] > time.time() + 1500
    time.sleep(2)  # what else would happen, happens now
    queue = daemon.messages()
    assert set(ids) <= set(queue)  # every message is kept
    states = {r["state"] for i in ids for r in queue[i]["recipients"]}
    assert states <= {"queued", "deferred"}  # no recipient bounced
    assert not events(daemon, "suppressed") and ctl_json(daemon, "suppress", "list") == []
    assert not home.messages  # no DSN to the senders
    assert mails(mx) <= 2  # the pause stops the rest: in-flight connections only
    [entry] = [d for d in ctl_json(daemon, "domains") if "example.org" in d["domains"]]
    assert entry["circuit"] == "open" and entry["blocked_by"].startswith("554 5.7.1")
    alert = wait_for(
        lambda: [
            e
            for e in events(daemon, "alert")
            if e["name"] == "sender_blocked" and e["state"] == "firing"
        ],
        what="the sender_blocked alert",
    )
    assert alert[0]["subject"] == entry["destination"]

    # Delisted: a flush lifts the pause behind one probe, and everything goes.
    mx.on("mail", None)
    assert ctl_json(daemon, "flush", "--all") == [{"flushed": 6}]
    wait_for(lambda: not daemon.messages(), timeout=20, what="the queue to drain")
    assert len(mx.messages) == 6
    wait_for(
        lambda: [e for e in events(daemon, "alert") if e["state"] == "cleared"],
        what="the alert to clear",
    )


def test_on_sender_block_hold_puts_the_mail_in_review(net, start_daemon):
    _, home, daemon = listed(net, start_daemon, "classes.p1.on_sender_block=hold")
    queue_id = daemon.send("app@sender.test", ["a@example.org"], BODY)
    wait_for(lambda: events(daemon, "sender_block_held"), what="held")
    message = daemon.messages()[queue_id]
    assert message["held"] and message["recipients"][0]["state"] == "held"
    [review] = ctl_json(daemon, "review")
    assert review["id"] == queue_id and review["reason"] == "sender_block"
    assert not home.messages


def test_on_sender_block_bounce_returns_the_mail_without_suppressing(net, start_daemon):
    _, home, daemon = listed(net, start_daemon, "classes.p1.on_sender_block=bounce")
    queue_id = daemon.send("app@sender.test", ["a@example.org"], BODY)
    wait_for(lambda: queue_id not in daemon.messages(), what="the bounce")
    [dsn] = wait_for(lambda: list(home.messages), what="the DSN")
    assert "zen.spamhaus.org" in dsn.content.decode(errors="replace")
    assert ctl_json(daemon, "suppress", "list") == []


def test_mail_paused_for_a_block_still_expires_with_a_dsn_that_says_why(net, start_daemon):
    _, home, daemon = listed(net, start_daemon, "classes.p1.lifetime=4s")
    first = daemon.send("app@sender.test", ["a@example.org"], BODY)
    wait_for(lambda: events(daemon, "sender_blocked"), what="the pause")
    # Sent during the pause: never attempted, yet its lifetime ends all the same (the
    # expiry sweep runs every 30 s, whatever the mail waits for).
    second = daemon.send("app@sender.test", ["b@example.org"], BODY)
    wait_for(lambda: not {first, second} & set(daemon.messages()), timeout=45, what="expiry")
    dsns = wait_for(lambda: home.messages if len(home.messages) == 2 else None, what="2 DSNs")
    texts = [m.content.decode(errors="replace") for m in dsns]
    assert any("zen.spamhaus.org" in text for text in texts)  # the reply that held it
    assert ctl_json(daemon, "suppress", "list") == []
