"""`mtaqueue-ctl domains`: every destination with waiting mail, and what the text shows."""

from __future__ import annotations

import io

from mtaqueue import config
from mtaqueue.control.ctl import render
from mtaqueue.delivery.destination import Destination, DestinationsView
from mtaqueue.model import DEFERRED, DELIVERED, QUEUED, Message, Recipient
from mtaqueue.policy.replies import Reply
from mtaqueue.policy.shaper import DestinationShaper
from mtaqueue.routing.relays import relays

NOW = 1_800_000_000.0
CLASSES = {"p0": (0, 1), "p1": (1, 4), "p2": (2, 1)}


def destinations_view(live, messages, busy) -> list[dict]:
    view = DestinationsView(live, busy)
    for msg in messages:
        view.add(msg)
    return view.entries()


def message(queue_id: str, *rcpts: Recipient, klass: str = "p1", held: bool = False) -> Message:
    return Message(queue_id, "app@sender.test", rcpts, NOW - 60, 100, klass, held=held)


def deferred(address: str, reply: str | None = None, at: float | None = None) -> Recipient:
    return Recipient(
        address, state=DEFERRED, next_attempt=NOW + 600, last_reply=reply, last_attempt=at
    )


QUEUED_NONE = dict.fromkeys(CLASSES, 0)


def live(key: str, *domains: str) -> Destination:
    pacing = config.Pacing(messages_per_minute=120)
    d = Destination(key, pacing, DestinationShaper(pacing, config.ShapingConfig(), NOW))
    d.domains.update(domains)
    return d


def test_deferred_mail_is_counted_where_it_waits_and_unrouted_mail_is_listed_by_domain():
    mx = live("mx.provider.test", "example.org", "example.net")
    mx.record(NOW - 5, Reply.parse("rcpt", 451, "4.3.0 try later"))
    messages = [
        message("A", deferred("a@example.org"), deferred("b@example.net")),  # counts once
        message("B", deferred("c@Example.ORG"), klass="p2"),
        message("C", Recipient("d@example.org", state=QUEUED)),  # in transit: not deferred
        message("D", deferred("e@example.org"), held=True),  # held: not waiting on delivery
        message("E", Recipient("f@example.org", state=DELIVERED)),
        # After a restart no destination has routed these yet.
        message("F", deferred("g@other.test", "451 4.7.1 greylisted", NOW - 20)),
        message("G", deferred("h@other.test", "421 4.4.2 timeout", NOW - 10)),
    ]
    view = destinations_view(
        [mx.snapshot(NOW, {}, QUEUED_NONE, 0)], messages, {"C": {0}, "A": set()}
    )
    assert [d["destination"] for d in view] == ["mx.provider.test", "other.test"]
    provider, other = view
    assert provider["routed"] is True and provider["deferred"] == {"p1": 1, "p2": 1}
    assert provider["last_replies"] == ["451 4.3.0 try later"]
    assert other == {
        "destination": "other.test",
        "routed": False,
        "domains": ["other.test"],
        "queued": {},
        "deferred": {"p1": 2},
        "active": 0,
        "last_replies": ["451 4.7.1 greylisted", "421 4.4.2 timeout"],  # oldest first
    }


def test_a_live_destination_without_waiting_mail_is_still_shown():
    view = destinations_view(
        [live("mx.a.test", "a.test").snapshot(NOW, {}, QUEUED_NONE, 0)], [], {}
    )
    assert [(d["destination"], d["deferred"]) for d in view] == [("mx.a.test", {})]


def test_text_shows_waiting_mail_rates_and_suspended_hosts():
    mx = live("mx.provider.test", "example.org")
    snapshot = mx.snapshot(
        NOW, {"mx.provider.test": NOW + 3600, "mx.elsewhere.test": NOW}, QUEUED_NONE, 0
    )
    [entry] = destinations_view([snapshot], [message("A", deferred("a@example.org"))], {})
    unrouted = {
        "destination": "other.test",
        "routed": False,
        "domains": ["other.test"],
        "queued": {},
        "deferred": {"p2": 3},
        "active": 0,
        "last_replies": ["451 4.7.1 greylisted"],
    }
    out = io.StringIO()
    render.show_domains([entry, unrouted], out)
    text = out.getvalue()
    assert "mx.provider.test  (example.org)\n" in text
    assert "  deferred    p1 1   (messages waiting to retry)\n" in text
    assert "  queued      none   (messages ready to go)\n" in text
    assert "  rates       120/min messages, unlimited connections\n" in text
    assert f"  suspended   mx.provider.test until {render.time(NOW + 3600)}\n" in text
    assert "mx.elsewhere.test" not in text  # another destination's host
    assert "  mode        normal   circuit closed\n" in text
    assert "other.test  (other.test)\n  queued      none" in text
    assert "  deferred    p2 3   (messages waiting to retry)\n" in text
    assert "  state       none: not routed since the start\n" in text
    assert "  last        451 4.7.1 greylisted\n" in text


def test_a_smarthosts_mail_waits_there_and_it_owns_no_domain():
    esp = "relay:tx@smtp.esp.example:587"
    mx = live("mx.provider.test", "example.org")
    smarthost = live(esp, "example.org")  # it carried p0 mail for example.org too
    smarthost.relay = relays(
        config.load(None, ["classes.p0.relayhost=[smtp.esp.example]:587"])
    ).classes["p0"]
    messages = [
        message("A", deferred("a@example.org"), deferred("b@other.test"), klass="p0"),
        message("B", deferred("c@example.org")),
    ]
    snapshots = [d.snapshot(NOW, {}, QUEUED_NONE, 0) for d in (mx, smarthost)]
    view = DestinationsView(snapshots, {}, lambda m: esp if m.klass == "p0" else None)
    for msg in messages:
        view.add(msg)
    deferred_at = {d["destination"]: d["deferred"] for d in view.entries()}
    assert deferred_at == {esp: {"p0": 1}, "mx.provider.test": {"p1": 1}}
    assert {d["destination"]: d["relay"] for d in snapshots} == {
        "mx.provider.test": None,
        esp: "classes.p0",
    }
