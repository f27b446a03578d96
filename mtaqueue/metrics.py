"""Prometheus metrics, and the queue measurements that alerts are judged on.

Events (a delivery attempt, a new connection) are counted as they happen, through calls
from the daemon. State (the queue, each destination's pacing, the spool) is read when it
is scraped, through the `Sources` callables, so a scrape shows the present and nothing has
to be kept in step by hand. The queue is walked a chunk at a time (`refresh`, before each
scrape and alert evaluation), so a large queue never stalls the event loop. The registry
is our own, not prometheus_client's global one.

Label sets stay bounded: the `top_n` destinations by pending recipients (then by attempts)
keep their names and the rest are summed into "other". The ranking is redone each time
the queue is measured (a scrape, an alert evaluation), and an attempt is counted under
the name its destination has at that moment. The trade-off: when a destination drops out
of the top N its counter and histogram series are removed, so they start from zero if it
comes back (rate() reads that as a counter reset) and what it did meanwhile is in "other".
Bounded memory and cardinality, at the cost of exact history per destination, which the
`delivery` log events keep anyway.

A recipient's destination is the scheduler's (its MX host set) when known: from a live
destination, else learned from the latest attempt. Mail not routed yet counts under its
domain.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase

from .alerts import DestinationStats, Snapshot
from .control.views import in_review, recipient_state
from .http_server import HttpServer
from .logs import get_logger
from .memory_gauges import memory_families
from .model import PENDING, Message
from .policy.breaker import CLOSED, HALF_OPEN, OPEN
from .policy.verdict import DELIVERED
from .process_stats import resident_bytes
from .spool.walk import walk

log = get_logger("metrics")

OTHER = "other"
DEFERRALS = ("4xx", "none")  # as the scheduler's deferral rate: no reply counts as a 4xx
CIRCUIT_STATES = (CLOSED, OPEN, HALF_OPEN)
# From arrival to delivery: a good day is seconds, a bad one the retry ladder, up to the
# 5-day lifetime.
DELIVERY_BUCKETS = (1, 5, 15, 60, 300, 900, 1800, 3600, 14400, 43200, 86400, 172800, 432000)
# Connect plus greeting: loopback to a tarpit; the greeting timeout is 5 minutes.
CONNECT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


@dataclass(frozen=True, slots=True)
class Sources:
    """Where the state is read, at scrape time, on the event loop."""

    queue: Callable[[], Mapping[str, Message]]  # id -> message (Spool.messages)
    # Always shown, so an empty class reads 0 rather than nothing (the configured classes)
    classes: Callable[[], Iterable[str]]
    destinations: Callable[[], Iterable[Mapping[str, Any]]]  # DeliveryManager.domains
    dns: Callable[[], tuple[int, int]]  # the DNS cache's (hits, misses)
    free_bytes: Callable[[], int]  # on the spool's file system
    journal_bytes: Callable[[], int]
    alerts: Callable[[], Iterable[tuple[str, str]]]  # firing (alert, subject): Alerts.active
    webhooks: Callable[[], Iterable[Mapping[str, Any]]] = tuple  # events.Dispatcher.view
    # The smarthost a message goes to whole (its class's or tenant's relay key), or None.
    relay_of: Callable[[Message], str | None] = lambda message: None
    # Schedules into the scheduled queue by reason (DeliveryManager.scheduled).
    scheduled: Callable[[], Mapping[str, int]] = dict
    # The listener's sessions, stress (0/1) and sessions shed (Listener.state).
    listener: Callable[[], Mapping[str, int]] = dict
    # Process name -> pid ("daemon", "writer"), and map name -> entries (memory_gauges.py).
    processes: Callable[[], Mapping[str, int]] = dict
    memory: Callable[[], Mapping[str, int]] = dict


@dataclass(slots=True)
class _QueueTally:
    """One walk over the queue: recipients by domain (far fewer keys to route than
    recipients; a smarthost's mail under the smarthost's key instead), messages by class,
    the oldest waiting message by class."""

    by_domain: Tally[tuple[str, str, str]] = field(default_factory=Tally)  # domain, class, state
    messages: Tally[str] = field(default_factory=Tally)  # class -> messages
    # class -> when the oldest message with recipients waiting (not held) arrived
    oldest: dict[str, float] = field(default_factory=dict)
    review: int = 0  # messages in the review queue (control.views.in_review)
    review_since: float = math.inf  # when the one that has waited longest went there

    def add(self, message: Message, relay: str | None = None) -> None:
        klass = message.klass
        self.messages[klass] += 1
        if in_review(message):
            self.review += 1
            self.review_since = min(self.review_since, message.held_at or message.created)
        waiting = False
        for rcpt in message.recipients:
            state = recipient_state(message, rcpt)
            where = relay or rcpt.address.rpartition("@")[2].lower()
            self.by_domain[where, klass, state] += 1
            waiting = waiting or state in PENDING
        if waiting and message.created < self.oldest.get(klass, math.inf):
            self.oldest[klass] = message.created


@dataclass(slots=True)
class _Shape:
    """The queue measured once, by the scheduler's destination names (not bounded)."""

    destinations: list[Mapping[str, Any]]  # the scheduler's snapshots
    queue: _QueueTally
    recipients: Tally[tuple[str, str, str]] = field(default_factory=Tally)  # dest, class, state
    depth: Tally[str] = field(default_factory=Tally)  # destination -> pending recipients


