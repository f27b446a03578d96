"""Where due mail goes: grouped by next hop, routed, and queued at a (source, destination).

    Placement(spool, active, registry, outcomes, core, resolver, egress, revalidation, rng)
    .configure(cfg, sender, policies, pools, relays, order)   a start or a reload
    .group(message_ids, now) -> (batch, actions)   due recipients by next hop (one lookup
                                                   per hop, not per message)
    .resolve(hop, relay, work) -> Resolved (async)  MX lookup, MTA-STS applied
    .queue(hop, relay, work, resolved, now) -> actions   work items at their destinations
    .place(items, base, domain, domains, relay, now) -> actions   at the pool's source
    .replace(destination, items, now) / .replace_queued(key, now) -> actions
    .reroute_refused(destination, item, results, now) -> (again, rest, moved, actions)
    .families(destination, route, now) -> {4, 6}
    .warm: WarmWaits                                mail waiting for a warm-up's next day

A message whose class or tenant has a smarthost goes there whole; mail of a class or
tenant with a source pool is queued at one of the pool's sources (policy/egress.py's
choice): each (source, destination) is a destination of its own. A source that draws a
blocklist reply leaves that destination's share of the pool; a site that refuses our
IPv6 gets IPv4 from then on. A warming source takes a destination's mail up to the day's
allowance; over it, mail goes to the pool's others or waits for the next day.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import msgspec

from .. import config
from ..logs import get_logger
from ..model import PENDING, Message
from ..policy.egress import EgressState
from ..policy.replies import Reply
from ..policy.settle import THROTTLE_REQUEUES, Result
from ..policy.verdict import IPV6, REFUSES_SOURCE
from ..routing.nexthop import NextHop, next_hop
from ..routing.pools import Pool, Pools, Source, family_of
from ..routing.relays import Relay, Relays, unrouted
from ..routing.resolver import Resolver, Route, RouteFailure
from ..scheduler.actions import Action
from ..scheduler.active import ActiveWindow
from ..scheduler.core import WAIT, WARMUP, Scheduler
from ..smtp.addresses import domain_of
from ..spool.store import Spool
from .destination import Destination, WorkItem, destination_key, sourced
from .mta_sts import Policies, restricted
from .outcomes import Outcomes
from .registry import Registry
from .revalidation import Revalidation
from .sender import Sender
from .warm_waits import WarmWaits

log = get_logger("delivery")

# A batch of due mail, by where it goes: a next hop, and the smarthost it is (or None).
Hop = tuple[NextHop, Relay | None]
Work = list[tuple[Message, list[int]]]


@dataclass(slots=True)
class Resolved:
    route: Route | RouteFailure | None  # None: the lookup raised `failure` (a bug)
    plain: Route | RouteFailure | None  # own MX hosts: the route before MTA-STS
    failure: Exception | None = None


class Placement:
    def __init__(
        self,
        spool: Spool,
        active: ActiveWindow,
        registry: Registry,
        outcomes: Outcomes,
        core: Scheduler,
        resolver: Resolver,
        egress: EgressState,
        revalidation: Revalidation,
        rng: random.Random,
    ) -> None:
        self.spool = spool
        self.active = active
        self.registry = registry
        self.outcomes = outcomes
        self.core = core
        self.resolver = resolver
        self.egress = egress
        self.revalidation = revalidation
        self.rng = rng
        self.warm = WarmWaits()
        self.closing = False

    def configure(
        self,
        cfg: config.Config,
        sender: Sender,
        policies: Policies,
        pools: Pools,
        relays: Relays,
        order: list[str],
    ) -> None:
        """`order`: the class names, the first class first (policy/fairness.class_order)."""
        self.cfg, self.sender, self.policies = cfg, sender, policies
        self.pools, self.relays = pools, relays
        self.class_rank = {name: rank for rank, name in enumerate(order)}

    # -- due mail, by next hop ---------------------------------------------------------

    def group(self, message_ids: list[str], now: float) -> tuple[dict[Hop, Work], list[Action]]:
        """Everything due now, grouped by next hop: one lookup each, not one per message
        (a restart can make thousands due in the same moment)."""
        batch: dict[Hop, Work] = {}
        actions: list[Action] = []
        for message_id in message_ids:
            try:
                self._dispatch(message_id, now, batch)
            except Exception as exc:  # one bad record must not stop all delivery
                log.exception("dispatch_failed", id=message_id)
                self.active.busy.pop(message_id, None)
                actions += self.outcomes.retry_later(message_id, None, exc, now)
        return batch, actions

    def _dispatch(self, message_id: str, now: float, batch: dict[Hop, Work]) -> None:
        """Add the message's due recipients to `batch`, grouped by next hop: all of them
        to its class's or tenant's smarthost if it has one, else each by its domain."""
        self.active.admitted.discard(message_id)
        message = self.spool.messages.get(message_id)
        if message is None or message.held or self.closing:
            return
        busy = self.active.occupy(message_id)
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
            del self.active.busy[message_id]
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

    async def resolve(self, hop: NextHop, relay: Relay | None, work: Work) -> Resolved:
        """The hop's route: own MX hosts with their MTA-STS policy applied."""
        try:
            if _own_mx(hop, relay, work):  # RFC 8461 is about a domain's own MX hosts
                plain, sts = await asyncio.gather(
                    self.resolver.route(hop), self.policies.applied(hop.host)
                )
                if isinstance(plain, Route):
                    plain = msgspec.structs.replace(plain, own_mx=True)
                route = restricted(plain, sts)
                if isinstance(route, Route):
                    route = msgspec.structs.replace(route, tls_domain=hop.host, own_mx=True)
                return Resolved(route, plain)
            return Resolved(await self.resolver.route(hop), None)
        except Exception as exc:
            log.exception("routing_failed", hop=hop.host)
            return Resolved(None, None, exc)

    def queue(
        self, hop: NextHop, relay: Relay | None, work: Work, resolved: Resolved, now: float
    ) -> list[Action]:
        """Queue the hop's work at its destinations; then the core may send it."""
        route, plain = resolved.route, resolved.plain
        if relay is not None and isinstance(route, RouteFailure):
            route = unrouted(relay, route)
        # By class, then by arrival: a source's warm-up allowance goes to the work queued
        # first, and mail that waited for the next day comes back in one batch. Arrival, not
        # the batch's order: routes of messages accepted apart resolve concurrently and may
        # end out of order, so the order they began to wait is not their age.
        rank = self.class_rank
        work.sort(key=lambda entry: (rank.get(entry[0].klass, 0), entry[0].created))
        actions: list[Action] = []
        for message, indexes in work:
            try:
                if route is None:
                    actions += self.outcomes.retry_later(message.id, indexes, resolved.failure, now)
                else:
                    # RFC 8460 3: a report is delivered despite TLS failures, uncounted.
                    report = message.tls_report and plain is not None
                    chosen = plain if report and plain is not None else route
                    actions += self._queue(message, hop, relay, indexes, chosen, now)
            except Exception as exc:
                log.exception("routing_failed", id=message.id, hop=hop.host)
                actions += self.outcomes.retry_later(message.id, indexes, exc, now)
        return actions + self.core.tick(now)  # the batch is queued: it may go

    def _queue(
        self,
        message: Message,
        hop: NextHop,
        relay: Relay | None,
        indexes: list[int],
        route: Route | RouteFailure,
        now: float,
    ) -> list[Action]:
        if isinstance(route, RouteFailure):
            reply = Reply("dns", 0, route.status, route.text, network=route.network)
            results = [self.sender.result(i, reply, None, None) for i in indexes]
            name = relay.key if relay is not None else hop.host
            return self.outcomes.finish(message.id, indexes, results, destination=name, now=now)
        domain = domain_of(message.recipients[indexes[0]].address)
        base = destination_key(domain, route, self.cfg.shaping.group_by, relay)
        size = self.cfg.delivery.max_recipients_per_transaction
        items = [
            WorkItem(message.id, indexes[i : i + size], route, message.klass, message.tenant)
            for i in range(0, len(indexes), size)
        ]
        domains = {domain_of(message.recipients[i].address) for i in indexes}
        return self.place(items, base, domain, domains, relay, now)

    # -- at which source ---------------------------------------------------------------

    def place(
        self,
        items: list[WorkItem],
        base: str,
        domain: str,
        domains: set[str],
        relay: Relay | None,
        now: float,
    ) -> list[Action]:
        """Queue work for destination `base`: each item at the source its class's or
        tenant's pool picks (none: the default source), unless no source may send there."""
        actions: list[Action] = []
        for item in items:
            pool = self.pools.for_message(item.klass, item.tenant)
            source = None if pool is None else self._source_for(pool, base, item.route, now)
            if pool is not None and source is None:
                actions += self._no_source(item, pool, base, now)
                continue
            key = sourced(base, source)
            destination = self.registry.destinations.get(key)
            if destination is None:
                destination = self.registry.create(key, domain, item.route, relay, now, source)
            destination.domains.update(domains)
            destination.waiting.add(item.message_id)
            self.core.enqueue(now, key, item, item.klass, item.tenant, run=False)
        self.log_ramps()
        return actions

    def _source_for(self, pool: Pool, base: str, route: Route, now: float) -> Source | None:
        """The pool's source for mail to `base`: of those that may reach one of its hosts
        (host suspensions are per source), if any may; else of them all (the mail then
        waits for a host's release, as for one source)."""
        families = self.egress.families(base, _addresses(route), now)
        reach = [s for s in pool.sources if not self.sender.all_suspended(route, now, s)]
        destinations, busy = self.registry.destinations, self.active.busy

        def load(source: Source) -> int:
            key = sourced(base, source)
            if key not in destinations:
                return 0
            return sum(self.core.waiting(key).values()) + self.core.slots(key)[0]

        def placed(source: Source) -> int:
            """Messages queued at (source, base) or on their way: still active. (Not its
            connections: an idle one carries nothing, one opening carries an item.)"""
            destination = destinations.get(sourced(base, source))
            return 0 if destination is None else len(destination.waiting & busy.keys())

        return self.egress.choose(reach or pool.sources, base, families, load, now, placed)

    def _no_source(self, item: WorkItem, pool: Pool, base: str, now: float) -> list[Action]:
        """No source of the pool may send to `base`: every one of the families it has is
        out after a blocklist reply (an internal wait until the first comes back, once),
        or none is of its families (a failed attempt: the operator's pool or its DNS)."""
        families = self.egress.families(base, _addresses(item.route), now)
        back = self.egress.usable_after(pool.sources, base, families, now)
        if self.egress.warming(pool.sources, base, families, now):
            # Always uncharged: the schedule ends, and the wait is the point of warming.
            until = self.warm.wait(base, item.message_id, now, self.rng, pool.warmup_spread, back)
            log.info("warmup_wait", id=item.message_id, destination=base, until=until)
            self.active.free(item.message_id, item.indexes)
            return self.outcomes.schedule(item.message_id, until, now, WARMUP)
        if back is not None and self.active.uncharged_wait(item.message_id):
            self.active.free(item.message_id, item.indexes)
            return self.outcomes.schedule(item.message_id, back, now, WAIT)
        if back is not None:
            text = f"every source of pool {pool.name} is blocklisted at {base}"
        else:
            wanted = "/".join(f"IPv{f}" for f in sorted(families)) or "no address"
            text = f"pool {pool.name} has no source for {base} ({wanted})"
        reply = Reply("connect", 0, "4.4.0" if back is None else "4.7.1", text, network="local")
        return self.outcomes.charge(item.message_id, item.indexes, reply, base, now)

    def another_source_reaches(self, destination: Destination, item: WorkItem, now: float) -> bool:
        if destination.source is None:
            return False
        pool = self.pools.for_message(item.klass, item.tenant)
        return pool is not None and any(
            source != destination.source and not self.sender.all_suspended(item.route, now, source)
            for source in pool.sources
        )

    def replace(self, destination: Destination, items: list[WorkItem], now: float) -> list[Action]:
        """Queue items of `destination` again at its base (another source, perhaps)."""
        domain = min(destination.domains) if destination.domains else destination.base
        domains = set(destination.domains)
        return self.place(items, destination.base, domain, domains, destination.relay, now)

    def replace_queued(self, key: str, now: float) -> list[Action]:
        """Place the mail queued at destination `key` again (its source's pool chooses)."""
        destination = self.registry.destinations.get(key)
        if destination is None:
            return []
        queued = self.core.remove(now, lambda _: True, key)
        destination.waiting.difference_update(item.message_id for item in queued)
        return self.replace(destination, queued, now)

    def reroute_refused(
        self, destination: Destination, item: WorkItem, results: list[Result], now: float
    ) -> tuple[list[Result], list[Result], bool, list[Action]]:
        """Split off the results to send again at once, uncharged (then the rest, to
        settle, whether waiting mail moved, and what moving it asked for): those refused
        for our source (a blocklist reply: the source leaves the destination, its waiting
        mail and these go to the pool's others) or for our IPv6 address (a site that wants
        IPv4 gets it from now on), when another source or IPv4 is there to take them, and
        not THROTTLE_REQUEUES times in a row already."""
        base, source = destination.base, destination.source
        pool = self.pools.for_message(item.klass, item.tenant) if source is not None else None
        blocked = [r for r in results if r.verdict.kind in REFUSES_SOURCE] if pool else []
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
        # What waits there goes to the pool's other sources (or IPv4) now.
        actions = self.replace_queued(destination.key, now) if moved else []
        refused = blocked + ipv6
        if not refused or self.active.refusals(item.message_id) >= THROTTLE_REQUEUES:
            return [], results, moved, actions
        if pool is not None:
            elsewhere = self._source_for(pool, base, item.route, now) is not None
        else:
            elsewhere = 4 in self.egress.families(base, _addresses(item.route), now)
        if not elsewhere:
            return [], results, moved, actions
        ids = {id(r) for r in refused}
        return refused, [r for r in results if id(r) not in ids], moved, actions

    def families(self, destination: Destination, route: Route, now: float) -> set[int]:
        """The address families a connection of `destination` may use: its source's, or
        those of its route (IPv4 alone for a site that refused our IPv6)."""
        if destination.source is not None:
            return {destination.source.family}
        return self.egress.families(destination.base, _addresses(route), now)

    def log_ramps(self) -> None:
        """Log the warm-up day ends that the policy came across."""
        for step in self.egress.warmup.drain():
            fields = msgspec.structs.asdict(step)
            held = fields.pop("held")
            (log.warning if held else log.info)(
                "warmup_held" if held else "warmup_advanced", **fields
            )


def _own_mx(hop: NextHop, relay: Relay | None, work: Work) -> bool:
    """Whether the hop is the recipients' domain's own MX lookup: not a smarthost, a
    relayhost or a route elsewhere (the operator's choice of next hop, outside MTA-STS)."""
    message, indexes = work[0]
    domain = domain_of(message.recipients[indexes[0]].address)
    return relay is None and hop.mx and hop.host == domain


def _addresses(route: Route) -> list[str]:
    return [address for host in route.hosts for address in host.addresses]
