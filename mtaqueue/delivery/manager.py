"""The queue manager: when each message is due, and who delivers it, how fast.

Data path: a due message's pending recipients are grouped by next hop, routed
(MX lookup), and queued as work items in their destination (the MX host set).
A destination's queue is fair (policy/fairness.py: the first class first, the
others by weight, tenants fairly) and its shaper (policy/shaper.py) decides when
a new connection may open and a message may start: concurrency, rates, backoff
mode, circuit breaker. Mail that waits for pacing is not charged an attempt.
Each worker owns one connection and takes the next item when it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import random
import time
from collections.abc import Callable

import msgspec

from .. import config
from ..dsn import notice as dsn_notice
from ..logs import get_logger
from ..model import DEFERRED, QUEUED, Message
from ..policy.backoff import RetryPolicy, restart_due
from ..policy.breaker import CLOSED, HALF_OPEN
from ..policy.buckets import TokenBucket
from ..policy.classify import compile_rules
from ..policy.fairness import FairQueue, class_order
from ..policy.hosts import HostSuspensions
from ..policy.replies import Reply
from ..policy.settle import (
    Result,
    Settlement,
    SettleSettings,
    bounce_now,
    expire_due,
    flushed,
    settle,
)
from ..policy.shaper import DestinationShaper, ShaperState, pacing_for
from ..routing.nexthop import NextHop, next_hop
from ..routing.resolver import Resolver, Route, RouteFailure
from ..smtp.addresses import domain_of
from ..smtp.client import ClientSettings, SmtpConnection
from ..spool.message_file import CorruptMessageFile
from ..spool.store import Spool, StorageError, StorageFull
from .destination import Destination, WorkItem, destination_key, destinations_view
from .sender import Outcome, Permit, Sender

log = get_logger("delivery")

EXPIRY_CHECK = 30.0  # seconds between sweeps for mail whose lifetime has passed
RECOVER_AFTER = 60.0  # retry delay after an unexpected error (a bug): not an attempt...
UNCHARGED_WAITS = 1  # ... once: a repeated internal wait counts as an attempt
DSN_RETRY = 5.0  # seconds between tries to store a DSN the spool refused (a full disk)
PENDING = (QUEUED, DEFERRED)


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
        self._tenants: dict[str, TokenBucket] = {}
        self.destinations: dict[str, Destination] = {}
        self.on_delivery: Callable[[dict], None] | None = None  # each "delivery" event
        self.on_connect: Callable[[str, float], None] | None = None  # destination, seconds
        self.reconfigure(cfg)
        self.active_workers = 0
        self._overrides: dict[str, Callable[[DestinationShaper, float], None]] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._busy: dict[str, set[int]] = {}  # message id -> recipients routed/queued/in transit
        self._waits: dict[str, int] = {}  # message id -> internal waits since its last attempt
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Future] = set()
        self._closing = False

    def reconfigure(self, cfg: config.Config) -> None:
        """Take new settings (start, or a reload): may raise ConfigError before changing
        anything. Destinations keep their state unless their pacing changed."""
        d = cfg.delivery
        rules = compile_rules(d.rules)
        now = time.time()
        client = ClientSettings(d.helo_name or self.hostname, d.timeouts, d.tls)
        self.sender = Sender(client, rules, self.hosts, d)
        self.classes = {name: (c.priority, c.weight) for name, c in cfg.classes.items()}
        self.first_class = class_order({n: c.priority for n, c in cfg.classes.items()})[0]
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
        self.rate = TokenBucket(config.parse_rate(d.max_rate), 1, now) if d.max_rate else None
        tenant_rate = cfg.shaping.tenant_rate
        self.tenant_rate = config.parse_rate(tenant_rate) if tenant_rate else 0.0
        self.cfg = cfg
        for destination in self.destinations.values():
            self._repace(destination, now)

    def _repace(self, destination: Destination, now: float) -> None:
        """Apply reloaded pacing and classes to a live destination."""
        domain = min(destination.domains) if destination.domains else destination.key
        hosts = destination.key.split(":")[0].split(",")
        pacing = pacing_for(self.cfg.shaping, domain, hosts)
        if pacing != destination.pacing:
            destination.pacing = pacing
            destination.shaper = DestinationShaper(pacing, self.cfg.shaping, now)
        if destination.classes != self.classes:
            items = destination.queue.remove(lambda item: True)
            destination.classes = self.classes
            destination.queue = FairQueue(self.classes)
            for item in items:
                klass = item.klass if item.klass in self.classes else self.first_class
                destination.queue.push(item, klass, item.tenant)

    def _settings(self, klass: str) -> SettleSettings:
        # A class removed by a reload: its queued mail follows the default class.
        return (
            self.settle_settings.get(klass)
            or self.settle_settings[self.cfg.submission.default_class]
        )

    # -- life ------------------------------------------------------------------------

    def start(self) -> None:
        """Schedule the queue and run. Due times survive restarts; mail that became due
        meanwhile is spread over retry.restart_spread, except the first class (p0)."""
        now = time.time()
        spread = self.cfg.retry.restart_spread
        for message in self.spool.messages.values():
            due = _earliest_due(message)
            if due is not None:
                window = 0.0 if message.klass == self.first_class else spread
                self._schedule(message.id, restart_due(due, now, window, self.rng))
        self._spawn(self._timer())
        self._spawn(self._expiry_sweep())

    async def close(self, grace: float) -> None:
        """Stop dispatching; let attempts in progress finish for up to `grace` seconds."""
        self._closing = True
        self._wake.set()
        for destination in self.destinations.values():
            destination.arrived.set()
        deadline = time.monotonic() + grace
        while self.active_workers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def on_accepted(self, message: Message) -> None:
        """A new message is durable: due now."""
        self._schedule(message.id, time.time())

    # -- timing ------------------------------------------------------------------------

    def _schedule(self, message_id: str, due: float) -> None:
        heapq.heappush(self._heap, (due, next(self._seq), message_id))
        if self._heap[0][2] == message_id:
            self._wake.set()

    async def _timer(self) -> None:
        while not self._closing:
            now = time.time()
            # Everything due now is routed together: one lookup per next hop, not one per
            # message (a restart can make thousands due in the same moment).
            batch: dict[NextHop, list[tuple[Message, list[int]]]] = {}
            while self._heap and self._heap[0][0] <= now:
                _, _, message_id = heapq.heappop(self._heap)
                try:
                    self._dispatch(message_id, now, batch)
                except Exception as exc:  # one bad record must not stop all delivery
                    log.exception("dispatch_failed", id=message_id)
                    self._busy.pop(message_id, None)
                    self._retry_later(message_id, None, exc)
            for hop, work in batch.items():
                self._spawn(self._route(hop, work))
            timeout = self._heap[0][0] - now if self._heap else None
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def _expiry_sweep(self) -> None:
        while not self._closing:
            await asyncio.sleep(EXPIRY_CHECK)
            self.expire(time.time())
            # Destinations whose last waiting mail went without a connection (deleted,
            # bounced, expired) or whose stats window passed are forgotten here.
            for destination in list(self.destinations.values()):
                self._retire(destination)

    def expire(self, now: float) -> None:
        """Expire mail whose lifetime has passed, whatever it waits for (pacing included)."""
        due = {
            m.id
            for m in self.spool.messages.values()
            if expire_due(m, now, self._settings(m.klass)) is not None
        }
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
        self, message_id: str, now: float, batch: dict[NextHop, list[tuple[Message, list[int]]]]
    ) -> None:
        """Add the message's due recipients to `batch`, grouped by next hop."""
        message = self.spool.messages.get(message_id)
        if message is None or message.held or self._closing:
            return
        busy = self._busy.setdefault(message_id, set())
        groups: dict[NextHop, list[int]] = {}
        d = self.cfg.delivery
        for i, rcpt in enumerate(message.recipients):
            if rcpt.state in PENDING and i not in busy and (rcpt.next_attempt or 0) <= now:
                hop = next_hop(domain_of(rcpt.address), d.relayhost, self.cfg.routes, d.port)
                groups.setdefault(hop, []).append(i)
        if not groups and not busy:
            del self._busy[message_id]
            return
        for hop, indexes in groups.items():
            busy.update(indexes)
            batch.setdefault(hop, []).append((message, indexes))

    async def _route(self, hop: NextHop, work: list[tuple[Message, list[int]]]) -> None:
        failure: Exception | None = None
        try:
            route = await self.resolver.route(hop)
        except Exception as exc:
            log.exception("routing_failed", hop=hop.host)
            route, failure = None, exc
        for message, indexes in work:
            try:
                if route is None:
                    self._retry_later(message.id, indexes, failure)
                else:
                    self._queue(message, hop, indexes, route)
            except Exception as exc:
                log.exception("routing_failed", id=message.id, hop=hop.host)
                self._retry_later(message.id, indexes, exc)

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

    def _uncharged_wait(self, message_id: str) -> bool:
        """Count an internal wait (every host suspended, an unexpected error): whether it
        may go uncharged. A repeat may not: a wait that can come back for ever would hold a
        message with no attempt and no reason until it expires."""
        waits = self._waits.get(message_id, 0) + 1
        self._waits[message_id] = waits
        return waits <= UNCHARGED_WAITS

    def _queue(
        self, message: Message, hop: NextHop, indexes: list[int], route: Route | RouteFailure
    ) -> None:
        if isinstance(route, RouteFailure):
            reply = Reply("dns", 0, route.status, route.text, network="dns")
            results = [self.sender.result(i, reply, None, None) for i in indexes]
            self._finish(message.id, indexes, results, destination=hop.host)
            return
        now = time.time()
        domain = domain_of(message.recipients[indexes[0]].address)
        key = destination_key(domain, route, self.cfg.shaping.group_by)
        destination = self.destinations.get(key)
        if destination is None:
            destination = self._new_destination(key, domain, route, now)
        destination.domains.add(domain)
        destination.waiting.add(message.id)
        size = self.cfg.delivery.max_recipients_per_transaction
        for start in range(0, len(indexes), size):
            item = WorkItem(
                message.id, indexes[start : start + size], route, message.klass, message.tenant
            )
            klass = message.klass if message.klass in self.classes else self.first_class
            destination.queue.push(item, klass, message.tenant)
        destination.arrived.set()
        self._pump(destination)

    def _new_destination(self, key: str, domain: str, route, now: float) -> Destination:
        shaping = self.cfg.shaping
        pacing = pacing_for(shaping, domain, [h.name for h in route.hosts])
        shaper = DestinationShaper(pacing, shaping, now)
        destination = Destination(key, pacing, shaper, self.classes)
        for name in (key, domain):
            if name in self._overrides:
                self._overrides[name](destination.shaper, now)
        self.destinations[key] = destination
        return destination

    def _pump(self, destination: Destination) -> None:
        """Open connections while the destination has waiting mail and its shaper allows."""
        if destination.pump_at is not None:
            destination.pump_at.cancel()
            destination.pump_at = None
        shaper = destination.shaper
        while len(destination.queue) > destination.idle and not self._closing:
            if self.active_workers >= self.cfg.delivery.max_connections:
                return  # a finishing worker calls _restaff
            now = time.time()
            active, reserved = destination.active, destination.reserved
            wait = shaper.connect_wait(now, active, reserved, first_class=False)
            first_class = False
            if wait > 0 and destination.queue.first_class_waiting():
                # The ordinary connections are busy or paced: first-class mail may use a
                # reserved slot.
                reserved_wait = shaper.connect_wait(now, active, reserved, first_class=True)
                first_class, wait = reserved_wait == 0, min(wait, reserved_wait)
            if wait > 0:
                if wait != math.inf:
                    loop = asyncio.get_running_loop()
                    destination.pump_at = loop.call_later(wait, self._pump, destination)
                return
            shaper.connected(now)
            destination.active += 1
            destination.reserved += first_class
            self.active_workers += 1
            self._spawn(self._worker(destination, first_class))

    def _restaff(self) -> None:
        """A connection slot came free: give it to a destination with waiting mail."""
        for destination in list(self.destinations.values()):
            if len(destination.queue) > destination.idle:
                self._pump(destination)

    async def _worker(self, destination: Destination, first_class: bool) -> None:
        """One slot's life: take work from the destination's queue (first-class work
        only if `first_class`) while the shaper keeps it, then quit. The slot's first
        connection was admitted by _pump; each further one (after messages_per_connection,
        a close, for the next MX host) is admitted by the shaper again."""
        conn: SmtpConnection | None = None
        shaper = destination.shaper
        granted = True  # a connection admitted and not opened yet

        async def permit() -> bool:
            nonlocal granted
            if granted:
                granted = False
                return True
            while not self._closing:  # the next MX host: wait here, the item is chosen
                wait = self._reconnect_wait(destination, first_class)
                if wait == 0:
                    shaper.connected(time.time())
                    return True
                if wait == math.inf:
                    return False
                await asyncio.sleep(wait)
            return False

        try:
            eligible = self._tenant_ready if self.tenant_rate else None
            while not self._closing:
                if not shaper.keeps(
                    time.time(), destination.active, destination.reserved, first_class
                ):
                    break
                waiting = (
                    destination.queue.first_class_waiting()
                    if first_class
                    else len(destination.queue)
                )
                wait = self._send_wait(destination) if waiting else 0.0
                if waiting and not granted and not _reusable(conn, destination.pacing):
                    reconnect = self._reconnect_wait(destination, first_class)
                    if reconnect == math.inf:
                        break  # the breaker opened, or the slot is no longer admitted
                    if reconnect == 0 and wait == 0:
                        shaper.connected(time.time())
                        granted = True
                    wait = max(wait, reconnect)
                if wait > 0:
                    # Choose the item when it can go, not before: mail that arrives
                    # meanwhile (p0) is taken first, and a lowered limit applies.
                    await asyncio.sleep(wait)
                    continue
                item = destination.queue.pop(first_class_only=first_class, eligible=eligible)
                if item is None and first_class:
                    # The first-class work is done: go on as an ordinary connection if
                    # there is room for one (checked above), else close.
                    first_class = False
                    destination.reserved -= 1
                    continue
                if item is None:
                    if len(destination.queue) and eligible is not None:
                        await asyncio.sleep(0.1)  # only capped tenants wait: not idle
                        continue
                    if conn is None or not await self._idle(destination):
                        break
                    continue
                self._sent(destination, item.tenant)
                try:
                    conn, denied = await self._attempt(destination, item, conn, permit)
                    if denied:
                        break
                except Exception as exc:
                    log.exception("attempt_failed", id=item.message_id)
                    if conn is not None:
                        conn.abort()
                    conn = None
                    self._attempt_failed(destination, item, exc)
        finally:
            # The slot is free from here: the QUIT below is one round trip.
            destination.active -= 1
            destination.reserved -= first_class
            self.active_workers -= 1
            if conn is not None:
                await conn.quit()
            self._retire(destination)
            self._restaff()

    def _reconnect_wait(self, destination: Destination, first_class: bool) -> float:
        """The shaper's connect_wait for a further connection of a running slot: the
        slot is its own (counted out, as in `keeps`); the rate and the breaker apply."""
        return destination.shaper.connect_wait(
            time.time(), destination.active - 1, destination.reserved - first_class, first_class
        )

    def _tenant_ready(self, tenant: str | None) -> bool:
        """Whether a tenant may send now under shaping.tenant_rate."""
        if tenant is None:
            return True
        now = time.time()
        bucket = self._tenants.get(tenant)
        if bucket is None:
            bucket = self._tenants[tenant] = TokenBucket(self.tenant_rate, 1, now)
        return bucket.wait(now) == 0

    async def _idle(self, destination: Destination) -> bool:
        """Keep the connection a moment for more mail; False when none came."""
        destination.arrived.clear()
        destination.idle += 1
        try:
            await asyncio.wait_for(destination.arrived.wait(), self.cfg.delivery.connection_idle)
        except TimeoutError:
            return False
        finally:
            destination.idle -= 1
        return True

    def _send_wait(self, destination: Destination) -> float:
        """Seconds until the destination's and the global message rates let one more
        message go (pacing, not an attempt)."""
        now = time.time()
        wait = destination.shaper.send_wait(now)
        if self.rate is not None:
            wait = max(wait, self.rate.wait(now))
        return wait

    def _sent(self, destination: Destination, tenant: str | None) -> None:
        now = time.time()
        destination.shaper.sent(now)
        if self.rate is not None:
            self.rate.take(now)
        if tenant is not None and self.tenant_rate:
            self._tenants[tenant].take(now)

    def _retire(self, destination: Destination) -> None:
        """Forget a destination with nothing to do and nothing to remember: its shaper at
        rest, no replies in its stats window and no mail routed to it still waiting (a
        deferred message keeps its destination's state in `mtaqueue-ctl domains`)."""
        now = time.time()
        idle = not destination.active and not len(destination.queue)
        quiet = destination.shaper.at_rest(now) and not destination.recent(now)
        if idle and quiet and not self._still_waiting(destination):
            self.destinations.pop(destination.key, None)

    def _still_waiting(self, destination: Destination) -> bool:
        """Whether a message routed to the destination still has a recipient pending there;
        forgets those that have none."""
        for message_id in list(destination.waiting):
            message = self.spool.messages.get(message_id)
            if message is not None and any(
                r.state in PENDING and domain_of(r.address) in destination.domains
                for r in message.recipients
            ):
                return True
            destination.waiting.discard(message_id)
        return False

    # -- one attempt --------------------------------------------------------------------

    async def _attempt(
        self,
        destination: Destination,
        item: WorkItem,
        conn: SmtpConnection | None,
        permit: Permit,
    ) -> tuple[SmtpConnection | None, bool]:
        """One item's attempt: the connection left open, and whether pacing denied a
        connection it needed (the slot then ends)."""
        message = self.spool.messages.get(item.message_id)
        if message is None or message.held:
            self._unbusy(item.message_id, item.indexes)
            return conn, False
        try:
            content = self.spool.content(item.message_id)  # small, in the page cache
        except (OSError, CorruptMessageFile) as exc:
            log.error("message_unreadable", id=item.message_id, error=str(exc))
            self._unbusy(item.message_id, item.indexes)
            self._journal(self.spool.remove(item.message_id, f"unreadable: {exc}"), item.message_id)
            return conn, False
        per_connection = destination.pacing.messages_per_connection
        outcome = await self.sender.send(
            message, item.indexes, item.route, content, conn, per_connection, permit
        )
        now = time.time()
        try:
            self._feedback(destination, outcome, now)
        except Exception:  # pacing is advice: what the attempt got must still be recorded
            log.exception("feedback_failed", destination=destination.key)
        if outcome.wait_until is not None:
            if self._uncharged_wait(item.message_id):
                # Every host is suspended: an internal wait, not an attempt.
                self._unbusy(item.message_id, item.indexes)
                self._schedule(item.message_id, outcome.wait_until)
                return outcome.conn, False
            # Suspended again: that counts, with the reason (Postfix's "delivery
            # temporarily suspended"), and the next try follows the retry schedule.
            reply = outcome.suspended
            assert reply is not None
            outcome.results = [self.sender.result(i, reply, None, None) for i in item.indexes]
        elif not outcome.results:  # denied before anything was tried: back in its queue
            klass = item.klass if item.klass in self.classes else self.first_class
            destination.queue.push(item, klass, item.tenant)
            destination.arrived.set()
            return outcome.conn, outcome.denied
        self._finish(
            item.message_id,
            item.indexes,
            outcome.results,
            retry_factor=destination.shaper.retry_factor(now),
            destination=destination.key,
        )
        return outcome.conn, outcome.denied

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
                    held = msgspec.structs.replace(message, held=True)
                    self._journal(self.spool.update(held), message_id)

    def _feedback(self, destination: Destination, outcome: Outcome, now: float) -> None:
        """Tell the destination's shaper what an attempt showed, and act on what changed."""
        shaper = destination.shaper
        before, limit = shaper.state(now), shaper.concurrency.limit
        for _ in range(outcome.connect_failures):
            shaper.connect_failed(now)
        if outcome.latency is not None:
            shaper.latency(now, outcome.latency)
            if self.on_connect is not None:
                self.on_connect(destination.key, outcome.latency)
        if outcome.wait_until is None:
            # One signal per reply, not per recipient: a 421 after DATA for 50 recipients
            # is one throttle signal, not fifty.
            for result in {id(r.reply): r for r in outcome.results}.values():
                shaper.result(now, result.reply, result.verdict)
                destination.record(now, result.reply)
        after = shaper.state(now)
        if after != before:
            self._changed(destination, before, after, now)
        if shaper.concurrency.limit < limit:
            destination.arrived.set()  # idle connections over the new limit close
        elif shaper.concurrency.limit > limit:
            self._pump(destination)  # room for one more connection to the backlog

    def _changed(
        self, destination: Destination, before: ShaperState, after: ShaperState, now: float
    ) -> None:
        """Log a change of circuit or backoff mode (a time-based end is seen at the next
        attempt); when a probe closed the circuit, let the waiting mail go."""
        released = 0
        if before.circuit == HALF_OPEN and after.circuit == CLOSED:
            released = self._release(destination, now)
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

    def _release(self, destination: Destination, now: float) -> int:
        """The probe went through and the circuit closed: the mail that waited while it was
        open is let go spread over shaping.release_spread, most urgent first (the queue
        gives it in class order), not as a herd. Not an attempt: due times stay."""
        items = destination.queue.remove(lambda item: True)
        starts = destination.shaper.released(now, len(items), self.rng)
        for item, start in zip(items, starts, strict=True):
            self._unbusy(item.message_id, item.indexes)
            self._schedule(item.message_id, start)
        return len(items)

    # -- after an attempt -----------------------------------------------------------------

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
        message = self.spool.messages.get(message_id)
        if message is None:
            return
        now = time.time()
        settings = self._settings(message.klass)
        settlement = settle(message, results, now, self.rng, settings, retry_factor=retry_factor)
        for event in settlement.events:
            if event.get("event") == "delivery":
                event["destination"] = destination
                event["class"] = message.klass
        self._apply(settlement, now)

    def _unbusy(self, message_id: str, indexes: list[int]) -> None:
        busy = self._busy.get(message_id)
        if busy is not None:
            busy.difference_update(indexes)

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
        if settlement.finished and not self._busy.get(message.id):
            self._busy.pop(message.id, None)
            self._waits.pop(message.id, None)
            if not notices:
                self._journal(self.spool.remove(message.id, "done"), message.id)
                return
            # Its DSNs must be durable before the original goes: kept until then.
            self._journal(self.spool.update(message), message.id)
            self._spawn(self._remove_when_noticed(message.id, notices))
            return
        self._journal(self.spool.update(message), message.id)
        due = _earliest_due(message)
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

    async def _remove_when_noticed(self, message_id: str, notices: list[asyncio.Future]) -> None:
        if all(await asyncio.gather(*notices)):
            self._journal(self.spool.remove(message_id, "done"), message_id)
        else:  # a bug, logged: the original stays, with its final states, for an operator
            log.error("original_kept", id=message_id, reason="its DSN could not be queued")

    def _notify(self, message: Message, reports: list, kind: str, now: float) -> asyncio.Future:
        """Queue a DSN to the sender (never for the null sender: wants_notice checked);
        the future says whether it is durable."""
        try:
            original = self.spool.content(message.id)
        except (OSError, CorruptMessageFile):
            original = b""
        dsn_id = self.spool.ids.next(now)
        notice, content = dsn_notice(
            message,
            reports,
            original,
            reporting_mta=self.hostname,
            now=now,
            max_return=self.cfg.dsn.max_return,
            dsn_id=dsn_id,
            klass=self.cfg.dsn.klass,
            lifetime=self.cfg.dsn.lifetime,
        )
        stored = self.spool.accept(notice, content)  # now: a stop finds it queued
        fields = {"id": dsn_id, "kind": kind, "about": message.id, "to": message.sender}
        return self._spawn(self._store_notice(stored, notice, content, fields))

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

    def hold(self, messages: list[Message]) -> int:
        """Held mail is not attempted and does not expire until released."""
        ids = {m.id for m in messages if not m.held}
        self._unqueue(lambda item: item.message_id in ids)
        for message_id in ids:
            held = msgspec.structs.replace(self.spool.messages[message_id], held=True)
            self._journal(self.spool.update(held), message_id)
        return len(ids)

    def release(self, messages: list[Message]) -> int:
        """Release held mail; it resumes its schedule (overdue mail is due now)."""
        count = 0
        for message in messages:
            if message.held:
                released = msgspec.structs.replace(message, held=False)
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
        ids = {m.id for m in messages}
        self._unqueue(lambda item: item.message_id in ids)
        for message in messages:
            self._busy.pop(message.id, None)
            self._waits.pop(message.id, None)
            self._journal(self.spool.remove(message.id, "deleted by operator"), message.id)
            log.info("deleted", id=message.id, sender=message.sender)
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

    def _steer(self, name: str, apply: Callable[[DestinationShaper, float], None]) -> int:
        """Apply to matching destinations now, and to one that appears later."""
        name = name.lower()
        self._overrides[name] = apply
        now = time.time()
        matched = [d for d in self.destinations.values() if name == d.key or name in d.domains]
        for destination in matched:
            apply(destination.shaper, now)
            destination.arrived.set()  # idle connections over a lowered limit close
            self._pump(destination)
        return len(matched)

    def domains(self) -> list[dict]:
        """The live destinations' state (for metrics; `view` adds the waiting mail)."""
        now = time.time()
        suspended = self.hosts.snapshot(now)
        return [d.snapshot(now, suspended) for d in self.destinations.values()]

    def view(self) -> list[dict]:
        """`mtaqueue-ctl domains`: every destination with waiting mail or state to show."""
        return destinations_view(self.domains(), self.spool.messages.values(), self._busy)

    def _unqueue(self, predicate: Callable[[WorkItem], bool]) -> None:
        for destination in self.destinations.values():
            for item in destination.queue.remove(predicate):
                self._unbusy(item.message_id, item.indexes)

    def _spawn(self, coro) -> asyncio.Future:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _reusable(conn: SmtpConnection | None, pacing: config.Pacing) -> bool:
    """Whether the next message can go on `conn` (else a new connection is needed)."""
    return conn is not None and conn.usable and conn.transactions < pacing.messages_per_connection


def _earliest_due(message: Message) -> float | None:
    """When the next pending recipient is due (0 for one never tried); None if none."""
    dues = [r.next_attempt or 0.0 for r in message.recipients if r.state in PENDING]
    return min(dues) if dues and not message.held else None
