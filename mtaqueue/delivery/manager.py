"""The queue manager: the asyncio driver of the scheduler core (scheduler/core.py).

The core decides: when each message is due, which connection opens and which message
goes on which connection, each permitted by the destination's shaper (policy/shaper.py:
concurrency, rates, backoff mode, circuit breaker) in that one place. This driver does
the I/O it asks for (routing, SMTP through delivery/sender.py, the spool), settles what
each attempt got (policy/settle.py) and tells the core. Data path: a due message's
pending recipients are grouped by next hop, routed (MX lookup), and queued as work items
in their destination (the MX host set). A message whose class or tenant has a smarthost
(routing/relays.py) goes there whole, whatever its recipients' domains: the smarthost is a
destination of its own, paced and broken like any other. Mail of a class or tenant with a
source pool (routing/pools.py) is queued at one of the pool's sources (policy/egress.py's
choice): each (source, destination) is a destination of its own. A source that draws a
blocklist reply leaves that destination's share of the pool, its waiting mail and the
refused recipients going to the others at once; a site that refuses our IPv6 gets IPv4
from then on. A source warming up (policy/warmup.py) takes a destination's mail up to
the day's allowance; over it, mail goes to the pool's others or waits for the next day.
Mail that waits for pacing or warm-up is not charged an attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from .. import config
from ..dsn import DsnParams
from ..dsn import notice as dsn_notice
from ..events.derive import DONE
from ..logs import get_logger
from ..model import (
    DEFERRED,
    HELD_BY_ERROR,
    HELD_BY_OPERATOR,
    HELD_BY_REVALIDATION,
    QUEUED,
    Message,
    with_hold,
    without_hold,
)
from ..policy import rate_learner, warmup
from ..policy.backoff import RetryPolicy, restart_due
from ..policy.breaker import CLOSED
from ..policy.buckets import TokenBucket
from ..policy.classify import AUTH, BLOCKLIST, DELIVERED, IPV6, TLS, TRANSIENT, compile_rules
from ..policy.egress import EgressState
from ..policy.fairness import class_order
from ..policy.hosts import HostSuspensions
from ..policy.replies import Reply
from ..policy.revalidate import CANCEL, HOLD
from ..policy.settle import (
    THROTTLE_REQUEUES,
    Result,
    Settlement,
    SettleSettings,
    bounce_now,
    expire_due,
    flushed,
    settle,
    throttle_refused,
)
from ..policy.shaper import DestinationShaper, ShaperState, pacing_for, stated_rate
from ..routing.nexthop import NextHop, next_hop
from ..routing.pools import Pool, Pools, Source, family_of
from ..routing.relays import Relay, relays, unrouted
from ..routing.resolver import Resolver, Route, RouteFailure
from ..scheduler.actions import Action, Close, Connect, Dispatch, GiveUp, Release, Send, Wake
from ..scheduler.core import Scheduler
from ..smtp.addresses import domain_of
from ..smtp.client import ClientSettings, SmtpConnection
from ..spool import statefile
from ..spool.message_file import CorruptMessageFile
from ..spool.store import Spool, StorageError, StorageFull
from ..spool.walk import WALK_CHUNK, chunks, walk
from . import smarthosts
from .destination import Destination, DestinationsView, WorkItem, destination_key, sourced
from .mta_sts import Policies, restricted, tls_context
from .revalidation import Revalidation
from .sender import Sender, Suspended
from .tls_reports import TlsReports

log = get_logger("delivery")

EXPIRY_CHECK = 30.0  # seconds between sweeps for mail whose lifetime has passed
RECOVER_AFTER = 60.0  # retry delay after an unexpected error (a bug): not an attempt...
UNCHARGED_WAITS = 1  # ... once: a repeated internal wait counts as an attempt
DSN_RETRY = 5.0  # seconds between tries to store a DSN the spool refused (a full disk)
PENDING = (QUEUED, DEFERRED)
# Messages active at once (routed, queued at a destination or in transit) up to which the
# overdue mail found at start is let into the scheduler (Postfix: 20,000 as well).
ACTIVE_LIMIT = 20_000
RELEASE_POLL = 0.1  # seconds between looks for room in the active window
# A batch of due mail, by where it goes: a next hop, and the smarthost it is (or None).
Hop = tuple[NextHop, Relay | None]


@dataclass(slots=True)
class _Link:
    """The driver's side of one of the core's connection slots."""

    destination: Destination
    item: WorkItem | None  # in a connect or a transaction; None while idle
    candidates: list[tuple[str, str]]  # (host, address) in order
    tried: int = 0  # of the candidates
    conn: SmtpConnection | None = None
    failures: list[Result] = field(default_factory=list)  # of the connects that failed


class DeliveryManager:
    def __init__(
        self,
        cfg: config.Config,
        spool: Spool,
        resolver: Resolver,
        hostname: str,
        rng: random.Random | None = None,
    ) -> None:
        self.spool = spool
        self.resolver = resolver
        self.hostname = hostname
        self.rng = rng or random.Random()
        d = cfg.delivery
        self.hosts = HostSuspensions(d.host_suspend, d.host_suspend_max)
        self.destinations: dict[str, Destination] = {}
        self.egress = EgressState()  # sources out by destination, IPv4-only destinations
        self._egress_saved = b""
        self.core: Scheduler[WorkItem] | None = None
        self.on_delivery: Callable[[dict], None] | None = None  # each "delivery" event
        self.on_connect: Callable[[str, float], None] | None = None  # destination, seconds
        # DKIM for our own notices: (record, content) -> the record and content to store
        self.sign_notice: Callable[[Message, bytes], tuple[Message, bytes]] | None = None
        self.revalidation = Revalidation(cfg, self._revalidated)
        self._started = False  # not started (delivery.enabled = false): nothing to save
        self.policies: Policies | None = None  # MTA-STS, made by reconfigure
        self.tls_reports: TlsReports | None = None  # TLS-RPT, made by reconfigure
        self.reconfigure(cfg)
        self._overrides: dict[str, Callable[[DestinationShaper, float], None]] = {}
        self._links: dict[int, _Link] = {}  # the core's slots, by connection id
        self._timer: asyncio.TimerHandle | None = None
        self._busy: dict[str, set[int]] = {}  # message id -> recipients routed/queued/in transit
        self._admitted: set[str] = set()  # overdue at start, let in, not yet dispatched
        # Due, waiting for room in the active window (a flush of a million, or a million
        # retries due at once), the first class in its own line ahead of the rest.
        self._overdue: tuple[deque[str], deque[str]] = (deque(), deque())
        self._overdue_drain: asyncio.Future | None = None
        self._waits: dict[str, int] = {}  # message id -> internal waits since its last attempt
        self._refusals: dict[str, int] = {}  # message id -> throttle refusals in a row
        # base -> {message id: until}: mail waiting for the next day's warm-up allowance
        # there, released at once when an operator finishes a ramp of that destination.
        self._warm_waits: dict[str, dict[str, float]] = {}
        # base -> when its waiting mail comes back: one time a destination (spread over
        # destinations, not over its messages), so it comes back together and in the order
        # it began to wait, oldest first, for the day's allowance.
        self._warm_wake: dict[str, float] = {}
        # message id -> the journaling of its record, waiting for its DSNs to be durable
        self._noticing: dict[str, asyncio.Future] = {}
        self._tasks: set[asyncio.Future] = set()
        self._closing = False
        # What destinations taught (rate_learner.Learned by destination key): loaded at
        # start, given to each destination when it appears, saved every EXPIRY_CHECK.
        self._learned: dict[str, rate_learner.Learned] = {}
        self._saved = b""

    def reconfigure(self, cfg: config.Config) -> None:
        """Take new settings (start, or a reload): may raise ConfigError before changing
        anything. Destinations keep their state unless their pacing changed."""
        d = cfg.delivery
        rules = compile_rules(d.rules)
        self.revalidation.reconfigure(cfg)
        routes = relays(cfg)
        secrets = smarthosts.load(routes)  # passwords and CA files, read again at each reload
        sts_context = tls_context(cfg.mta_sts)
        now = time.time()
        client = ClientSettings(d.helo_name or self.hostname, d.timeouts, d.tls)
        sts_tls = sts_context if cfg.mta_sts.enabled else None
        self.sender = Sender(client, rules, self.hosts, d, sts_tls)
        if self.policies is None:
            self.policies = Policies(
                cfg.mta_sts, sts_context, self.resolver, self.spool.layout.mta_sts
            )
        else:
            self.policies.reconfigure(cfg.mta_sts, sts_context)
        if self.tls_reports is None:
            self.tls_reports = TlsReports(
                cfg,
                sts_context,
                self.resolver,
                self.spool.layout.tls_reports,
                self.hostname,
                self._queue_report,
                self.spool.ids.next,
            )
        else:
            self.tls_reports.reconfigure(cfg, sts_context)
        self.sender.on_tls = self.policies.on_failure = self.tls_reports.record
        self.classes = {name: (c.priority, c.weight) for name, c in cfg.classes.items()}
        order = class_order({n: c.priority for n, c in cfg.classes.items()})
        self.first_class = order[0]
        self.class_rank = {name: rank for rank, name in enumerate(order)}
        self.settle_settings = {
            name: SettleSettings(
                retry=RetryPolicy.from_config(cfg.retry, first_class=name == self.first_class),
                lifetime=c.lifetime,
                expire_action=c.expire_action,
                delay_after=cfg.dsn.delay_after,
                delay_without_notify=cfg.dsn.delay_without_notify,
            )
            for name, c in cfg.classes.items()
        }
        rate = TokenBucket(config.parse_rate(d.max_rate), 1, now) if d.max_rate else None
        tenant_rate = cfg.shaping.tenant_rate
        tenant_rate = config.parse_rate(tenant_rate) if tenant_rate else 0.0
        self.cfg = cfg
        self.relays = routes
        self.pools = Pools(cfg)
        if self.core is None:
            self.core = Scheduler(
                self.classes,
                max_connections=d.max_connections,
                connection_idle=d.connection_idle,
                rate=rate,
                tenant_rate=tenant_rate,
            )
        else:
            core = self.core
            core.configure(
                max_connections=d.max_connections,
                connection_idle=d.connection_idle,
                rate=rate,
                tenant_rate=tenant_rate,
            )
            if core.classes != self.classes:
                core.reclassify(self.classes)
        by_key = self._relays_by_key = routes.by_key()
        for destination in self.destinations.values():
            fresh = False
            if destination.relay is not None and destination.key in by_key:
                # A smarthost no longer named keeps its settings for the mail queued there.
                smarthost = secrets[destination.key]
                fresh = smarthost != destination.smarthost
                destination.relay, destination.smarthost = by_key[destination.key], smarthost
                if fresh:
                    log.info("relay_reconfigured", destination=destination.key)
            self._repace(destination, now, fresh=fresh)
        self._smarthosts = secrets
        if self._started:  # a reload: what new pacing (or a fresh smarthost) allows goes now
            self._act(self._core.tick(now))

    def _repace(self, destination: Destination, now: float, fresh: bool = False) -> None:
        """Apply reloaded pacing and classes to a live destination; `fresh`: its state
        starts over too, what it learned aside (a smarthost's new password or TLS settings
        deserve an attempt now, not after the breaker's cooldown)."""
        domain = self._domain_of(destination)
        pacing = pacing_for(self.cfg.shaping, domain, destination.hosts)
        if pacing != destination.pacing or fresh:
            destination.pacing = pacing
            learned = destination.shaper.learned()
            destination.shaper = DestinationShaper(
                pacing,
                self.cfg.shaping,
                now,
                learned,
                stated_rate=stated_rate(self.cfg.shaping, domain, destination.hosts),
            )
            self._core.add_destination(destination.key, destination.shaper, pacing)

    @staticmethod
    def _domain_of(destination: Destination) -> str:
        """The domain its pacing rules match on: none for a smarthost (a rule for
        gmail.com paces Gmail's MX, not an ESP that carries some of that mail)."""
        if destination.relay is not None:
            return ""
        return min(destination.domains) if destination.domains else destination.key

    @property
    def _sts(self) -> Policies:
        assert self.policies is not None  # made by reconfigure in __init__
        return self.policies

    @property
    def _reports(self) -> TlsReports:
        assert self.tls_reports is not None  # made by reconfigure in __init__
        return self.tls_reports

    @property
    def _core(self) -> Scheduler[WorkItem]:
        assert self.core is not None  # made by reconfigure in __init__
        return self.core

    def _settings(self, klass: str) -> SettleSettings:
        # A class removed by a reload: its queued mail follows the default class.
        return (
            self.settle_settings.get(klass)
            or self.settle_settings[self.cfg.submission.default_class]
        )

    # -- life ------------------------------------------------------------------------

    def start(self) -> None:
        """Schedule the queue and run. Due times survive restarts; mail that became due
        meanwhile is let in as the active window has room, the first class (p0) first,
        and spread over retry.restart_spread, except the first class."""
        self._learned = self._load_learned()
        self._load_egress()
        self._sts.load()
        self._reports.load()
        self._started = True
        self._spawn(self._schedule_queue(list(self.spool.messages), time.time()))
        self._spawn(self._expiry_sweep())
        self._spawn(self._reports.run())

    async def _schedule_queue(self, message_ids: list[str], now: float) -> None:
        """Schedule the queue found at start, a chunk at a time: a million messages take
        seconds to read, and neither the listener nor the first deliveries (of the first
        chunks) wait for the rest. Mail not yet due waits in the core's heap; overdue
        mail is released into the active window, the first class first."""
        later: list[str] = []  # overdue, not of the first class: after it
        for chunk in chunks(message_ids):
            for message_id in chunk:
                message = self._read(message_id)
                due = None if message is None else _earliest_due(message)
                if due is None:
                    continue
                if due > now:
                    self._schedule(message_id, due)  # not due yet: it waits in the heap
                elif message.klass == self.first_class:
                    await self._let_in(message_id, due, 0.0)
                else:
                    later.append(message_id)
            await asyncio.sleep(0)
        for message_id in later:
            message = self._read(message_id)  # again: it may have changed meanwhile
            due = None if message is None else _earliest_due(message)
            if due is not None:
                await self._let_in(message_id, due, self.cfg.retry.restart_spread)

    async def _let_in(self, message_id: str, due: float, window: float) -> None:
        """Schedule overdue mail found at start once the active window has room: a
        million overdue messages must not all be routed and queued at destinations at
        once (as Postfix's qmgr_message_active_limit)."""
        while len(self._busy) + len(self._admitted) >= ACTIVE_LIMIT and not self._closing:
            await asyncio.sleep(RELEASE_POLL)
        self._admitted.add(message_id)  # until dispatched
        self._schedule(message_id, restart_due(due, time.time(), window, self.rng))

    async def close(self, grace: float) -> None:
        """Stop dispatching; let attempts in progress finish for up to `grace` seconds."""
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
        for link in self._links.values():  # idle connections go now
            if link.conn is not None and link.item is None:
                self._spawn(link.conn.quit())
        deadline = time.monotonic() + grace
        while self._in_transit() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.revalidation.close()
        await self._sts.close()
        if self._started:
            await self._reports.close()
            self._save_learned(self._learned_data(time.time()))
            self._save_egress(self.egress.encode(time.time()))

    def on_accepted(self, message: Message) -> None:
        """A new message is durable: due now."""
        self._schedule(message.id, time.time())

    # -- timing ------------------------------------------------------------------------

    def _schedule(self, message_id: str, due: float) -> None:
        if not self._started:  # delivery.enabled = false: the start schedules the queue
            return
        self._act(self._core.schedule(time.time(), message_id, due))

    def _tick(self) -> None:
        self._timer = None
        self._act(self._core.tick(time.time()))

    def _act(self, actions: list[Action]) -> None:
        """Do what the core decided (and what it decides meanwhile, after: its last Wake
        is the one that holds)."""
        actions = list(actions)
        for action in actions:
            if isinstance(action, Wake):
                if self._timer is not None:
                    self._timer.cancel()
                if not self._closing:
                    delay = max(0.0, action.at - time.time())
                    self._timer = asyncio.get_running_loop().call_later(delay, self._tick)
            elif isinstance(action, Dispatch):
                self._dispatch_due(action.message_ids)
            elif isinstance(action, Connect | Send) and self._closing:
                continue  # no new connection or message while stopping
            elif isinstance(action, Connect):
                self._spawn(self._guard(action.conn, action.item, self._open(action)))
            elif isinstance(action, Send):
                work = self._send(action.conn, action.item)
                self._spawn(self._guard(action.conn, action.item, work))
            elif isinstance(action, Close):
                link = self._links.pop(action.conn, None)
                if link is not None and link.conn is not None:
                    self._spawn(link.conn.quit())
                if link is not None:
                    self._retire(link.destination)
            elif isinstance(action, GiveUp):
                actions += self._give_up(action.conn)
            elif isinstance(action, Release):
                self._release(action)

    async def _guard(self, conn: int, item: WorkItem, work) -> None:
        """A bug in the driver must not strand a slot or an item: the slot ends, the item
        is retried later (uncharged once)."""
        try:
            await work
        except Exception as exc:
            log.exception("attempt_failed", id=item.message_id)
            link = self._links.pop(conn, None)
            if link is not None and link.conn is not None:
                link.conn.abort()
            with contextlib.suppress(KeyError):  # the slot may have ended already
                self._act(self._core.abandon(time.time(), conn))
            self._retry_later(item.message_id, item.indexes, exc)

    def _in_transit(self) -> bool:
        return any(link.item is not None for link in self._links.values())

    def _dispatch_due(self, message_ids: tuple[str, ...] | list[str]) -> None:
        """What is due now goes into the active window a chunk at a time, the rest waits
        in line (`_let_through`): a flush of a million must neither route and queue them
        all at once nor hold the event loop while it reads them."""
        if self._admitted:  # let in at start: they hold their room already
            self._route_due([i for i in message_ids if i in self._admitted])
            message_ids = [i for i in message_ids if i not in self._admitted]
        first, rest = self._overdue
        if first or rest or len(message_ids) > min(WALK_CHUNK, self._room()):
            for message_id in message_ids:
                head = self.spool.messages.head(message_id)
                if head is not None:
                    (first if head.klass == self.first_class else rest).append(message_id)
            if self._overdue_drain is None or self._overdue_drain.done():
                self._overdue_drain = self._spawn(self._let_through())
            return
        if message_ids:
            self._route_due(message_ids)

    def _room(self) -> int:
        return ACTIVE_LIMIT - len(self._busy) - len(self._admitted)

    async def _let_through(self) -> None:
        """Dispatch the mail waiting in line as the active window has room."""
        first, rest = self._overdue
        while (first or rest) and not self._closing:
            room = min(WALK_CHUNK, self._room())
            if room <= 0:
                await asyncio.sleep(RELEASE_POLL)
                continue
            line = first or rest
            self._route_due([line.popleft() for _ in range(min(room, len(line)))])
            await asyncio.sleep(0)

    def _route_due(self, message_ids: tuple[str, ...] | list[str]) -> None:
        """Everything due now is routed together: one lookup per next hop, not one per
        message (a restart can make thousands due in the same moment)."""
        now = time.time()
        batch: dict[Hop, list[tuple[Message, list[int]]]] = {}
        for message_id in message_ids:
            try:
                self._dispatch(message_id, now, batch)
            except Exception as exc:  # one bad record must not stop all delivery
                log.exception("dispatch_failed", id=message_id)
                self._busy.pop(message_id, None)
                self._retry_later(message_id, None, exc)
        for (hop, relay), work in batch.items():
            self._spawn(self._route(hop, relay, work))

    async def _expiry_sweep(self) -> None:
        while not self._closing:
            await asyncio.sleep(EXPIRY_CHECK)
            await self.expire(time.time())
            # Destinations whose last waiting mail went without a connection (deleted,
            # bounced, expired) or whose stats window passed are forgotten here.
            for destination in list(self.destinations.values()):
                self._retire(destination)
            data = self._learned_data(time.time())
            if data != self._saved:
                await asyncio.to_thread(self._save_learned, data)
            now = time.time()
            waits = (
                (b, {i: t for i, t in w.items() if t > now}) for b, w in self._warm_waits.items()
            )
            self._warm_waits = {base: ids for base, ids in waits if ids}  # not woken yet
            self._warm_wake = {base: t for base, t in self._warm_wake.items() if t > now}
            egress = self.egress.encode(now)
            if egress != self._egress_saved:
                await asyncio.to_thread(self._save_egress, egress)

    def _load_learned(self) -> dict[str, rate_learner.Learned]:
        try:
            data = statefile.read(self.spool.layout.learned)
            return rate_learner.decode(data) if data else {}
        except (OSError, ValueError) as exc:  # learning starts over: nothing is lost
            log.warning("learned_unreadable", error=str(exc))
            return {}

    def _learned_data(self, now: float) -> bytes:
        """The state file: live destinations' lessons over the remembered ones, without
        those forgotten by now or that taught nothing."""
        live = {key: d.shaper.learned() for key, d in self.destinations.items()}
        learned = {**self._learned, **live}
        self._learned = {
            key: lesson for key, lesson in learned.items() if rate_learner.kept(lesson, now)
        }
        return rate_learner.encode(self._learned)

    def _save_learned(self, data: bytes) -> None:
        if _write_state(self.spool.layout.learned, data, "learned"):
            self._saved = data

    def _load_egress(self) -> None:
        try:
            data = statefile.read(self.spool.layout.egress)
            if data:
                self.egress.restore(data)
                self._egress_saved = data
        except (OSError, ValueError) as exc:  # sources come back early: nothing is lost
            log.warning("egress_unreadable", error=str(exc))

    def _save_egress(self, data: bytes) -> None:
        if _write_state(self.spool.layout.egress, data, "egress"):
            self._egress_saved = data

    def _read(self, message_id: str) -> Message | None:
        """A message for a walk over the queue; None if gone, or if its record does not
        decode (replay checks only a record's head): logged, and left as it is."""
        try:
            return self.spool.messages.get(message_id)
        except msgspec.DecodeError as exc:
            log.error("record_undecodable", id=message_id, error=str(exc))
            return None

    async def expire(self, now: float) -> None:
        """Expire mail whose lifetime has passed, whatever it waits for (pacing included).
        The queue is read a chunk at a time, as at start."""
        due: set[str] = set()
        for chunk in chunks(list(self.spool.messages)):
            for message_id in chunk:
                m = self._read(message_id)
                if m is not None and expire_due(m, now, self._settings(m.klass)) is not None:
                    due.add(message_id)
            await asyncio.sleep(0)
        if not due:
            return
        self._unqueue(lambda item: item.message_id in due)
        for message_id in due:
            message = self.spool.messages.get(message_id)
            if message is None or self._busy.get(message_id):
                continue  # in transit: the next sweep
            settlement = expire_due(message, now, self._settings(message.klass))
            if settlement is not None:
                self._apply(settlement, now)

    # -- dispatch ----------------------------------------------------------------------

    def _dispatch(
        self, message_id: str, now: float, batch: dict[Hop, list[tuple[Message, list[int]]]]
    ) -> None:
        """Add the message's due recipients to `batch`, grouped by next hop: all of them
        to its class's or tenant's smarthost if it has one, else each by its domain."""
        self._admitted.discard(message_id)
        message = self.spool.messages.get(message_id)
        if message is None or message.held or self._closing:
            return
        busy = self._busy.setdefault(message_id, set())
        groups: dict[Hop, list[int]] = {}
        d = self.cfg.delivery
        relay = self.relays.for_message(message.klass, message.tenant)
        for i, rcpt in enumerate(message.recipients):
            if rcpt.state in PENDING and i not in busy and (rcpt.next_attempt or 0) <= now:
                if relay is not None:
                    hop = relay.hop
                else:
                    hop = next_hop(domain_of(rcpt.address), d.relayhost, self.cfg.routes, d.port)
                groups.setdefault((hop, relay), []).append(i)
        if not groups and not busy:
            del self._busy[message_id]
            return
        if groups and self.revalidation.wanted(message, now):
            # Late mail is checked with the application first (policy/revalidate.py): its
            # due recipients are set aside meanwhile, holding no connection slot.
            pending = sorted(i for indexes in groups.values() for i in indexes)
            busy.update(pending)
            self.revalidation.ask(message, pending)
            return
        for where, indexes in groups.items():
            busy.update(indexes)
            batch.setdefault(where, []).append((message, indexes))

    async def _route(
        self, hop: NextHop, relay: Relay | None, work: list[tuple[Message, list[int]]]
    ) -> None:
        failure: Exception | None = None
        route: Route | RouteFailure | None
        plain = None  # own MX hosts: the route before MTA-STS, for our TLS reports
        try:
            if _own_mx(hop, relay, work):  # RFC 8461 is about a domain's own MX hosts
                plain, sts = await asyncio.gather(
                    self.resolver.route(hop), self._sts.applied(hop.host)
                )
                route = restricted(plain, sts)
                if isinstance(route, Route):
                    route = msgspec.structs.replace(route, tls_domain=hop.host)
            else:
                route = await self.resolver.route(hop)
        except Exception as exc:
            log.exception("routing_failed", hop=hop.host)
            route, failure = None, exc
        if relay is not None and isinstance(route, RouteFailure):
            route = unrouted(relay, route)
        # By class, then as they came: a source's warm-up allowance goes to the work queued
        # first, and mail that waited for the next day comes back in one batch.
        rank = self.class_rank
        work.sort(key=lambda entry: rank.get(entry[0].klass, 0))
        for message, indexes in work:
            try:
                if route is None:
                    self._retry_later(message.id, indexes, failure)
                else:
                    # RFC 8460 3: a report is delivered despite TLS failures, uncounted.
                    report = message.tls_report and plain is not None
                    self._queue(message, hop, relay, indexes, plain if report else route)
            except Exception as exc:
                log.exception("routing_failed", id=message.id, hop=hop.host)
                self._retry_later(message.id, indexes, exc)
        self._act(self._core.tick(time.time()))  # the batch is queued: it may go

    def _retry_later(
        self, message_id: str, indexes: list[int] | None, error: Exception | None
    ) -> None:
        """After an unexpected error (a bug): free the recipients and try again later,
        uncharged the first time; a repeat counts as an attempt that failed with it.
        `indexes` None: every pending recipient."""
        if indexes is not None:
            self._unbusy(message_id, indexes)
        message = self.spool.messages.get(message_id)
        if message is None:
            return
        if indexes is None:
            indexes = [i for i, r in enumerate(message.recipients) if r.state in PENDING]
        if self._uncharged_wait(message_id):
            self._schedule(message_id, time.time() + RECOVER_AFTER)
            return
        reply = Reply("dns", 0, "", f"local error: {type(error).__name__}: {error}", "local")
        self._charge(message_id, indexes, reply, destination="")

    def waiting_for(self, message_id: str) -> dict[str, Any] | None:
        """Why a message its record shows as ready waits, for `mtaqueue-ctl list/show`:
        over a source's warm-up allowance of the day (no attempt is charged for it)."""
        now = time.time()
        for base, ids in self._warm_waits.items():
            until = ids.get(message_id)
            if until is not None and until > now:
                return {"reason": "warmup", "destination": base, "until": until}
        return None

    def _uncharged_wait(self, message_id: str) -> bool:
        """Count an internal wait (every host suspended, an unexpected error): whether it
        may go uncharged. A repeat may not: a wait that can come back for ever would hold a
        message with no attempt and no reason until it expires."""
        waits = self._waits.get(message_id, 0) + 1
        self._waits[message_id] = waits
        return waits <= UNCHARGED_WAITS

    def _queue(
        self,
        message: Message,
        hop: NextHop,
        relay: Relay | None,
        indexes: list[int],
        route: Route | RouteFailure,
    ) -> None:
        if isinstance(route, RouteFailure):
            reply = Reply("dns", 0, route.status, route.text, network=route.network)
            results = [self.sender.result(i, reply, None, None) for i in indexes]
            name = relay.key if relay is not None else hop.host
            self._finish(message.id, indexes, results, destination=name)
            return
        domain = domain_of(message.recipients[indexes[0]].address)
        base = destination_key(domain, route, self.cfg.shaping.group_by, relay)
        size = self.cfg.delivery.max_recipients_per_transaction
        items = [
            WorkItem(message.id, indexes[i : i + size], route, message.klass, message.tenant)
            for i in range(0, len(indexes), size)
        ]
        domains = {domain_of(message.recipients[i].address) for i in indexes}
        self._place(items, base, domain, domains, relay, time.time())

    def _place(
        self,
        items: list[WorkItem],
        base: str,
        domain: str,
        domains: set[str],
        relay: Relay | None,
        now: float,
    ) -> None:
        """Queue work for destination `base`: each item at the source its class's or
        tenant's pool picks (none: the default source), unless no source may send there."""
        for item in items:
            pool = self.pools.for_message(item.klass, item.tenant)
            source = None if pool is None else self._source_for(pool, base, item.route, now)
            if pool is not None and source is None:
                self._no_source(item, pool, base, now)
                continue
            key = sourced(base, source)
            destination = self.destinations.get(key)
            if destination is None:
                destination = self._new_destination(key, domain, item.route, relay, now, source)
            destination.domains.update(domains)
            destination.waiting.add(item.message_id)
            self._core.enqueue(now, key, item, item.klass, item.tenant, run=False)
        self._log_ramps()

    def _source_for(self, pool: Pool, base: str, route: Route, now: float) -> Source | None:
        """The pool's source for mail to `base`: of those that may reach one of its hosts
        (host suspensions are per source), if any may; else of them all (the mail then
        waits for a host's release, as for one source)."""
        families = self.egress.families(base, _addresses(route), now)
        reach = [s for s in pool.sources if not self.sender.all_suspended(route, now, s)]

        def load(source: Source) -> int:
            key = sourced(base, source)
            if key not in self.destinations:
                return 0
            return sum(self._core.waiting(key).values()) + self._core.slots(key)[0]

        def placed(source: Source) -> int:
            """Messages queued at (source, base) or on their way: still active. (Not its
            connections: an idle one carries nothing, one opening carries an item.)"""
            destination = self.destinations.get(sourced(base, source))
            return 0 if destination is None else len(destination.waiting & self._busy.keys())

        return self.egress.choose(reach or pool.sources, base, families, load, now, placed)

    def _no_source(self, item: WorkItem, pool: Pool, base: str, now: float) -> None:
        """No source of the pool may send to `base`: every one of the families it has is
        out after a blocklist reply (an internal wait until the first comes back, once),
        or none is of its families (a failed attempt: the operator's pool or its DNS)."""
        families = self.egress.families(base, _addresses(item.route), now)
        back = self.egress.usable_after(pool.sources, base, families, now)
        if self.egress.warming(pool.sources, base, families, now):
            # Always uncharged: the schedule ends, and the wait is the point of warming.
            wake = self._warm_wake.get(base, 0.0)
            if warmup.day_of(wake) <= warmup.day_of(now):  # not drawn for the next day
                wake = self._warm_wake[base] = warmup.wake(now, self.rng, pool.warmup_spread)
            until = min(wake, back or float("inf"))
            log.info("warmup_wait", id=item.message_id, destination=base, until=until)
            self._warm_waits.setdefault(base, {})[item.message_id] = until
            self._unbusy(item.message_id, item.indexes)
            self._schedule(item.message_id, until)
            return
        if back is not None and self._uncharged_wait(item.message_id):
            self._unbusy(item.message_id, item.indexes)
            self._schedule(item.message_id, back)
            return
        if back is not None:
            text = f"every source of pool {pool.name} is blocklisted at {base}"
        else:
            wanted = "/".join(f"IPv{f}" for f in sorted(families)) or "no address"
            text = f"pool {pool.name} has no source for {base} ({wanted})"
        reply = Reply("connect", 0, "4.4.0" if back is None else "4.7.1", text, network="local")
        self._charge(item.message_id, item.indexes, reply, destination=base)

    def _new_destination(
        self,
        key: str,
        domain: str,
        route: Route,
        relay: Relay | None,
        now: float,
        source: Source | None = None,
    ) -> Destination:
        shaping = self.cfg.shaping
        hosts = [h.name for h in route.hosts]
        if relay is not None:
            domain = ""  # see _domain_of
        pacing = pacing_for(shaping, domain, hosts)
        shaper = DestinationShaper(
            pacing,
            shaping,
            now,
            self._learned.get(key),
            stated_rate=stated_rate(shaping, domain, hosts),
        )
        smarthost = self._smarthosts.get(key) if relay is not None else None
        destination = Destination(
            key,
            pacing,
            shaper,
            hosts=hosts,
            port=route.port,
            relay=relay,
            smarthost=smarthost,
            source=source,
        )
        for name in (key, destination.base, domain) if domain else (key, destination.base):
            if name in self._overrides:
                self._overrides[name](destination.shaper, now)
        self.destinations[key] = destination
        self._core.add_destination(key, shaper, pacing)
        return destination

    # -- connections and transactions (asked for by the core) ------------------------------

    async def _open(self, action: Connect) -> None:
        """Open one connection for the core: to the next host not tried for this slot."""
        now = time.time()
        item: WorkItem = action.item
        link = self._links.get(action.conn)
        if link is None:  # the slot's first connect
            destination = self.destinations[action.destination]
            message = self.spool.messages.get(item.message_id)
            families = self._families(destination, item.route, now)
            candidates = self.sender.candidates(item.route, now, families, destination.source)
            if message is None or message.held or isinstance(candidates, Suspended):
                self._act(self._core.abandon(now, action.conn))
                if isinstance(candidates, Suspended) and message is not None:
                    self._suspended(destination, item, candidates)
                else:
                    self._unbusy(item.message_id, item.indexes)
                return
            link = self._links[action.conn] = _Link(destination, item, candidates)
        link.item = item
        host, ip = link.candidates[link.tried]
        link.tried += 1
        last_one = all(h == host for h, _ in link.candidates[link.tried :])
        # Another address of this host is next (its other family, say): the host is not
        # down, one path to it is; it is suspended only if that one fails too.
        same_host = any(h == host for h, _ in link.candidates[link.tried :])
        port = item.route.port
        started = time.monotonic()
        destination = link.destination
        try:
            opened = await self.sender.connect(
                host,
                ip,
                port,
                last_one,
                destination.smarthost,
                item.route.sts,
                destination.source,
                suspend=not same_host,
                domain=item.route.tls_domain,
            )
        except Exception as exc:  # a bug: the attempt counts, as a local error
            log.exception("attempt_failed", id=item.message_id)
            self._links.pop(action.conn, None)
            self._act(self._core.abandon(time.time(), action.conn))
            self._attempt_failed(link.destination, item, exc)
            return
        now = time.time()
        if isinstance(opened, SmtpConnection):
            link.conn = opened
            latency = time.monotonic() - started
            if self.on_connect is not None:
                self.on_connect(link.destination.key, latency)
            actions = self._core.connected(now, action.conn, latency)
            self._learned_changes(link.destination, now)  # a latency far over the baseline
            self._act(actions)
            return
        failed = self.sender.result(0, opened, host, ip)
        self._relay_refused(link.destination, host, ip, [failed])
        link.failures.append(failed)
        link.destination.record(now, opened)
        more = link.tried < len(link.candidates) and self.sender.tries_next(opened, last_one)
        before = link.destination.shaper.state(now)
        actions = self._core.connect_failed(
            now, action.conn, more_hosts=more, reply=opened, verdict=failed.verdict
        )
        self._changed_since(link.destination, before, now, actions)
        self._act(actions)

    def _give_up(self, conn: int) -> list[Action]:
        """No further host for this item now: it is settled with the last connect failure
        (a failed attempt, as when every host failed), or goes back to the ready queue if
        that was the site's throttle: then what the core does next."""
        link = self._links.pop(conn)
        item, destination = link.item, link.destination
        assert item is not None
        reply = link.failures[-1].reply
        host, ip = link.failures[-1].remote_mta, link.failures[-1].ip
        results = [self.sender.result(i, reply, host, ip) for i in item.indexes]
        now = time.time()
        requeued = self._settle_item(destination, item, results, now)
        self._retire(destination)
        return self._core.tick(now) if requeued else []

    def _suspended(self, destination: Destination, item: WorkItem, wait: Suspended) -> None:
        """Every host is suspended: an internal wait, not an attempt, once; suspended
        again, that counts, with the reason (Postfix's "delivery temporarily
        suspended"), and the next try follows the retry schedule. Unless the suspensions
        are its source's and another source of its pool may reach a host: it goes there
        now (mail queued behind a source that a host refused must not wait for it)."""
        if self._another_source_reaches(destination, item):
            self._replace(destination, [item], time.time())
            return
        if self._uncharged_wait(item.message_id):
            self._unbusy(item.message_id, item.indexes)
            self._schedule(item.message_id, wait.until)
            return
        results = [self.sender.result(i, wait.reply, None, None) for i in item.indexes]
        self._finish(item.message_id, item.indexes, results, destination=destination.key)

    def _another_source_reaches(self, destination: Destination, item: WorkItem) -> bool:
        if destination.source is None:
            return False
        pool = self.pools.for_message(item.klass, item.tenant)
        now = time.time()
        return pool is not None and any(
            source != destination.source and not self.sender.all_suspended(item.route, now, source)
            for source in pool.sources
        )

    async def _send(self, conn: int, item: WorkItem) -> None:
        """One transaction on an open connection, for the core."""
        link = self._links[conn]
        link.item = item
        destination = link.destination
        message = self.spool.messages.get(item.message_id)
        assert link.conn is not None
        if message is None or message.held:
            self._unbusy(item.message_id, item.indexes)
            self._done(conn, link, [])
            return
        families = self._families(destination, item.route, time.time())
        if not self.sender.fits(link.conn, item.route, time.time(), families, destination.source):
            # An idle connection to a host since suspended, or not of this route: the
            # item goes back to its queue and waits for a connection of its own.
            self._done(conn, link, [], reusable=False)
            self._act(self._core.enqueue(time.time(), destination.key, item, item.klass))
            return
        try:
            content = self.spool.content(item.message_id)  # small, in the page cache
        except (OSError, CorruptMessageFile) as exc:
            log.error("message_unreadable", id=item.message_id, error=str(exc))
            self._unbusy(item.message_id, item.indexes)
            self._journal(self.spool.remove(item.message_id, f"unreadable: {exc}"), item.message_id)
            self._done(conn, link, [])
            return
        try:
            results = await self.sender.transaction(link.conn, message, item.indexes, content)
            host = link.candidates[link.tried - 1][0]  # the one this connection went to
            self.sender.judge_host(host, item.route.port, link.conn.ip, results, destination.source)
        except Exception as exc:
            log.exception("attempt_failed", id=item.message_id)
            link.conn.abort()
            self._done(conn, link, [], reusable=False)
            self._attempt_failed(destination, item, exc)
            return
        now = time.time()
        self._relay_refused(destination, link.conn.host, link.conn.ip, results)
        for result in {id(r.reply): r for r in results}.values():
            destination.record(now, result.reply)
        self._settle_item(destination, item, results, now)
        self._done(conn, link, results)

    def _relay_refused(
        self, destination: Destination, host: str, ip: str, results: list[Result]
    ) -> None:
        """Log, for the operator, a smarthost that refuses our AUTH or our required TLS:
        ours to fix (the password file, relay_user, relay_tls, relay_tls_ca), and nothing
        goes there until it is. The mail is deferred, never bounced for it."""
        relay = destination.relay
        if relay is None:
            return
        for result in results:
            kind = result.verdict.kind
            if kind == AUTH or (kind == TLS and relay.tls):
                log.error(
                    "relay_auth_failed" if kind == AUTH else "relay_tls_failed",
                    destination=destination.key,
                    relay=relay.source,
                    user=relay.user or None,
                    host=host,
                    ip=ip,
                    reply=result.reply.line(),
                )
                return

    def _done(
        self, conn: int, link: _Link, results: list[Result], reusable: bool | None = None
    ) -> None:
        """Tell the core a transaction is over (its replies are the shaper's feedback)."""
        now = time.time()
        assert link.conn is not None
        usable = self.sender.reusable(link.conn) if reusable is None else reusable
        if not usable:
            self._links.pop(conn, None)
            self._spawn(link.conn.quit())
        link.item = None
        destination = link.destination
        before = destination.shaper.state(now)
        try:
            replies = [(r.reply, r.verdict) for r in results]
            actions = self._core.done(now, conn, reusable=usable, replies=replies)
        except Exception:  # pacing is advice: what the attempt got is recorded already
            log.exception("feedback_failed", destination=destination.key)
            actions = []
        self._changed_since(destination, before, now, actions)
        self._act(actions)
        if not usable:
            self._retire(destination)

    def _changed_since(
        self, destination: Destination, before: ShaperState, now: float, actions: list[Action]
    ) -> None:
        after = destination.shaper.state(now)
        if after != before:
            released = sum(len(a.items) for a in actions if isinstance(a, Release))
            self._changed(destination, after, released)
        self._learned_changes(destination, now)

    def _learned_changes(self, destination: Destination, now: float) -> None:
        """Log the learned limits that moved (`limit_learned`)."""
        shaper = destination.shaper
        for change in shaper.changes():
            rate = change.what == "rate"  # logged per minute, as configured
            log.info(
                "limit_learned",
                destination=destination.key,
                what=change.what,
                old=round(change.old * 60, 2) if rate else change.old,
                new=round(change.new * 60, 2) if rate else change.new,
                reply=change.reply,
                probing=shaper.probing(now),
            )

    def _retire(self, destination: Destination) -> None:
        """Forget a destination with nothing to do and nothing to remember: its shaper at
        rest, no replies in its stats window and no mail routed to it still waiting (a
        deferred message keeps its destination's state in `mtaqueue-ctl domains`)."""
        now = time.time()
        quiet = destination.shaper.at_rest(now) and not destination.recent(now)
        if quiet and not self._still_waiting(destination) and self._core.forget(destination.key):
            self._learned[destination.key] = destination.shaper.learned()
            self.destinations.pop(destination.key, None)

    def _still_waiting(self, destination: Destination) -> bool:
        """Whether a message routed to the destination still has a recipient pending there;
        forgets those that have none."""
        for message_id in list(destination.waiting):
            message = self.spool.messages.get(message_id)
            if message is not None and any(
                r.state in PENDING
                and (destination.relay is not None or domain_of(r.address) in destination.domains)
                for r in message.recipients
            ):
                return True
            destination.waiting.discard(message_id)
        return False

    # -- failures of ours ---------------------------------------------------------------

    def _attempt_failed(self, destination: Destination, item: WorkItem, exc: Exception) -> None:
        """An attempt raised (a bug of ours outside the SMTP client, which reports its own):
        it counts, as a local error, rather than coming back every minute uncharged."""
        reply = Reply("mail", 0, "", f"local error: {type(exc).__name__}: {exc}", "local")
        self._charge(item.message_id, item.indexes, reply, destination=destination.key)

    def _charge(self, message_id: str, indexes: list[int], reply: Reply, destination: str) -> None:
        """Settle a failure of ours as an attempt of these recipients. A record that cannot
        even be settled is held for an operator (mtaqueue-ctl show / release): kept, and
        not tried again and again."""
        try:
            results = [self.sender.result(i, reply, None, None) for i in indexes]
            self._finish(message_id, indexes, results, destination=destination)
        except Exception:
            log.exception("settle_failed", id=message_id)
            self._unbusy(message_id, indexes)
            message = self.spool.messages.get(message_id)
            if message is not None:
                with contextlib.suppress(Exception):  # logged above; it waits for a restart
                    held = with_hold(message, HELD_BY_ERROR, time.time())
                    self._journal(self.spool.update(held), message_id)

    def _changed(self, destination: Destination, after: ShaperState, released: int) -> None:
        """Log a change of circuit or backoff mode (a time-based end is seen at the next
        attempt), and how much waiting mail a probe that closed the circuit let go."""
        calm = after.circuit == CLOSED and after.mode == "normal"
        (log.info if calm else log.warning)(
            "destination_changed",
            destination=destination.key,
            circuit=after.circuit,
            mode=after.mode,
            stage=after.stage,
            limit=destination.shaper.concurrency.limit,
            reply=destination.last_replies[-1] if destination.last_replies else None,
            released=released,
        )

    def _release(self, action: Release) -> None:
        """The probe went through and the circuit closed: the mail that waited while it was
        open is let go spread over shaping.release_spread, most urgent first (the queue
        gives it in class order), not as a herd. Not an attempt: due times stay."""
        now = time.time()
        shaper = self.destinations[action.destination].shaper
        starts = shaper.released(now, len(action.items), self.rng)
        for item, start in zip(action.items, starts, strict=True):
            self._unbusy(item.message_id, item.indexes)
            self._schedule(item.message_id, start)

    # -- after an attempt -----------------------------------------------------------------

    def _settle_item(self, destination: Destination, item: WorkItem, results, now: float) -> bool:
        """Settle a work item's attempt, its retries scaled by the destination's mode.
        Recipients refused by the site's throttle go back to the destination's ready queue
        uncharged (policy/settle.py `throttle_refused`), behind the cool-down that the
        core's next event starts (the caller reports the replies to it next): whether any
        did."""
        self._count_warmup(destination, results, now)
        refusals = self._refusals.get(item.message_id, 0)
        back, results = throttle_refused(results, refusals)
        again, results, moved = self._refused_egress(destination, item, results, now)
        if again:
            self._refusals[item.message_id] = refusals + 1
            indexes = [r.index for r in again]
            refused = WorkItem(item.message_id, indexes, item.route, item.klass, item.tenant)
            self._replace(destination, [refused], now)
        if results:
            self._finish(
                item.message_id,
                [r.index for r in results],
                results,
                retry_factor=destination.shaper.retry_factor(now),
                destination=destination.key,
            )
        if back:
            self._refusals[item.message_id] = refusals + 1
            indexes = [r.index for r in back]
            log.info(
                "requeued",
                id=item.message_id,
                destination=destination.key,
                rcpts=len(indexes),
                refusals=refusals + 1,
                reason=back[0].reply.line(),
            )
            again = WorkItem(item.message_id, indexes, item.route, item.klass, item.tenant)
            self._core.enqueue(now, destination.key, again, item.klass, item.tenant, run=False)
        return bool(back or again or moved)

    def _count_warmup(self, destination: Destination, results: list[Result], now: float) -> None:
        """A warming source's message to its destination, for the day's allowance (accepted
        for at least one recipient) or for its deferral rate (deferred, none accepted)."""
        source = destination.source
        if source is None or not source.warmup:
            return
        outcomes = {r.verdict.outcome for r in results}
        if DELIVERED in outcomes or TRANSIENT in outcomes:
            self.egress.warmup.record(destination.base, source, now, DELIVERED in outcomes)
        self._log_ramps()

    def _log_ramps(self) -> None:
        """Log the warm-up day ends that the policy came across."""
        for step in self.egress.warmup.drain():
            fields = msgspec.structs.asdict(step)
            held = fields.pop("held")
            (log.warning if held else log.info)(
                "warmup_held" if held else "warmup_advanced", **fields
            )

    def _families(self, destination: Destination, route: Route, now: float) -> set[int]:
        """The address families a connection of `destination` may use: its source's, or
        those of its route (IPv4 alone for a site that refused our IPv6)."""
        if destination.source is not None:
            return {destination.source.family}
        return self.egress.families(destination.base, _addresses(route), now)

    def _refused_egress(
        self, destination: Destination, item: WorkItem, results: list[Result], now: float
    ) -> tuple[list[Result], list[Result], bool]:
        """Split off the results to send again at once, uncharged (then the rest, to
        settle, and whether waiting mail moved): those refused for our source (a blocklist
        reply: the source leaves the destination, its waiting mail and these go to the
        pool's others) or for our IPv6 address (a site that wants IPv4 gets it from now
        on), when another source or IPv4 is there to take them, and not
        THROTTLE_REQUEUES times in a row already."""
        base, source = destination.base, destination.source
        pool = self.pools.for_message(item.klass, item.tenant) if source is not None else None
        blocked = [r for r in results if r.verdict.kind == BLOCKLIST] if pool else []
        ipv6 = [r for r in results if r.verdict.kind == IPV6 and r.ip and family_of(r.ip) == 6]
        moved = False
        if blocked and pool is not None and source is not None:
            if self.egress.exclude(base, source, now, pool.blocklist_hold):
                log.warning(
                    "source_blocklisted",
                    destination=base,
                    source=source.address,
                    pool=pool.name,
                    until=now + pool.blocklist_hold,
                    reply=blocked[0].reply.line(),
                )
            moved = True
        if ipv6 and self.egress.refuse_ipv6(base, now):
            log.warning("ipv6_refused", destination=base, reply=ipv6[0].reply.line())
            moved = moved or source is not None
        if moved:  # what waits there goes to the pool's other sources (or IPv4) now
            self._replace_queued(destination.key, now)
        refused = blocked + ipv6
        if not refused or self._refusals.get(item.message_id, 0) >= THROTTLE_REQUEUES:
            return [], results, moved
        if pool is not None:
            elsewhere = self._source_for(pool, base, item.route, now) is not None
        else:
            elsewhere = 4 in self.egress.families(base, _addresses(item.route), now)
        if not elsewhere:
            return [], results, moved
        ids = {id(r) for r in refused}
        return refused, [r for r in results if id(r) not in ids], moved

    def _replace(self, destination: Destination, items: list[WorkItem], now: float) -> None:
        """Queue items of `destination` again at its base (another source, perhaps)."""
        domain = min(destination.domains) if destination.domains else destination.base
        domains = set(destination.domains)
        self._place(items, destination.base, domain, domains, destination.relay, now)

    def _finish(
        self,
        message_id: str,
        indexes: list[int],
        results: list[Result],
        *,
        destination: str,
        retry_factor: float = 1.0,
    ) -> None:
        self._unbusy(message_id, indexes)
        self._waits.pop(message_id, None)  # an attempt: internal waits count from here
        self._refusals.pop(message_id, None)  # ... and throttle refusals in a row
        message = self.spool.messages.get(message_id)
        if message is None:
            return
        now = time.time()
        settings = self._settings(message.klass)
        settlement = settle(message, results, now, self.rng, settings, retry_factor=retry_factor)
        # (A smarthost that did not resolve has no live destination, but its key.)
        relay = self._relays_by_key.get(destination) or getattr(
            self.destinations.get(destination), "relay", None
        )
        for event in settlement.events:
            if event.get("event") == "delivery":
                event["destination"] = destination
                event["class"] = message.klass
                if relay is not None:
                    event["relay"] = relay.source
        self._apply(settlement, now)

    def _unbusy(self, message_id: str, indexes: list[int]) -> None:
        busy = self._busy.get(message_id)
        if busy is not None:
            busy.difference_update(indexes)
            if not busy:  # not active: a deferred message must not hold a set (nor window room)
                del self._busy[message_id]

    def _apply(self, settlement: Settlement, now: float) -> None:
        message = settlement.message
        for event in settlement.events:
            if event["event"] == "delivery" and self.on_delivery is not None:
                self.on_delivery(event)
            name = event.pop("event")
            log.info(name, **event)
        notices = [
            self._notify(message, reports, kind, now)
            for kind, reports in (
                ("failure", settlement.failed),
                ("delay", settlement.delayed),
                ("success", settlement.succeeded),
            )
            if reports
        ]
        if self.cfg.suppression.enabled:
            for address, reason in settlement.suppress:
                future = self.spool.suppress(address, now + self.cfg.suppression.ttl, reason)
                self._journal(future, message.id)
                log.info("suppressed", address=address, reason=reason)
        finished = settlement.finished and not self._busy.get(message.id)
        if finished:
            self._busy.pop(message.id, None)
            self._waits.pop(message.id, None)
            self._refusals.pop(message.id, None)
        earlier = self._noticing.get(message.id)
        if notices or earlier is not None:
            # Its DSNs must be durable before a record that shows the recipients they
            # report as done (or the original's end): kept in memory only until then, so
            # that a stop meanwhile (a disk still too full for them) leaves the record as
            # it was, to be tried and its DSNs made again. A later record waits its turn.
            self.spool.show(message)
            waits = notices if earlier is None else [*notices, earlier]
            self._noticing[message.id] = self._spawn(
                self._journal_when_noticed(message, finished, waits)
            )
        elif finished:
            self._journal(self.spool.remove(message.id, DONE, message), message.id)
        else:
            self._journal(self.spool.update(message), message.id)
        due = None if finished else _earliest_due(message)
        if due is not None:
            self._schedule(message.id, due)

    def _journal(self, future: asyncio.Future, message_id: str) -> None:
        """Log a journal write that failed. The record in memory stays current (a lost
        update costs at worst one more attempt; a lost remove, a message delivered again
        after a restart), so the queue goes on; the spool refuses new mail meanwhile."""

        def done(future: asyncio.Future) -> None:
            if not future.cancelled() and future.exception() is not None:
                log.error("journal_write_failed", id=message_id, error=str(future.exception()))

        future.add_done_callback(done)

    async def _journal_when_noticed(
        self, message: Message, finished: bool, notices: list[asyncio.Future]
    ) -> bool:
        """True once `message`'s record (its end, if `finished`) follows its durable DSNs."""
        noticed = all(await asyncio.gather(*notices))
        me = asyncio.current_task()
        if self._noticing.get(message.id) is me:
            del self._noticing[message.id]
        if not noticed:  # a bug, logged: the record stays, for an operator (or a restart)
            log.error("original_kept", id=message.id, reason="its DSN could not be queued")
            return False
        if finished:
            self._journal(self.spool.remove(message.id, DONE, message), message.id)
        elif self._noticing.get(message.id) is None:  # the latest record: journal it
            latest = self.spool.messages.get(message.id)
            if latest is not None:
                self._journal(self.spool.update(latest), message.id)
        return True

    def _notify(self, message: Message, reports: list, kind: str, now: float) -> asyncio.Future:
        """Queue a DSN to the sender (never for the null sender: wants_notice checked);
        the future says whether it is durable."""
        try:
            original = self.spool.content(message.id)
        except (OSError, CorruptMessageFile):
            original = b""
        dsn_id = self.spool.ids.next(now)
        params = DsnParams(self.hostname, now, self.cfg.dsn.max_return, dsn_id)
        notice, content = dsn_notice(
            message,
            reports,
            original,
            params,
            klass=self.cfg.dsn.klass,
            lifetime=self.cfg.dsn.lifetime,
        )
        stored, notice, content = self._accept_own(notice, content)  # now: a stop finds it
        fields = {"id": dsn_id, "kind": kind, "about": message.id, "to": message.sender}
        return self._spawn(self._store_notice(stored, notice, content, fields))

    def _accept_own(
        self, message: Message, content: bytes
    ) -> tuple[asyncio.Future, Message, bytes]:
        """Store mail of our own (a DSN, a TLS report), DKIM-signed if a key applies."""
        if self.sign_notice is not None:
            message, content = self.sign_notice(message, content)
        return self.spool.accept(message, content), message, content

    async def _queue_report(self, message: Message, content: bytes) -> bool:
        """Queue a TLS report's mail: True once durable. Tried once: a report that could
        not be stored is tried again with the report's retries (tls_reports.py)."""
        stored, message, _ = self._accept_own(message, content)
        try:
            await stored
        except (StorageFull, StorageError) as exc:
            log.error("tls_report_mail_failed", id=message.id, error=str(exc))
            return False
        log.info("tls_report_queued", id=message.id, to=message.recipients[0].address)
        return True

    async def _store_notice(
        self, stored: asyncio.Future, notice: Message, content: bytes, fields: dict
    ) -> bool:
        """Wait for a DSN to be durable, storing it again every DSN_RETRY seconds while the
        spool refuses it (a full disk, a writer restarting): True once durable, False
        after a bug."""
        while True:
            try:
                await stored
            except (StorageFull, StorageError) as exc:
                log.error("dsn_failed", **fields, error=str(exc), retry_in=DSN_RETRY)
                await asyncio.sleep(DSN_RETRY)
                stored = self.spool.accept(notice, content)
                continue
            except Exception:
                log.exception("dsn_failed", **fields)
                return False
            log.info("dsn_queued", **fields)
            return True

    # -- operations (mtaqueue-ctl) --------------------------------------------------------

    def hold(self, messages: list[Message], reason: str = HELD_BY_OPERATOR) -> int:
        """Held mail is not attempted and does not expire until released."""
        ids = {m.id for m in messages if not m.held}
        self._unqueue_messages(ids)
        now = time.time()
        for message_id in ids:
            held = with_hold(self.spool.messages[message_id], reason, now)
            self._journal(self.spool.update(held), message_id)
        return len(ids)

    def release(self, messages: list[Message]) -> int:
        """Release held mail; it resumes its schedule (overdue mail is due now)."""
        count = 0
        for message in messages:
            if message.held:
                released = without_hold(message)
                self._journal(self.spool.update(released), message.id)
                self._schedule(message.id, _earliest_due(released) or 0.0)
                count += 1
        return count

    def flush(self, messages: list[Message]) -> int:
        """Make deferred mail due now. It still goes through pacing, the circuit breaker
        and the greylisting minimum: a flush never hammers a receiver."""
        now = time.time()
        count = 0
        for message in messages:
            if message.held:
                continue
            greylist_min = self.cfg.retry.greylist_min
            recipients = [flushed(r, now, greylist_min) for r in message.recipients]
            message = msgspec.structs.replace(message, recipients=tuple(recipients))
            self._journal(self.spool.update(message), message.id)
            due = _earliest_due(message)
            if due is not None:
                self._schedule(message.id, due)
                count += 1
        return count

    def requeue(self, messages: list[Message]) -> int:
        """Look the recipients' domains up again, then flush (still paced)."""
        for message in messages:
            for rcpt in message.recipients:
                self.resolver.cache.forget(domain_of(rcpt.address))
        return self.flush(messages)

    def delete(self, messages: list[Message]) -> int:
        """Remove messages without notice (an operator's decision, logged)."""
        return self.cancel(messages, "deleted by operator")

    def _revalidated(self, message_id: str, indexes: list[int], decision: str) -> None:
        """The application's answer about a message set aside for it (delivery/revalidation.py):
        its recipients go on to routing, or it is cancelled (no DSN: the application said
        the mail no longer holds) or held for review. A message deleted, held or bounced
        meanwhile stays as the operator left it."""
        self._unbusy(message_id, indexes)
        message = self.spool.messages.get(message_id)
        if message is None or message.held or self._closing:
            return
        if decision == CANCEL:
            self.cancel([message], "cancelled by revalidation")
        elif decision == HOLD:
            self.hold([message], HELD_BY_REVALIDATION)
        else:  # the go-ahead is remembered: this dispatch is not checked again
            self._route_due([message_id])

    def cancel(self, messages: list[Message], reason: str) -> int:
        """Remove messages without a DSN: the operator's delete, the application's cancel
        (API, revalidation). `reason` is journaled; any reason but DONE makes the
        recipients not yet final "cancelled" events."""
        ids = {m.id for m in messages}
        self._unqueue_messages(ids)
        for message in messages:
            self._busy.pop(message.id, None)
            self._waits.pop(message.id, None)
            self._refusals.pop(message.id, None)
            self._journal(self.spool.remove(message.id, reason), message.id)
            log.info("deleted", id=message.id, sender=message.sender, reason=reason)
        return len(ids)

    def bounce(self, messages: list[Message]) -> int:
        """Fail messages now, with a DSN to their senders."""
        now = time.time()
        ids = {m.id for m in messages}
        self._unqueue(lambda item: item.message_id in ids)
        for message in messages:
            self._busy.pop(message.id, None)
            self._apply(bounce_now(message, now, "550 5.0.0 returned by the administrator"), now)
        return len(ids)

    def limit(self, name: str, rate: float | None, concurrency: int | None, until: float | None):
        """Runtime limits for a destination (by domain or destination name)."""

        def apply(shaper: DestinationShaper, now: float) -> None:
            shaper.override(now, rate_per_minute=rate, concurrency=concurrency, until=until)

        return self._steer(name, apply)

    def backoff(self, name: str, until: float) -> int:
        def apply(shaper: DestinationShaper, now: float) -> None:
            shaper.force_backoff(now, until)

        return self._steer(name, apply)

    def forget_learned(self, name: str) -> int:
        """Drop what destinations (by domain or destination name) learned: live ones start
        over from the slow start, remembered ones are no longer saved. Once, unlike a limit:
        what they learn from now on is kept."""
        name = name.lower()
        now = time.time()
        live = [d for d in self.destinations.values() if _named(d, name)]
        for destination in live:
            destination.shaper.forget(now)
        keys = {d.key for d in live} | ({name} & self._learned.keys())
        for key in keys:
            self._learned.pop(key, None)
            log.info("learned_forgotten", destination=key)
        return len(keys)

    def _steer(self, name: str, apply: Callable[[DestinationShaper, float], None]) -> int:
        """Apply to matching destinations now, and to one that appears later."""
        name = name.lower()
        self._overrides[name] = apply
        now = time.time()
        matched = [d for d in self.destinations.values() if _named(d, name)]
        for destination in matched:
            apply(destination.shaper, now)
        # Idle connections over a lowered limit close; a raised one may open more.
        self._act(self._core.tick(now, *(d.key for d in matched)))
        return len(matched)

    def domains(self) -> list[dict]:
        """The live destinations' state (for metrics; `view` adds the waiting mail)."""
        now = time.time()
        by_source: dict[Source | None, dict[str, float]] = {}  # hosts suspended for each
        core = self._core
        entries = []
        for d in self.destinations.values():
            if d.source not in by_source:
                by_source[d.source] = self.sender.suspended_hosts(now, d.source)
            suspended = by_source[d.source]
            entries.append(
                d.snapshot(now, suspended, core.waiting(d.key), core.slots(d.key)[0])
                | self.egress.snapshot(d.base, d.source, now)
            )
        return entries

    async def view(self) -> list[dict]:
        """`mtaqueue-ctl domains`: every destination with waiting mail or state to show."""
        live = self.domains()
        view = DestinationsView(live, self._busy, self.relay_of)
        async for message in walk(self.spool.messages):
            view.add(message)
        return sorted(view.entries() + self._ramps_unrouted(live), key=lambda d: d["destination"])

    def _ramps_unrouted(self, live: list[dict]) -> list[dict]:
        """The warm-up of (source, destination)s with no live destination (after a
        restart, say): a ramp's state matters while its mail waits for the next day."""
        names = {d["destination"] for d in live}
        sources = self._pool_sources()
        now = time.time()
        entries = []
        for base, address in list(self.egress.warmup.ramps):
            source = sources.get(address)
            if source is None or sourced(base, source) in names:
                continue
            entries.append(
                {"destination": sourced(base, source), "routed": False, "source": address}
                | {"domains": [], "queued": {}, "deferred": {}, "active": 0, "last_replies": []}
                | self.egress.warmup.snapshot(base, source, now)
            )
        return entries

    def _pool_sources(self) -> dict[str, Source]:
        return {s.address: s for p in self.pools.pools.values() for s in p.sources}

    # -- warm-up, by the operator (mtaqueue-ctl warmup) -----------------------------------

    def warmups(self, address: str | None = None) -> list[dict]:
        """Each ramp of the warming sources (of `address`), by source and destination.
        Raises ValueError for an address that is no warming source of a pool."""
        now = time.time()
        return [
            self._ramp_entry(base, source, now)
            for source in self._warming(address)
            for base in self.egress.warmup.bases(source.address)
        ]

    async def move_warmup(self, address: str, name: str | None, to_first: bool) -> list[dict]:
        """Put `address`'s ramp at the destination `name` (its key, or a domain it serves;
        None: every destination it has a ramp at) back on the first step (`to_first`:
        mail queued there over that step's allowance goes to the pool's others or waits)
        or past the last (mail waiting there for the next day's allowance goes now).
        Saved to egress.json before the answer. Raises ValueError if there is none."""
        if not self._started:  # the ramps were never loaded: saving would lose them
            raise ValueError("delivery is off (delivery.enabled = false): no ramp to move")
        (source,) = self._warming(address)
        now = time.time()
        entries = []
        for base in self._ramp_bases(source, name):
            ramp = self.egress.warmup.move(base, source, now, to_first)
            self._log_ramps()  # a day end it came across first
            (log.warning if to_first else log.info)(
                "warmup_restarted" if to_first else "warmup_finished",
                base=base,
                source=source.address,
                step=ramp.step + 1,
                allowance=warmup.allowance(ramp, source.warmup),
                sent=ramp.sent,
            )
            entries.append(self._ramp_entry(base, source, now))
            if to_first:
                self._replace_queued(sourced(base, source), now)
            else:
                for message_id, until in self._warm_waits.pop(base, {}).items():
                    if until > now:
                        self._schedule(message_id, now)
        await asyncio.to_thread(self._save_egress, self.egress.encode(now))
        return entries

    def _warming(self, address: str | None) -> list[Source]:
        sources = [s for s in self._pool_sources().values() if s.warmup]
        if address is None:
            return sorted(sources, key=lambda s: s.address)
        normal = str(ipaddress.ip_address(address))  # a ValueError that names it
        found = [s for s in sources if s.address == normal]
        if not found:
            raise ValueError(f"{normal} is no source of a pool with a warmup schedule")
        return found

    def _ramp_bases(self, source: Source, name: str | None) -> list[str]:
        known = self.egress.warmup.bases(source.address)
        if name is None:
            found = known
        else:
            name = name.lower().removesuffix(f"@{source.address}")
            live = (self.destinations.get(sourced(base, source)) for base in known)
            found = [
                base
                for base, d in zip(known, live, strict=True)
                if base == name or (d is not None and _named(d, name))
            ]
        if not found:
            where = "anywhere" if name is None else f"at {name}"
            raise ValueError(f"source {source.address} has no ramp {where} (see warmup show)")
        return found

    def _ramp_entry(self, base: str, source: Source, now: float) -> dict:
        """A ramp as `mtaqueue-ctl warmup` shows it."""
        shown = self.egress.warmup.snapshot(base, source, now)["warmup"]
        return {"source": source.address, "destination": base, **shown}

    def _replace_queued(self, key: str, now: float) -> None:
        """Place the mail queued at destination `key` again (its source's pool chooses)."""
        destination = self.destinations.get(key)
        if destination is None:
            return
        queued = self._core.remove(now, lambda _: True, key)
        destination.waiting.difference_update(item.message_id for item in queued)
        self._replace(destination, queued, now)

    def _unqueue_messages(self, ids: set[str]) -> None:
        """Take these messages' items out of the ready queues. That looks at every item
        queued, so only when one of them has recipients routed (an item in the core is
        always of busy recipients): a revalidation's hold or cancel, one message at a time,
        must not scan the whole active window each."""
        if any(self._busy.get(i) for i in ids):
            self._unqueue(lambda item: item.message_id in ids)

    def relay_of(self, message: Message) -> str | None:
        """The smarthost (destination key) all of a message goes to, or None."""
        relay = self.relays.for_message(message.klass, message.tenant)
        return relay.key if relay is not None else None

    def _unqueue(self, predicate: Callable[[WorkItem], bool]) -> None:
        for item in self._core.remove(time.time(), predicate):
            self._unbusy(item.message_id, item.indexes)

    def _spawn(self, coro) -> asyncio.Future:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _own_mx(hop: NextHop, relay: Relay | None, work: list[tuple[Message, list[int]]]) -> bool:
    """Whether the hop is the recipients' domain's own MX lookup: not a smarthost, a
    relayhost or a route elsewhere (the operator's choice of next hop, outside MTA-STS)."""
    message, indexes = work[0]
    domain = domain_of(message.recipients[indexes[0]].address)
    return relay is None and hop.mx and hop.host == domain


def _named(destination: Destination, name: str) -> bool:
    """Whether an operator's name (ctl limit, backoff, forget) means this destination: its
    key, or a domain it serves, unless it is a smarthost (a limit for gmail.com paces
    Gmail's MX, not an ESP that carries some of that mail)."""
    if name in (destination.key, destination.base):
        return True
    return destination.relay is None and name in destination.domains


def _write_state(path: Path, data: bytes, what: str) -> bool:
    """Replace a state file; False (logged `<what>_save_failed`) if it could not be: the
    state is kept in memory, and the next sweep tries again."""
    try:
        statefile.write_atomic(path, data)
    except OSError as exc:
        log.warning(f"{what}_save_failed", error=str(exc))
        return False
    return True


def _addresses(route: Route) -> list[str]:
    return [address for host in route.hosts for address in host.addresses]


def _earliest_due(message: Message) -> float | None:
    """When the next pending recipient is due (0 for one never tried); None if none."""
    dues = [r.next_attempt or 0.0 for r in message.recipients if r.state in PENDING]
    return min(dues) if dues and not message.held else None
