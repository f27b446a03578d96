"""The queue manager: when each message is due, and who delivers it.

Data path: a due message's pending recipients are grouped by next hop into work
items; each destination (next hop) has ready queues, one per class priority, and
up to `delivery.max_per_destination` workers. A worker keeps its connection open
for the next item to the same server (up to `max_messages_per_connection`, idle
`connection_idle`). An attempt's replies go through the pure policy (classify,
settle) and the results back to the spool (journal), the log, DSNs and the
suppression list.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field

import structlog

from .. import config
from ..dsn import build_dsn, is_8bit
from ..model import DEFERRED, QUEUED, Message, Recipient
from ..policy.backoff import RetryPolicy, restart_due
from ..policy.classify import classify, compile_rules
from ..policy.hosts import HostSuspensions
from ..policy.replies import Reply
from ..policy.settle import Result, Settlement, SettleSettings, expire_due, settle
from ..routing.nexthop import NextHop, next_hop
from ..routing.resolver import Resolver, Route, RouteFailure
from ..smtp.addresses import domain_of
from ..smtp.client import ClientSettings, ConnectFailed, SmtpConnection
from ..spool.message_file import CorruptMessageFile
from ..spool.store import Spool

log = structlog.get_logger("delivery")

EXPIRY_CHECK = 30.0  # seconds between sweeps for mail whose lifetime has passed
PENDING = (QUEUED, DEFERRED)


@dataclass(slots=True)
class WorkItem:
    message_id: str
    hop: NextHop
    indexes: list[int]


@dataclass(slots=True)
class Destination:
    hop: NextHop
    ready: dict[int, deque[WorkItem]] = field(default_factory=dict)  # priority -> items
    workers: int = 0
    idle: int = 0  # workers holding an open connection, waiting for the next item
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, priority: int, item: WorkItem) -> None:
        self.ready.setdefault(priority, deque()).append(item)
        self.arrived.set()

    def pop(self) -> WorkItem | None:
        for priority in sorted(self.ready):
            queue = self.ready[priority]
            if queue:
                return queue.popleft()
        return None

    def __len__(self) -> int:
        return sum(map(len, self.ready.values()))


class DeliveryManager:
    def __init__(
        self,
        cfg: config.Config,
        spool: Spool,
        resolver: Resolver,
        hostname: str,
        rng: random.Random | None = None,
    ) -> None:
        self.cfg = cfg
        self.spool = spool
        self.resolver = resolver
        self.hostname = hostname
        self.rng = rng or random.Random()
        d = cfg.delivery
        self.client = ClientSettings(d.helo_name or hostname, d.timeouts, d.tls)
        self.rules = compile_rules(d.rules)
        self.hosts = HostSuspensions(d.host_suspend, d.host_suspend_max)
        retry = RetryPolicy.from_config(cfg.retry)
        self.settle_settings = {
            name: SettleSettings(
                retry=retry,
                lifetime=c.lifetime,
                expire_action=c.expire_action,
                delay_after=cfg.dsn.delay_after,
                delay_without_notify=cfg.dsn.delay_without_notify,
            )
            for name, c in cfg.classes.items()
        }
        self.priority = {name: c.priority for name, c in cfg.classes.items()}
        self.destinations: dict[NextHop, Destination] = {}
        self.active_workers = 0
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._inflight: dict[str, set[int]] = {}  # message id -> recipients being attempted
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    # -- life ------------------------------------------------------------------------

    def start(self) -> None:
        """Schedule the queue (overdue mail spread over retry.restart_spread) and run."""
        now = time.time()
        spread = self.cfg.retry.restart_spread
        for message in self.spool.messages.values():
            due = _earliest_due(message)
            if due is not None:
                self._schedule(message.id, restart_due(due, now, spread, self.rng))
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
            while self._heap and self._heap[0][0] <= now:
                _, _, message_id = heapq.heappop(self._heap)
                self._dispatch(message_id, now)
            timeout = self._heap[0][0] - now if self._heap else None
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def _expiry_sweep(self) -> None:
        while not self._closing:
            await asyncio.sleep(EXPIRY_CHECK)
            now = time.time()
            for message in list(self.spool.messages.values()):
                if self._inflight.get(message.id):
                    continue
                settlement = expire_due(message, now, self.settle_settings[message.klass])
                if settlement is not None:
                    self._apply(settlement, now)

    # -- dispatch ----------------------------------------------------------------------

    def _dispatch(self, message_id: str, now: float) -> None:
        message = self.spool.messages.get(message_id)
        if message is None or message.held or self._closing:
            return
        busy = self._inflight.setdefault(message_id, set())
        groups: dict[NextHop, list[int]] = {}
        d = self.cfg.delivery
        for i, rcpt in enumerate(message.recipients):
            if rcpt.state in PENDING and i not in busy and (rcpt.next_attempt or 0) <= now:
                hop = next_hop(domain_of(rcpt.address), d.relayhost, self.cfg.routes, d.port)
                groups.setdefault(hop, []).append(i)
        if not groups and not busy:
            del self._inflight[message_id]
            return
        priority = self.priority.get(message.klass, 1)
        size = d.max_recipients_per_transaction
        for hop, indexes in groups.items():
            busy.update(indexes)
            destination = self.destinations.get(hop)
            if destination is None:
                destination = self.destinations[hop] = Destination(hop)
            for start in range(0, len(indexes), size):
                destination.push(priority, WorkItem(message_id, hop, indexes[start : start + size]))
            self._staff(destination)

    def _staff(self, destination: Destination) -> None:
        d = self.cfg.delivery
        while (
            len(destination) > destination.idle
            and destination.workers < d.max_per_destination
            and self.active_workers < d.max_connections
        ):
            destination.workers += 1
            self.active_workers += 1
            self._spawn(self._worker(destination))

    async def _worker(self, destination: Destination) -> None:
        conn: SmtpConnection | None = None
        try:
            while not self._closing:
                item = destination.pop()
                if item is None:
                    if conn is None:
                        break
                    destination.arrived.clear()
                    destination.idle += 1
                    try:
                        await asyncio.wait_for(
                            destination.arrived.wait(), self.cfg.delivery.connection_idle
                        )
                    except TimeoutError:
                        break
                    finally:
                        destination.idle -= 1
                    continue
                conn = await self._attempt(item, conn)
        finally:
            if conn is not None:
                await conn.quit()
            destination.workers -= 1
            self.active_workers -= 1
            if not destination.workers and not len(destination):
                self.destinations.pop(destination.hop, None)
            self._restaff()

    def _restaff(self) -> None:
        """A connection slot came free: give it to a destination with waiting mail."""
        for destination in list(self.destinations.values()):
            if len(destination):
                self._staff(destination)

    # -- one attempt --------------------------------------------------------------------

    async def _attempt(self, item: WorkItem, conn: SmtpConnection | None) -> SmtpConnection | None:
        message = self.spool.messages.get(item.message_id)
        busy = self._inflight.get(item.message_id, set())
        if message is None or message.held:
            busy.difference_update(item.indexes)
            return conn
        route = await self.resolver.route(item.hop)
        if isinstance(route, RouteFailure):
            reply = Reply("dns", 0, route.status, route.text, network="dns")
            results = [self._result(i, reply, None, None) for i in item.indexes]
            self._finish(item, results)
            return conn
        try:
            content = self.spool.content(item.message_id)  # small, in the page cache
        except (OSError, CorruptMessageFile) as exc:
            log.error("message_unreadable", id=item.message_id, error=str(exc))
            busy.difference_update(item.indexes)
            self.spool.remove(item.message_id, f"unreadable: {exc}")
            return conn
        results, conn, waited_until = await self._send(message, item, route, content, conn)
        if waited_until is not None:
            # Every host is suspended: an internal wait, not an attempt. Nothing is charged.
            busy.difference_update(item.indexes)
            self._schedule(item.message_id, waited_until)
            return conn
        self._finish(item, results)
        return conn

    async def _send(
        self,
        message: Message,
        item: WorkItem,
        route: Route,
        content: bytes,
        conn: SmtpConnection | None,
    ) -> tuple[list[Result], SmtpConnection | None, float | None]:
        """Try the route's hosts in order until one takes the transaction."""
        now = time.time()
        d = self.cfg.delivery
        hosts = [h for h in route.hosts if not self.hosts.suspended(h.name, now)]
        if not hosts:
            release = self.hosts.next_release([h.name for h in route.hosts], now)
            return [], conn, release or now + d.host_suspend
        if conn is not None and not (
            conn.usable
            and conn.transactions < d.max_messages_per_connection
            and any(conn.ip in h.addresses for h in hosts)
        ):
            await conn.quit()
            conn = None
        last: Reply | None = None
        last_host = None
        candidates = [(h, ip) for h in hosts for ip in h.addresses]
        if conn is not None:  # the open connection first
            candidates.sort(key=lambda c: c[1] != conn.ip)
        for host, ip in candidates:
            if conn is None or conn.ip != ip:
                if conn is not None:
                    await conn.quit()
                conn = await self._connect(host.name, ip, route.port)
                if isinstance(conn, Reply):
                    last, last_host, conn = conn, host.name, None
                    continue
            results = await self._transaction(conn, message, item.indexes, content)
            self.hosts.succeeded(host.name)
            if not conn.usable:
                await conn.quit()
                conn = None
            return results, conn, None
        assert last is not None
        return [self._result(i, last, last_host, None) for i in item.indexes], None, None

    async def _connect(self, host: str, ip: str, port: int) -> SmtpConnection | Reply:
        now = time.time()
        try:
            return await SmtpConnection.open(host, ip, port, self.client)
        except ConnectFailed as failed:
            if failed.reply.phase == "starttls" and self.client.tls == "opportunistic":
                try:  # opportunistic TLS: a broken handshake falls back to clear text
                    return await SmtpConnection.open(host, ip, port, self.client, use_tls=False)
                except ConnectFailed as again:
                    failed = again
            verdict = classify(failed.reply, self.rules)
            if verdict.scope in ("host", "destination"):
                until = self.hosts.failed(host, now)
                log.warning(
                    "host_suspended", host=host, ip=ip, until=until, reply=failed.reply.line()
                )
            return failed.reply

    async def _transaction(
        self, conn: SmtpConnection, message: Message, indexes: list[int], content: bytes
    ) -> list[Result]:
        """Send to these recipients; those refused as "too many" go in further transactions
        on the same connection (RFC 5321 4.5.3.1.10), as long as each one makes progress."""
        results: list[Result] = []
        pending = list(indexes)
        while pending:
            rcpts = [message.recipients[i] for i in pending]
            replies = await conn.send(message, rcpts, content, self.cfg.delivery.timeouts)
            outcomes = [
                self._result(i, reply, conn.host, conn.ip, relayed=not conn.dsn)
                for i, reply in zip(pending, replies, strict=True)
            ]
            again = [r.index for r in outcomes if r.verdict.kind == "too_many_recipients"]
            if not again or len(again) == len(pending) or not conn.usable:
                return results + outcomes
            results += [r for r in outcomes if r.verdict.kind != "too_many_recipients"]
            pending = again
        return results

    def _result(
        self,
        index: int,
        reply: Reply,
        host: str | None,
        ip: str | None,
        *,
        relayed: bool = False,
    ) -> Result:
        verdict = classify(reply, self.rules, ambiguous_policy=self.cfg.delivery.ambiguous)
        return Result(index, reply, verdict, host, ip, dsn_relayed=relayed)

    # -- after an attempt -----------------------------------------------------------------

    def _finish(self, item: WorkItem, results: list[Result]) -> None:
        busy = self._inflight.get(item.message_id, set())
        busy.difference_update(item.indexes)
        message = self.spool.messages.get(item.message_id)
        if message is None:
            return
        now = time.time()
        settlement = settle(message, results, now, self.rng, self.settle_settings[message.klass])
        self._apply(settlement, now)

    def _apply(self, settlement: Settlement, now: float) -> None:
        message = settlement.message
        for event in settlement.events:
            name = event.pop("event")
            log.info(name, **event)
        for kind, reports in (
            ("failure", settlement.failed),
            ("delay", settlement.delayed),
            ("success", settlement.succeeded),
        ):
            if reports:
                self._notify(message, reports, kind, now)
        if self.cfg.suppression.enabled:
            for address, reason in settlement.suppress:
                self.spool.suppress(address, now + self.cfg.suppression.ttl, reason)
                log.info("suppressed", address=address, reason=reason)
        busy = self._inflight.get(message.id)
        if settlement.finished and not busy:
            self._inflight.pop(message.id, None)
            self.spool.remove(message.id, "done")
            return
        self.spool.update(message)
        due = _earliest_due(message)
        if due is not None:
            self._schedule(message.id, due)

    def _notify(self, message: Message, reports: list, kind: str, now: float) -> None:
        """Queue a DSN to the sender (never for the null sender: wants_notice checked)."""
        try:
            original = self.spool.content(message.id)
        except (OSError, CorruptMessageFile):
            original = b""
        dsn_id = self.spool.ids.next(now)
        content = build_dsn(
            message,
            reports,
            original,
            reporting_mta=self.hostname,
            now=now,
            max_return=self.cfg.dsn.max_return,
            dsn_id=dsn_id,
        )
        notice = Message(
            id=dsn_id,
            sender="",
            recipients=(Recipient(message.sender),),
            created=now,
            size=len(content),
            klass=self.cfg.dsn.klass,
            expires=now + self.cfg.dsn.lifetime,
            body="8BITMIME" if is_8bit(content) else "7BIT",
            smtputf8=not message.sender.isascii(),
            client="",
            helo=self.hostname,
        )
        self.spool.accept(notice, content)
        log.info("dsn_queued", id=dsn_id, kind=kind, about=message.id, to=message.sender)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _earliest_due(message: Message) -> float | None:
    """When the next pending recipient is due (0 for one never tried); None if none."""
    dues = [r.next_attempt or 0.0 for r in message.recipients if r.state in PENDING]
    return min(dues) if dues and not message.held else None
