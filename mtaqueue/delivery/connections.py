"""The connection pool: the driver's side of the core's slots, and what each attempt got.

    Connections(registry, placement, outcomes, core, active, spool, tasks, clock)
    .configure(sender)
    .open(action) -> actions (async)      a Connect: the next host not tried for its slot
    .send(conn, item) -> actions (async)  a Send: one transaction on an open connection
    .give_up(conn) -> actions             a GiveUp: settle the item with its connect failure
    .close(conn)                          a Close: QUIT, the destination may retire
    .abort(conn)                          after a bug: drop the connection at once
    .quit_idle() / .in_transit()          a stop
    Retire(destination)                   an action of its own: retire once the rest is done
    .on_connect                           destination, seconds to open (metrics)

Shaped like KumoMTA's dispatcher: attempt a connection, deliver a message, close. Each
transaction's replies go to the core (the shaper's feedback) and to the settlement; recipients
a site's throttle refused go back to their queue uncharged. `clock` is the driver's, read after
each await.

On a server that pipelines, when a transaction's content is next the core is asked for the item
that would go on this connection next (`core.follow`): its MAIL, RCPTs and DATA are written
behind the final dot, and its `Send` reads their replies. One that was not written goes back
(`core.unfollow`); one written on a connection that then ended got no reply and goes back too
(`core.done`), uncharged. One held or deleted meanwhile cannot be taken back from a server
waiting for its content: the connection is dropped (no dot, no delivery).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..logs import get_logger
from ..policy.settle import Result, throttle_refused
from ..policy.verdict import DELIVERED, TRANSIENT
from ..scheduler.actions import Action, Connect
from ..scheduler.active import ActiveWindow
from ..scheduler.core import WAIT, Scheduler
from ..smtp.client import Follow, SmtpConnection
from ..smtp.pipeline import Ahead, Pending
from ..spool.message_file import CorruptMessageFile
from ..spool.store import Spool
from .changes import changed_since, learned_changes, relay_refused
from .destination import Destination, WorkItem
from .follower import written_ahead
from .outcomes import Outcomes, journal
from .placement import Placement
from .registry import Registry
from .sender import Sender, Suspended
from .tasks import Tasks

log = get_logger("delivery")


@dataclass(frozen=True, slots=True)
class Retire:
    """An action of the pool's for the driver, after the core's: forget `destination` if
    it is quiet (registry.retire)."""

    destination: Destination


Step = Action | Retire


@dataclass(slots=True)
class Link:
    """The driver's side of one of the core's connection slots."""

    destination: Destination
    item: WorkItem | None  # in a connect or a transaction; None while idle
    candidates: list[tuple[str, str]]  # (host, address) in order
    tried: int = 0  # of the candidates
    conn: SmtpConnection | None = None
    failures: list[Result] = field(default_factory=list)  # of the connects that failed


class Connections:
    def __init__(
        self,
        registry: Registry,
        placement: Placement,
        outcomes: Outcomes,
        core: Scheduler,
        active: ActiveWindow,
        spool: Spool,
        tasks: Tasks,
        clock: Callable[[], float],
    ) -> None:
        self.registry = registry
        self.placement = placement
        self.outcomes = outcomes
        self.core = core
        self.active = active
        self.spool = spool
        self.tasks = tasks
        self.clock = clock
        self.links: dict[int, Link] = {}  # the core's slots, by connection id
        self.on_connect: Callable[[str, float], None] | None = None

    def configure(self, sender: Sender) -> None:
        self.sender = sender

    def in_transit(self) -> bool:
        return any(link.item is not None for link in self.links.values())

    def quit_idle(self) -> None:
        for link in self.links.values():
            if link.conn is not None and link.item is None:
                self.tasks.spawn(link.conn.quit())

    def abort(self, conn: int) -> None:
        link = self.links.pop(conn, None)
        if link is not None and link.conn is not None:
            link.conn.abort()

    def close(self, conn: int) -> None:
        link = self.links.pop(conn, None)
        if link is not None and link.conn is not None:
            self.tasks.spawn(link.conn.quit())
        if link is not None:
            self.registry.retire(link.destination, self.clock())

    # -- attempt a connection ----------------------------------------------------------

    async def open(self, action: Connect) -> list[Action]:
        """Open one connection for the core: to the next host not tried for this slot."""
        now = self.clock()
        item: WorkItem = action.item
        link = self.links.get(action.conn)
        if link is None:  # the slot's first connect
            destination = self.registry.destinations[action.destination]
            message = self.spool.messages.get(item.message_id)
            families = self.placement.families(destination, item.route, now)
            candidates = self.sender.candidates(item.route, now, families, destination.source)
            if message is None or message.held or isinstance(candidates, Suspended):
                actions = self.core.abandon(now, action.conn)
                if isinstance(candidates, Suspended) and message is not None:
                    return actions + self._suspended(destination, item, candidates, now)
                self.active.free(item.message_id, item.indexes)
                return actions
            link = self.links[action.conn] = Link(destination, item, candidates)
        link.item = item
        host, ip = link.candidates[link.tried]
        link.tried += 1
        last_one = all(h == host for h, _ in link.candidates[link.tried :])
        # Another address of this host is next (its other family, say): the host is not
        # down, one path to it is; it is suspended only if that one fails too.
        same_host = any(h == host for h, _ in link.candidates[link.tried :])
        started = time.monotonic()
        destination = link.destination
        try:
            opened = await self.sender.connect(
                host,
                ip,
                item.route.port,
                last_one,
                destination.smarthost,
                item.route.sts,
                destination.source,
                suspend=not same_host,
                domain=item.route.tls_domain,
            )
        except Exception as exc:  # a bug: the attempt counts, as a local error
            log.exception("attempt_failed", id=item.message_id)
            self.links.pop(action.conn, None)
            now = self.clock()
            actions = self.core.abandon(now, action.conn)
            return actions + self.outcomes.attempt_failed(
                item.message_id, item.indexes, destination.key, exc, now
            )
        now = self.clock()
        if isinstance(opened, SmtpConnection):
            link.conn = opened
            latency = time.monotonic() - started
            if self.on_connect is not None:
                self.on_connect(destination.key, latency)
            actions = self.core.connected(now, action.conn, opened.handshake)
            learned_changes(destination, now)  # a latency round that slowed it
            return actions
        failed = self.sender.result(0, opened, host, ip)
        relay_refused(destination, host, ip, [failed])
        link.failures.append(failed)
        destination.record(now, opened)
        more = link.tried < len(link.candidates) and self.sender.tries_next(opened, last_one)
        before = destination.shaper.state(now)
        actions = self.core.connect_failed(
            now, action.conn, more_hosts=more, reply=opened, verdict=failed.verdict
        )
        changed_since(destination, before, now, actions)
        return actions

    def give_up(self, conn: int) -> list[Action]:
        """No further host for this item now: it is settled with the last connect failure
        (a failed attempt, as when every host failed), or goes back to the ready queue if
        that was the site's throttle: then what the core does next."""
        link = self.links.pop(conn)
        item, destination = link.item, link.destination
        assert item is not None
        reply = link.failures[-1].reply
        host, ip = link.failures[-1].remote_mta, link.failures[-1].ip
        results = [self.sender.result(i, reply, host, ip) for i in item.indexes]
        now = self.clock()
        requeued, actions = self._settle_item(destination, item, results, now)
        self.registry.retire(destination, now)
        return actions + self.core.tick(now) if requeued else actions

    def _suspended(
        self, destination: Destination, item: WorkItem, wait: Suspended, now: float
    ) -> list[Action]:
        """Every host is suspended: an internal wait, not an attempt, once; suspended
        again, that counts, with the reason (Postfix's "delivery temporarily
        suspended"), and the next try follows the retry schedule. Unless the suspensions
        are its source's and another source of its pool may reach a host: it goes there
        now (mail queued behind a source that a host refused must not wait for it)."""
        if self.placement.another_source_reaches(destination, item, now):
            return self.placement.replace(destination, [item], now)
        if self.active.uncharged_wait(item.message_id):
            self.active.free(item.message_id, item.indexes)
            return self.outcomes.schedule(item.message_id, wait.until, now, WAIT)
        results = [self.sender.result(i, wait.reply, None, None) for i in item.indexes]
        return self.outcomes.finish(
            item.message_id, item.indexes, results, destination=destination.key, now=now
        )

    # -- deliver a message -------------------------------------------------------------

    async def send(self, conn: int, item: WorkItem) -> list[Step]:
        """One transaction on an open connection, for the core."""
        link = self.links[conn]
        link.item = item
        destination = link.destination
        message = self.spool.messages.get(item.message_id)
        assert link.conn is not None and link.conn.pipeline is not None
        now = self.clock()
        written = link.conn.pipeline.ahead is not None  # its MAIL..DATA went behind a dot
        if message is None or message.held:
            self.active.free(item.message_id, item.indexes)
            if written:  # the server waits for its content: only a drop ends that
                link.conn.abort()
            return self._done(conn, link, [], now, reusable=False if written else None)
        families = self.placement.families(destination, item.route, now)
        if not written and not self.sender.fits(
            link.conn, item.route, now, families, destination.source
        ):
            # An idle connection to a host since suspended, or not of this route: the
            # item goes back to its queue and waits for a connection of its own.
            actions = self._done(conn, link, [], now, reusable=False)
            return actions + self.core.enqueue(now, destination.key, item, item.klass)
        try:
            content = self.spool.content(item.message_id)  # small, in the page cache
        except (OSError, CorruptMessageFile) as exc:
            log.error("message_unreadable", id=item.message_id, error=str(exc))
            self.active.free(item.message_id, item.indexes)
            journal(self.spool.remove(item.message_id, f"unreadable: {exc}"), item.message_id)
            if written:
                link.conn.abort()
            return self._done(conn, link, [], now, reusable=False if written else None)
        followed: list[bool] = []
        later: list[Step] = []  # what the core decided when a follower went back
        try:
            follow = self._follower(conn, link, followed, later)
            results = await self.sender.transaction(
                link.conn, message, item.indexes, content, follow
            )
            if followed and link.conn.pipeline.ahead is None:  # it was not written
                later += self.core.unfollow(self.clock(), conn)
            host = link.candidates[link.tried - 1][0]  # the one this connection went to
            self.sender.judge_host(host, item.route.port, link.conn.ip, results, destination.source)
        except Exception as exc:
            log.exception("attempt_failed", id=item.message_id)
            link.conn.abort()
            now = self.clock()
            actions = self._done(conn, link, [], now, reusable=False)
            return actions + self.outcomes.attempt_failed(
                item.message_id, item.indexes, destination.key, exc, now
            )
        now = self.clock()
        relay_refused(destination, link.conn.host, link.conn.ip, results)
        for result in {id(r.reply): r for r in results}.values():
            destination.record(now, result.reply)
        _, actions = self._settle_item(destination, item, results, now)
        return later + actions + self._done(conn, link, results, now)

    def _follower(self, conn: int, link: Link, followed: list[bool], later: list[Step]) -> Follow:
        """What the client asks for when a transaction's content is next: the core's next
        item for this connection, made into its transaction for this hop (`followed` gets
        True when the core gave one); None, and the item back, if it cannot go behind."""

        async def follow(pending: Pending) -> Ahead | None:
            assert link.conn is not None and link.conn.pipeline is not None
            item = self.core.follow(self.clock(), conn, link.conn.pipeline.timed())
            if item is None:
                return None
            followed.append(True)
            assert isinstance(item, WorkItem)
            ahead = await written_ahead(
                link.conn,
                item,
                link.destination,
                self.spool,
                self.placement,
                self.sender,
                self.clock(),
            )
            if ahead is None:
                later.extend(self.core.unfollow(self.clock(), conn))
                followed.clear()
            return ahead

        return follow

    def _done(
        self,
        conn: int,
        link: Link,
        results: list[Result],
        now: float,
        reusable: bool | None = None,
    ) -> list[Step]:
        """Tell the core a transaction is over (its replies are the shaper's feedback)."""
        assert link.conn is not None
        usable = self.sender.reusable(link.conn) if reusable is None else reusable
        if not usable:
            self.links.pop(conn, None)
            self.tasks.spawn(link.conn.quit())
        link.item = None
        destination = link.destination
        before = destination.shaper.state(now)
        try:
            replies = [(r.reply, r.verdict) for r in results]
            timings = link.conn.pipeline.timed() if link.conn.pipeline is not None else ()
            actions = self.core.done(now, conn, reusable=usable, replies=replies, timings=timings)
        except Exception:  # pacing is advice: what the attempt got is recorded already
            log.exception("feedback_failed", destination=destination.key)
            actions = []
        changed_since(destination, before, now, actions)
        # The connection is gone: the destination may retire, once what the core asked
        # for meanwhile is done (a settlement may queue work there again).
        return actions if usable else [*actions, Retire(destination)]

    # -- what the attempt got ----------------------------------------------------------

    def _settle_item(
        self, destination: Destination, item: WorkItem, results: list[Result], now: float
    ) -> tuple[bool, list[Action]]:
        """Settle a work item's attempt, its retries scaled by the destination's mode.
        Recipients refused by the site's throttle go back to the destination's ready queue
        uncharged (policy/settle.py `throttle_refused`), behind the cool-down that the
        core's next event starts (the caller reports the replies to it next): whether any
        did, and what settling asked for."""
        self._count_warmup(destination, results, now)
        refusals = self.active.refusals(item.message_id)
        back, results = throttle_refused(results, refusals)
        again, results, moved, actions = self.placement.reroute_refused(
            destination, item, results, now
        )
        if again:
            self.active.refused(item.message_id, refusals + 1)
            indexes = [r.index for r in again]
            refused = WorkItem(item.message_id, indexes, item.route, item.klass, item.tenant)
            actions += self.placement.replace(destination, [refused], now)
        if results:
            actions += self.outcomes.finish(
                item.message_id,
                [r.index for r in results],
                results,
                retry_factor=destination.shaper.retry_factor(now),
                destination=destination.key,
                now=now,
            )
        if not (back or again) and all(r.verdict.outcome == DELIVERED for r in results):
            destination.waiting.discard(item.message_id)  # done here (the sweep: the rest)
        if back:
            self.active.refused(item.message_id, refusals + 1)
            indexes = [r.index for r in back]
            log.info(
                "requeued",
                id=item.message_id,
                destination=destination.key,
                rcpts=len(indexes),
                refusals=refusals + 1,
                reason=back[0].reply.line(),
            )
            again_item = WorkItem(item.message_id, indexes, item.route, item.klass, item.tenant)
            self.core.enqueue(now, destination.key, again_item, item.klass, item.tenant, run=False)
        return bool(back or again or moved), actions

    def _count_warmup(self, destination: Destination, results: list[Result], now: float) -> None:
        """A warming source's message to its destination, for the day's allowance (accepted
        for at least one recipient) or for its deferral rate (deferred, none accepted)."""
        source = destination.source
        if source is None or not source.warmup:
            return
        outcomes = {r.verdict.outcome for r in results}
        if DELIVERED in outcomes or TRANSIENT in outcomes:
            self.placement.egress.warmup.record(
                destination.base, source, now, DELIVERED in outcomes
            )
        self.placement.log_ramps()