class Metrics:
    def __init__(
        self,
        sources: Sources,
        *,
        top_n: int = 20,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sources = sources
        self.top_n = top_n
        self._clock = clock
        # Our own registry, with this object as its only collector: the event metrics are
        # collected from `collect` too, after the ranking, so a scrape never shows series
        # the ranking has just removed.
        self.registry = CollectorRegistry()
        self._attempts = Counter(
            "mtaqueue_delivery_attempts",
            "Delivery attempts per recipient, by destination, reply class, kind and outcome",
            ("destination", "reply", "kind", "outcome"),
            registry=None,
        )
        self._latency = Histogram(
            "mtaqueue_delivery_latency_seconds",
            "Time from acceptance to delivery of a recipient, by class",
            ("class",),
            buckets=DELIVERY_BUCKETS,
            registry=None,
        )
        self._connect = Histogram(
            "mtaqueue_connect_seconds",
            "TCP connect plus the server's greeting of a new connection, by destination",
            ("destination",),
            buckets=CONNECT_BUCKETS,
            registry=None,
        )
        self._top: frozenset[str] = frozenset()
        # destination label -> the counter/histogram series it has, to remove them together
        self._series: dict[str, set[tuple[MetricWrapperBase, tuple[str, ...]]]] = {}
        self._routes: dict[str, str] = {}  # recipient domain -> destination, from attempts
        self._replies: dict[str, list[int]] = {}  # destination -> [attempts, deferrals]
        self._tally = _QueueTally()  # the last walk's (see refresh)
        self._walking: asyncio.Task[None] | None = None
        self.registry.register(self)

    # -- events ----------------------------------------------------------------------------

    def observe_delivery(self, event: Mapping[str, Any]) -> None:
        """Count a `delivery` event (policy/settle.py) that also has `destination` and
        `class`."""
        destination = event["destination"]
        code = event["code"]
        reply = f"{code // 100}xx" if code else "none"
        if not event.get("relay"):  # a smarthost carries a domain's mail, not all of it
            self._routes[event["domain"]] = destination
        counts = self._replies.setdefault(destination, [0, 0])
        counts[0] += 1
        if reply in DEFERRALS:
            counts[1] += 1
        label = self._label(destination)
        self._add(label, self._attempts, (label, reply, event["kind"], event["outcome"])).inc()
        if event["outcome"] == DELIVERED:
            self._latency.labels(event["class"]).observe(event["age"])

    def observe_connect(self, destination: str, seconds: float) -> None:
        """A new connection's connect plus greeting time."""
        label = self._label(destination)
        self._add(label, self._connect, (label,)).observe(seconds)

    def _label(self, destination: str) -> str:
        return destination if destination in self._top else OTHER

    def _add(self, label: str, metric: MetricWrapperBase, values: tuple[str, ...]) -> Any:
        self._series.setdefault(label, set()).add((metric, values))
        return metric.labels(*values)

    def memory_sizes(self) -> dict[str, int]:
        """The sources' map sizes, with this object's own (routes: recipient domains with
        mail waiting; destinations: those counted for the deferral alerts)."""
        sizes = dict(self.sources.memory())
        sizes["metrics_routes"] = len(self._routes)
        sizes["metrics_destinations"] = len(self._replies)
        return sizes

    # -- state -----------------------------------------------------------------------------

    def snapshot(self, now: float) -> Snapshot:
        """The queue measured for `alerts.Alerts.evaluate`, every destination by name."""
        shape = self._measure()
        names = shape.depth.keys() | self._replies.keys()
        blocked = {d["destination"] for d in shape.destinations if d.get("blocked_by")}
        return Snapshot(
            oldest={klass: now - created for klass, created in shape.queue.oldest.items()},
            destinations={
                name: DestinationStats(
                    shape.depth[name], *self._replies.get(name, (0, 0)), name in blocked
                )
                for name in names | blocked
            },
            spool_free=self.sources.free_bytes(),
            review_size=shape.queue.review,
            review_oldest_age=_review_age(shape.queue, now),
            webhooks={w["name"]: w["oldest_age"] or 0.0 for w in self.sources.webhooks()},
            resident={name: resident_bytes(pid) for name, pid in self.sources.processes().items()},
            queued=len(self.sources.queue()),
        )

    def forget_gone(self) -> None:
        """Forget the routes and destinations nothing refers to any more, without a new
        walk (what a scrape or an alert evaluation does as it measures): for a daemon that
        is neither scraped nor alerting."""
        self._measure()

    def collect(self) -> Iterator[Metric]:
        """Every family, the state read now (the registry calls this on each scrape)."""
        shape = self._measure()
        now = self._clock()
        recipients = GaugeMetricFamily(
            "mtaqueue_queue_recipients",
            "Recipients of queued messages, by destination, class and state",
            labels=("destination", "class", "state"),
        )
        bounded: Tally[tuple[str, str, str]] = Tally()
        for (destination, klass, state), count in shape.recipients.items():
            bounded[self._label(destination), klass, state] += count
        for labels, count in sorted(bounded.items()):
            recipients.add_metric(labels, count)
        yield recipients
        messages = GaugeMetricFamily(
            "mtaqueue_queue_messages", "Messages in the queue, by class", labels=("class",)
        )
        oldest = GaugeMetricFamily(
            "mtaqueue_queue_oldest_age_seconds",
            "Age of the oldest message with recipients waiting (not held), by class",
            labels=("class",),
        )
        for klass in sorted(set(self.sources.classes()) | shape.queue.messages.keys()):
            messages.add_metric((klass,), shape.queue.messages[klass])
            created = shape.queue.oldest.get(klass)
            oldest.add_metric((klass,), 0.0 if created is None else now - created)
        yield messages
        yield oldest
        yield GaugeMetricFamily(
            "mtaqueue_review_messages",
            "Messages held for someone's decision (mtaqueue-ctl review)",
            value=shape.queue.review,
        )
        yield GaugeMetricFamily(
            "mtaqueue_review_oldest_age_seconds",
            "How long the message longest in review has waited there; 0 = none",
            value=_review_age(shape.queue, now),
        )
        yield from self._pacing(shape.destinations)
        hits, misses = self.sources.dns()
        dns = CounterMetricFamily(
            "mtaqueue_dns_cache_lookups", "DNS cache lookups, by result", labels=("result",)
        )
        dns.add_metric(("hit",), hits)
        dns.add_metric(("miss",), misses)
        yield dns
        scheduled = CounterMetricFamily(
            "mtaqueue_scheduled",
            "Messages put (back) into the scheduled queue, by reason (accepted, startup, retry,"
            " wait, warmup, release, operator, recover)",
            labels=("reason",),
        )
        for reason, count in sorted(self.sources.scheduled().items()):
            scheduled.add_metric((reason,), count)
        yield scheduled
        listener = self.sources.listener()
        yield GaugeMetricFamily(
            "mtaqueue_listener_sessions",
            "Open SMTP sessions of the submission listener",
            value=listener.get("sessions", 0),
        )
        yield GaugeMetricFamily(
            "mtaqueue_listener_stress",
            "1 while the listener is under stress (80% of listen.max_connections taken)",
            value=listener.get("stress", 0),
        )
        yield CounterMetricFamily(
            "mtaqueue_listener_shed",
            "Quiet sessions closed so that a newcomer got a slot, under stress",
            value=listener.get("shed", 0),
        )
        yield GaugeMetricFamily(
            "mtaqueue_spool_free_bytes",
            "Free space on the spool's file system",
            value=self.sources.free_bytes(),
        )
        yield GaugeMetricFamily(
            "mtaqueue_spool_journal_bytes",
            "Size of the state journal",
            value=self.sources.journal_bytes(),
        )
        alerts = GaugeMetricFamily(
            "mtaqueue_alert_active", "1 while an alert fires", labels=("alert", "subject")
        )
        for name, subject in sorted(set(self.sources.alerts())):
            alerts.add_metric((name, subject), 1)
        yield alerts
        yield from _webhooks(self.sources.webhooks())
        yield from memory_families(self.sources.processes(), self.memory_sizes())
        for metric in (self._attempts, self._latency, self._connect):
            yield from metric.collect()

    def _pacing(self, destinations: list[Mapping[str, Any]]) -> Iterator[Metric]:
        """Each destination's shaper. Connections and limits sum into "other"; rates and
        states are shown for the top destinations only (a sum of them means nothing), and
        counted over all by mode and circuit state."""
        connections = _per_destination(
            "mtaqueue_destination_connections", "Open delivery connections, by destination"
        )
        limit = _per_destination(
            "mtaqueue_destination_connection_limit", "Adaptive concurrency limit, by destination"
        )
        rate = _per_destination(
            "mtaqueue_destination_rate_limit_messages_per_second",
            "Message rate limit in force, backoff included; 0 = none (top destinations)",
        )
        slowed = _per_destination(
            "mtaqueue_destination_latency_ratio",
            "The last reply-latency round's median over its baseline (top destinations)",
        )
        stage = _per_destination(
            "mtaqueue_destination_backoff_stage",
            "Backoff mode stage, 0 = normal (top destinations)",
        )
        circuit = GaugeMetricFamily(
            "mtaqueue_destination_circuit_state",
            "1 for the circuit breaker's current state (top destinations)",
            labels=("destination", "state"),
        )
        count = GaugeMetricFamily(
            "mtaqueue_destinations",
            "Destinations the scheduler tracks, by backoff mode and circuit state",
            labels=("mode", "circuit"),
        )
        active: Tally[str] = Tally()
        limits: Tally[str] = Tally()
        states: Tally[tuple[str, str]] = Tally()
        for d in destinations:
            name = self._label(d["destination"])
            active[name] += d["active"]
            limits[name] += d["limit"]
            states[d["mode"], d["circuit"]] += 1
            if name != OTHER:
                rate.add_metric((name,), d["messages_per_minute"] / 60)
                stage.add_metric((name,), d["stage"])
                if last := d.get("latency", {}).get("last"):
                    slowed.add_metric((name,), last["ratio"])
                for state in CIRCUIT_STATES:
                    circuit.add_metric((name, state), float(d["circuit"] == state))
        for name in sorted(active):
            connections.add_metric((name,), active[name])
            limit.add_metric((name,), limits[name])
        for labels, n in sorted(states.items()):
            count.add_metric(labels, n)
        yield from (connections, limit, rate, slowed, stage, circuit, count)

    async def refresh(self) -> None:
        """Walk the queue again; scrapes and snapshots read the last walk. At a million
        queued a walk takes seconds, so it yields to the event loop as it goes, and
        callers that come meanwhile share the walk under way."""
        if self._walking is None or self._walking.done():
            self._walking = asyncio.get_running_loop().create_task(self._walk())
        await asyncio.shield(self._walking)

    async def _walk(self) -> None:
        tally = _QueueTally()
        async for message in walk(self.sources.queue()):
            tally.add(message, self.sources.relay_of(message))
        self._tally = tally

    def _measure(self) -> _Shape:
        """Route the last walk's tally; rank the destinations; forget what nothing
        refers to."""
        shape = _Shape(list(self.sources.destinations()), self._tally)
        routes = dict(self._routes)
        for d in shape.destinations:
            for domain in () if d.get("relay") else d["domains"]:
                routes[domain] = d["destination"]
        waiting_domains: set[str] = set()
        for (domain, klass, state), count in shape.queue.by_domain.items():
            destination = routes.get(domain, domain)
            shape.recipients[destination, klass, state] += count
            if state in PENDING:
                shape.depth[destination] += count
                waiting_domains.add(domain)
        self._rank(shape)
        live = {d["destination"] for d in shape.destinations}
        self._routes = {d: n for d, n in self._routes.items() if d in waiting_domains}
        self._replies = {
            name: counts
            for name, counts in self._replies.items()
            if name in self._top or name in live or shape.depth[name]
        }
        return shape

    def _rank(self, shape: _Shape) -> None:
        """The top N by pending recipients; attempts break ties and fill the rest, so a busy
        destination that drains fast keeps its name."""
        names = shape.depth.keys() | self._replies.keys()

        def weight(name: str) -> tuple[int, int, str]:
            return -shape.depth[name], -self._replies.get(name, (0,))[0], name

        top = frozenset(sorted(names, key=weight)[: self.top_n])
        for label in self._top - top:
            for metric, values in self._series.pop(label, ()):
                metric.remove(*values)
        self._top = top


async def serve(metrics: Metrics, host: str, port: int) -> HttpServer:
    """Serve GET /metrics on host:port (anything else is a 404), on the event loop rather
    than prometheus_client's WSGI thread: the sources read the loop's state."""

    async def handle(request: web.Request) -> web.Response:
        if request.method != "GET" or request.path != "/metrics":
            return web.Response(status=404, text="not found\n")
        try:
            await metrics.refresh()
            body = generate_latest(metrics.registry)
        except Exception:  # a failing source must not cost the scraper its answer
            log.exception("metrics_failed")
            return web.Response(status=500, text="failed\n")
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handle)
    return await HttpServer(app).start(host, port)


