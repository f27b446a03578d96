"""Prometheus metrics (mtaqueue.metrics), scraped through the real HTTP endpoint with a real
HTTP client and read back with prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
from loop_ticks import ticks_during
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from mtaqueue import config
from mtaqueue.delivery.destination import Destination
from mtaqueue.metrics import OTHER, Metrics, Sources, serve
from mtaqueue.model import (
    DEFERRED,
    DELIVERED,
    HELD_AT_EXPIRY,
    HELD_BY_OPERATOR,
    HELD_BY_REVALIDATION,
    QUEUED,
    Message,
    Recipient,
)
from mtaqueue.policy.backoff import RetryPolicy
from mtaqueue.policy.classify import classify
from mtaqueue.policy.replies import Reply
from mtaqueue.policy.settle import Result, SettleSettings, settle
from mtaqueue.policy.shaper import DestinationShaper
from mtaqueue.routing.relays import relays
from mtaqueue.spool import walk

CONF = Path(__file__).resolve().parent.parent / "conf"
NOW = 1_000_000.0
GMAIL = "gmail-smtp-in.l.google.com"
CLASSES = {"p0": (0, 1), "p1": (1, 4), "p2": (2, 1)}


class State:
    """What the sources read: changed by the tests between scrapes."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.destinations: list[tuple[Destination, int]] = []  # and its connections
        self.alerts: list[tuple[str, str]] = []
        self.dns = (0, 0)
        self.scheduled = {"accepted": 0, "retry": 0}

    def metrics(self, top_n: int = 20, relay_of=lambda message: None) -> Metrics:
        sources = Sources(
            queue=lambda: {m.id: m for m in self.messages},
            classes=lambda: CLASSES,
            destinations=lambda: [
                d.snapshot(NOW, {}, dict.fromkeys(CLASSES, 0), active)
                for d, active in self.destinations
            ],
            dns=lambda: self.dns,
            free_bytes=lambda: 5 * 2**30,
            journal_bytes=lambda: 12345,
            alerts=lambda: self.alerts,
            relay_of=relay_of,
            scheduled=lambda: self.scheduled,
            processes=lambda: {"daemon": os.getpid()},
            memory=lambda: {"idempotency_keys": 3},
        )
        return Metrics(sources, top_n=top_n, clock=lambda: NOW)


def message(queue_id, klass, age, *rcpts, held=False) -> Message:
    recipients = tuple(Recipient(address, state=state) for address, state in rcpts)
    return Message(queue_id, "app@example.com", recipients, NOW - age, 100, klass, held=held)


def destination(key: str, *domains: str, active: int = 0) -> tuple[Destination, int]:
    pacing = config.Pacing()
    d = Destination(key, pacing, DestinationShaper(pacing, config.ShapingConfig(), NOW))
    d.domains.update(domains)
    return d, active


def delivery_event(msg: Message, index: int, phase: str, code: int, text: str, dest: str) -> dict:
    """The `delivery` event settle() logs, with the fields the daemon adds for metrics."""
    retry = RetryPolicy.from_config(config.RetryConfig())
    settings = SettleSettings(retry, 86400.0, "bounce", 14400.0, False)
    reply = Reply.parse(phase, code, text) if code else Reply(phase, 0, network=text)
    result = Result(index, reply, classify(reply), "mx.example")
    [event] = settle(msg, [result], NOW, random.Random(1), settings).events
    return event | {"destination": dest, "class": msg.klass}


def scrape(metrics: Metrics, path: str = "/metrics") -> tuple[int, str, bytes]:
    """(status, content type, body) of a GET through the real server on loopback."""

    def get(url: str) -> tuple[int, str, bytes]:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status, response.headers["Content-Type"], response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers["Content-Type"], error.read()

    async def run() -> tuple[int, str, bytes]:
        server = await serve(metrics, "127.0.0.1", 0)
        try:
            (address,) = server.addresses
            assert address.startswith("127.0.0.1:")
            return await asyncio.to_thread(get, f"http://{address}{path}")
        finally:
            await server.close()

    return asyncio.run(run())