def _webhooks(rows: Iterable[Mapping[str, Any]]) -> Iterator[Metric]:
    """Each webhook endpoint (events.Dispatcher.view), by its name."""
    families = {
        "backlog": GaugeMetricFamily(
            "mtaqueue_webhook_backlog_events",
            "Events in the log the endpoint has not taken yet",
            labels=("webhook",),
        ),
        "oldest_age": GaugeMetricFamily(
            "mtaqueue_webhook_oldest_event_age_seconds",
            "Age of the oldest event the endpoint has not taken (0: none waiting)",
            labels=("webhook",),
        ),
        "failures": GaugeMetricFamily(
            "mtaqueue_webhook_failures", "Failed POSTs in a row", labels=("webhook",)
        ),
        "sent": CounterMetricFamily(
            "mtaqueue_webhook_events_sent", "Events the endpoint took", labels=("webhook",)
        ),
        "dropped": CounterMetricFamily(
            "mtaqueue_webhook_events_dropped",
            "Events dropped: not taken within max_age",
            labels=("webhook",),
        ),
    }
    for row in rows:
        for key, family in families.items():
            family.add_metric((row["name"],), row[key] or 0)
    yield from families.values()


def _review_age(tally: _QueueTally, now: float) -> float:
    return now - tally.review_since if tally.review else 0.0


def _per_destination(name: str, documentation: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=("destination",))