def samples(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    """Every sample of a scrape: (name, labels) -> value."""
    status, content_type, body = scrape(metrics)
    assert (status, content_type) == (200, CONTENT_TYPE_LATEST)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def value(found: dict, name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


def label_values(found: dict, name: str, label: str) -> set[str]:
    return {dict(labels)[label] for n, labels in found if n == name}


def test_a_scrape_shows_the_queue_the_pacing_and_the_spool():
    state = State()
    state.messages = [
        message("A", "p0", 100, ("a@gmail.com", QUEUED), ("b@Gmail.com", DELIVERED)),
        message("B", "p1", 500, ("c@example.org", QUEUED), held=True),
        message("C", "p2", 50, ("d@example.org", DEFERRED), ("e@googlemail.com", DEFERRED)),
    ]
    state.destinations = [destination(GMAIL, "gmail.com", "googlemail.com", active=2)]
    state.alerts = [("oldest_age", "p0")]
    state.dns = (7, 3)
    state.scheduled = {"accepted": 4, "retry": 2}
    found = samples(state.metrics())

    recipients = {
        (dict(labels)["destination"], dict(labels)["class"], dict(labels)["state"]): v
        for (name, labels), v in found.items()
        if name == "mtaqueue_queue_recipients"
    }
    assert recipients == {
        (GMAIL, "p0", "queued"): 1,
        (GMAIL, "p0", "delivered"): 1,
        (GMAIL, "p2", "deferred"): 1,
        ("example.org", "p1", "held"): 1,  # not routed yet: its domain
        ("example.org", "p2", "deferred"): 1,
    }
    for klass, count, age in (("p0", 1, 100.0), ("p1", 1, 0.0), ("p2", 1, 50.0)):
        assert value(found, "mtaqueue_queue_messages", **{"class": klass}) == count
        # p1's only message is held: nothing of p1 is waiting
        assert value(found, "mtaqueue_queue_oldest_age_seconds", **{"class": klass}) == age
    assert value(found, "mtaqueue_destination_connections", destination=GMAIL) == 2
    assert value(found, "mtaqueue_destination_connection_limit", destination=GMAIL) == 2
    # No rate configured: the learned one, at its slow start (2 a second).
    assert (
        value(found, "mtaqueue_destination_rate_limit_messages_per_second", destination=GMAIL) == 2
    )
    assert value(found, "mtaqueue_destination_backoff_stage", destination=GMAIL) == 0
    circuit = "mtaqueue_destination_circuit_state"
    assert value(found, circuit, destination=GMAIL, state="closed") == 1
    assert value(found, circuit, destination=GMAIL, state="open") == 0
    assert value(found, "mtaqueue_destinations", mode="normal", circuit="closed") == 1
    assert value(found, "mtaqueue_dns_cache_lookups_total", result="hit") == 7
    assert value(found, "mtaqueue_dns_cache_lookups_total", result="miss") == 3
    assert value(found, "mtaqueue_scheduled_total", reason="accepted") == 4
    assert value(found, "mtaqueue_scheduled_total", reason="retry") == 2
    assert value(found, "mtaqueue_spool_free_bytes") == 5 * 2**30
    assert value(found, "mtaqueue_spool_journal_bytes") == 12345
    assert value(found, "mtaqueue_alert_active", alert="oldest_age", subject="p0") == 1


def test_a_smarthost_counts_its_own_mail_and_takes_no_domain_from_the_mx():
    esp = "relay:tx@smtp.esp.example:587"
    relayed = message("A", "p0", 10, ("a@gmail.com", DEFERRED), ("b@example.org", DEFERRED))
    direct = message("B", "p1", 10, ("c@gmail.com", DEFERRED))
    state = State()
    state.messages = [relayed, direct]
    smarthost, _ = destination(esp, "gmail.com", "example.org")  # it carried some of gmail's
    smarthost.relay = relays(
        config.load(None, ["classes.p0.relayhost=[smtp.esp.example]:587"])
    ).classes["p0"]
    state.destinations = [destination(GMAIL, "gmail.com"), (smarthost, 0)]
    metrics = state.metrics(relay_of=lambda m: esp if m.klass == "p0" else None)
    event = delivery_event(relayed, 0, "auth", 535, "5.7.8 Authentication failed", esp)
    metrics.observe_delivery(event | {"relay": "classes.p0"})
    state.destinations = []  # gone: what the events taught is all that routes
    asyncio.run(metrics.refresh())
    depth = {name: d.depth for name, d in metrics.snapshot(NOW).destinations.items()}
    assert depth == {esp: 2, "gmail.com": 1}  # (c@gmail.com: no live MX, its domain)
    state.destinations = [destination(GMAIL, "gmail.com"), (smarthost, 0)]
    depth = {name: d.depth for name, d in metrics.snapshot(NOW).destinations.items()}
    assert depth == {esp: 2, GMAIL: 1}


def test_delivery_attempts_and_latencies_are_counted():
    state = State()
    msg = message("A", "p0", 30, ("a@gmail.com", QUEUED), ("b@gmail.com", QUEUED))
    state.messages = [msg]
    state.destinations = [destination(GMAIL, "gmail.com")]
    metrics = state.metrics()
    samples(metrics)  # ranks the destinations: gmail is in the top N
    metrics.observe_delivery(delivery_event(msg, 0, "data_end", 250, "2.0.0 OK", GMAIL))
    metrics.observe_delivery(
        delivery_event(msg, 1, "rcpt", 450, "4.2.0 Greylisted, try again in 300 seconds", GMAIL)
    )
    metrics.observe_delivery(delivery_event(msg, 1, "connect", 0, "timeout", GMAIL))
    metrics.observe_connect(GMAIL, 0.2)
    metrics.observe_connect(GMAIL, 3.0)
    found = samples(metrics)

    attempts = "mtaqueue_delivery_attempts_total"
    labels = {"destination": GMAIL}
    assert value(found, attempts, **labels, reply="2xx", kind="ok", outcome="delivered") == 1
    greylisted = {"reply": "4xx", "kind": "greylisting", "outcome": "transient"}
    assert value(found, attempts, **labels, **greylisted) == 1
    timeout = {"reply": "none", "kind": "network", "outcome": "transient"}
    assert value(found, attempts, **labels, **timeout) == 1
    latency = "mtaqueue_delivery_latency_seconds"
    assert value(found, f"{latency}_count", **{"class": "p0"}) == 1  # only the delivery
    assert value(found, f"{latency}_sum", **{"class": "p0"}) == 30
    assert value(found, f"{latency}_bucket", **{"class": "p0", "le": "15.0"}) == 0
    assert value(found, f"{latency}_bucket", **{"class": "p0", "le": "60.0"}) == 1
    connect = "mtaqueue_connect_seconds"
    assert value(found, f"{connect}_count", destination=GMAIL) == 2
    assert value(found, f"{connect}_bucket", destination=GMAIL, le="0.25") == 1
    assert value(found, f"{connect}_sum", destination=GMAIL) == pytest.approx(3.2)


def test_destinations_beyond_the_top_n_are_summed_into_other():
    state = State()
    # d01.example has 1 recipient waiting ... d30.example 30.
    state.messages = [
        message(f"M{n}", "p1", 10, *[(f"r{i}@d{n:02}.example", DEFERRED) for i in range(n)])
        for n in range(1, 31)
    ]
    metrics = state.metrics(top_n=5)
    found = samples(metrics)
    names = label_values(found, "mtaqueue_queue_recipients", "destination")
    assert names == {f"d{n}.example" for n in range(26, 31)} | {OTHER}
    other = {"destination": OTHER, "class": "p1", "state": "deferred"}
    assert value(found, "mtaqueue_queue_recipients", **other) == sum(range(1, 26))

    # Counters are bounded the same way, at the time of the attempt.
    top, low = state.messages[29], state.messages[0]
    for msg, dest in ((top, "d30.example"), (low, "d01.example")):
        metrics.observe_delivery(delivery_event(msg, 0, "rcpt", 451, "4.3.0 later", dest))
        metrics.observe_connect(dest, 0.1)
    found = samples(metrics)
    for name in ("mtaqueue_delivery_attempts_total", "mtaqueue_connect_seconds_count"):
        assert label_values(found, name, "destination") == {"d30.example", OTHER}

    # d30 drains and leaves the top 5: its series go, and its next attempt counts as other.
    state.messages = state.messages[:29]
    found = samples(metrics)
    assert "d30.example" not in label_values(
        found, "mtaqueue_delivery_attempts_total", "destination"
    )
    metrics.observe_delivery(delivery_event(top, 0, "rcpt", 451, "4.3.0 later", "d30.example"))
    found = samples(metrics)
    assert label_values(found, "mtaqueue_delivery_attempts_total", "destination") == {OTHER}
    assert (
        value(
            found,
            "mtaqueue_delivery_attempts_total",
            destination=OTHER,
            reply="4xx",
            kind="other",
            outcome="transient",
        )
        == 2
    )


def test_label_sets_stay_bounded_however_many_destinations_and_however_they_change():
    state = State()
    metrics = state.metrics(top_n=5)
    for ranking in (range(1, 101), range(100, 0, -1)):  # then the other way round
        state.messages = [
            message(f"M{n}", "p1", 10, *[(f"r@d{n}.example", DEFERRED)] * depth)
            for n, depth in enumerate(ranking)
        ]
        state.destinations = [destination(f"d{n}.example", f"d{n}.example") for n in range(100)]
        asyncio.run(metrics.refresh())
        metrics.snapshot(NOW)  # ranks
        for n, msg in enumerate(state.messages):
            metrics.observe_delivery(delivery_event(msg, 0, "rcpt", 250, "ok", f"d{n}.example"))
            metrics.observe_connect(f"d{n}.example", 0.1)
        found = samples(metrics)
        for name in {n for n, labels in found if "destination" in dict(labels)}:
            assert len(label_values(found, name, "destination")) <= 5 + 1, name


def test_the_alert_snapshot_has_every_destination_by_name():
    state = State()
    msg = message("A", "p0", 120, ("a@example.net", DEFERRED), ("b@example.net", DEFERRED))
    state.messages = [msg, message("B", "p2", 7200, ("c@gmail.com", QUEUED))]
    state.destinations = [destination(GMAIL, "gmail.com")]
    metrics = state.metrics(top_n=1)
    # example.net's destination is learned from its attempts (no live destination any more).
    metrics.observe_delivery(
        delivery_event(msg, 0, "rcpt", 421, "4.7.0 slow down", "mx.example.net")
    )
    metrics.observe_delivery(delivery_event(msg, 1, "rcpt", 250, "2.1.5 ok", "mx.example.net"))
    asyncio.run(metrics.refresh())
    snapshot = metrics.snapshot(NOW)
    assert snapshot.oldest == {"p0": 120.0, "p2": 7200.0}
    assert snapshot.spool_free == 5 * 2**30
    net = snapshot.destinations["mx.example.net"]
    assert (net.depth, net.attempts, net.deferrals) == (2, 2, 1)
    assert snapshot.destinations[GMAIL].depth == 1


def test_the_review_queue_is_measured_for_alerts_and_scrapes():
    state = State()
    expired = msgspec.structs.replace(
        message("A", "p2", 7200, ("a@example.net", DEFERRED)),
        held=True,
        held_reason=HELD_AT_EXPIRY,
        held_at=NOW - 600,
    )
    unasked = msgspec.structs.replace(
        message("B", "p1", 300, ("b@example.net", DEFERRED)),
        held=True,
        held_reason=HELD_BY_REVALIDATION,
        held_at=NOW - 60,
    )
    by_operator = msgspec.structs.replace(
        message("C", "p2", 9000, ("c@example.net", DEFERRED)),
        held=True,
        held_reason=HELD_BY_OPERATOR,
        held_at=NOW - 9000,
    )  # the operator's own: not in review
    state.messages = [expired, unasked, by_operator, message("D", "p1", 5, ("d@x.net", QUEUED))]
    metrics = state.metrics()
    asyncio.run(metrics.refresh())
    snapshot = metrics.snapshot(NOW)
    assert (snapshot.review_size, snapshot.review_oldest_age) == (2, 600.0)
    found = samples(metrics)
    assert value(found, "mtaqueue_review_messages") == 2
    assert value(found, "mtaqueue_review_oldest_age_seconds") == 600.0
    state.messages = []
    asyncio.run(metrics.refresh())
    assert value(samples(metrics), "mtaqueue_review_oldest_age_seconds") == 0


def test_measuring_a_large_queue_lets_the_event_loop_run(monkeypatch):
    # At a million queued a walk takes seconds: SMTP sessions must go on meanwhile, and a
    # scrape that comes during a walk shares it.
    monkeypatch.setattr(walk, "WALK_CHUNK", 2)
    state = State()
    state.messages = [message(f"M{n}", "p1", n, ("r@example.net", QUEUED)) for n in range(20)]
    metrics = state.metrics()

    async def two_scrapes() -> None:
        await asyncio.gather(metrics.refresh(), metrics.refresh())

    _, ticks = asyncio.run(ticks_during(two_scrapes()))
    assert ticks >= 10
    snapshot = metrics.snapshot(NOW)
    assert snapshot.destinations["example.net"].depth == 20 and snapshot.oldest == {"p1": 19}


def test_anything_but_get_metrics_is_not_found_and_a_failing_source_is_a_500():
    state = State()
    status, _, body = scrape(state.metrics(), "/")
    assert (status, body) == (404, b"not found\n")

    def broken() -> tuple[int, int]:
        raise RuntimeError("resolver gone")

    sources = Sources(dict, list, list, broken, lambda: 0, lambda: 0, list)
    metrics = Metrics(sources)
    status, _, _ = scrape(metrics)
    assert status == 500


def test_the_shipped_rules_and_dashboard_use_only_metrics_we_serve():
    state = State()
    msg = message("A", "p0", 1, ("a@gmail.com", QUEUED))
    state.messages = [msg]
    state.destinations = [destination(GMAIL, "gmail.com")]
    state.alerts = [("oldest_age", "p0")]
    metrics = state.metrics()
    metrics.observe_delivery(delivery_event(msg, 0, "data_end", 250, "2.0.0 OK", GMAIL))
    metrics.observe_connect(GMAIL, 0.1)
    served = {name for name, _ in samples(metrics)}

    yaml = pytest.importorskip("yaml")
    rules = yaml.safe_load((CONF / "prometheus-alerts.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    assert all("alert" in r or "record" in r for g in rules["groups"] for r in g["rules"])
    dashboard = json.loads((CONF / "grafana-dashboard.json").read_text())
    exprs += [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\bmtaqueue_[a-z_]+", expr)}
    assert used, "no metric found in the shipped files"
    assert used <= served, used - served


def test_memory_gauges_show_each_process_and_map_and_forget_gone_routes():
    state = State()
    metrics = state.metrics()
    msg = message("A", "p1", 1, ("a@gmail.com", QUEUED))
    metrics.observe_delivery(delivery_event(msg, 0, "data_end", 250, "2.0.0 OK", GMAIL))
    assert metrics.memory_sizes()["metrics_routes"] == 1
    metrics.forget_gone()  # nothing waits for gmail.com: no scrape, no alerts, still gone
    assert metrics.memory_sizes()["metrics_routes"] == 0
    served = samples(metrics)
    daemon, keys = frozenset({("process", "daemon")}), frozenset({("map", "idempotency_keys")})
    assert served["mtaqueue_process_resident_bytes", daemon] > 0
    assert served["mtaqueue_memory_entries", keys] == 3
    assert served["mtaqueue_process_tasks", frozenset()] >= 0
