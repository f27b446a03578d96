"""The live destinations, what destinations taught, and the operator's standing steers.

    Registry(core, spool)
    .destinations: dict[str, Destination]     live, by key
    .learned: dict[str, Learned]              lessons of destinations not live now
    .out_of_step: OutOfStep                   hosts spoken to in lock-step (learned too)
    .configure(cfg, relays_by_key, smarthosts, now)   a start or a reload: new pacing
    .create(key, domain, route, relay, now, source) -> Destination
    .retire(destination, now)                 forget one with nothing to do or remember
    .tidy(destination)                        drop the ids of mail gone; its domains past
                                              their cap to those with mail there
    .prune(now)                               drop standing steers whose time is over
    .sizes() -> {name: entries}               its maps' sizes (memory_sizes)
    .relay_named(key) -> Relay | None         the smarthost a destination key is
    .matching(name) -> [Destination]          an operator's name (key, or a domain)
    .steer(name, apply, now) -> [key]         a limit or backoff, now and for later ones
    .forget_learned(name, now) -> int
    .learned_data(now) -> bytes               the learned.json state file (both)
    .domains(now, sender, egress) -> [dict]   state of each live destination

A destination appears when mail is routed to it and goes when it is quiet; its learned
limits outlive it (rate_learner.kept decides for how long: at most FORGET, 7 days, without
traffic), LEARNED_KEPT of them at most, those with the latest traffic.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import config
from ..logs import get_logger
from ..model import PENDING, Message
from ..policy import rate_learner
from ..policy.egress import EgressState
from ..policy.pacing_rules import pacing_for, stated_rate
from ..policy.pipelining import OutOfStep
from ..policy.shaper import DestinationShaper
from ..routing.pools import Source
from ..routing.relays import Relay
from ..routing.resolver import Route
from ..scheduler.core import Scheduler
from ..smtp.addresses import domain_of
from ..smtp.client import Smarthost
from ..spool.store import Spool
from .destination import DOMAINS_KEPT, Destination
from .sender import Sender

log = get_logger("delivery")

Steer = Callable[[DestinationShaper, float], None]

# Remembered lessons of destinations not live, at most (the latest traffic kept): a
# returning destination starts wisely, but a daemon that met a million domains in a
# week must not hold them all.
LEARNED_KEPT = 50_000


class Registry:
    def __init__(self, core: Scheduler, spool: Spool) -> None:
        self.core = core
        self.spool = spool
        self.destinations: dict[str, Destination] = {}
        self.learned: dict[str, rate_learner.Learned] = {}
        self.out_of_step = OutOfStep()
        self._overrides: dict[str, tuple[Steer, float | None]] = {}  # name -> (steer, until)
        self._relays_by_key: dict[str, Relay] = {}
        self._smarthosts: dict[str, Smarthost] = {}

    def configure(
        self,
        cfg: config.Config,
        relays_by_key: dict[str, Relay],
        smarthosts: dict[str, Smarthost],
        now: float,
    ) -> list[str]:
        """Take reloaded settings; destinations keep their state unless their pacing
        changed. The smarthosts whose settings changed are returned (logged by the
        caller)."""
        self.shaping = cfg.shaping
        fresh_ones = []
        for destination in self.destinations.values():
            fresh = False
            if destination.relay is not None and destination.key in relays_by_key:
                # A smarthost no longer named keeps its settings for the mail queued there.
                smarthost = smarthosts[destination.key]
                fresh = smarthost != destination.smarthost
                destination.relay = relays_by_key[destination.key]
                destination.smarthost = smarthost
                if fresh:
                    fresh_ones.append(destination.key)
            self._repace(destination, now, fresh=fresh)
        self._relays_by_key, self._smarthosts = relays_by_key, smarthosts
        return fresh_ones

    def _repace(self, destination: Destination, now: float, fresh: bool = False) -> None:
        """Apply reloaded pacing and classes to a live destination; `fresh`: its state
        starts over too, what it learned aside (a smarthost's new password or TLS settings
        deserve an attempt now, not after the breaker's cooldown)."""
        domain = _domain_of(destination)
        pacing = pacing_for(self.shaping, domain, destination.hosts)
        if pacing != destination.pacing or fresh:
            destination.pacing = pacing
            learned = destination.shaper.learned(now)
            destination.shaper = DestinationShaper(
                pacing,
                self.shaping,
                now,
                learned,
                stated_rate=stated_rate(
                    self.shaping, domain, destination.hosts, named_hop=destination.named_hop
                ),
            )
            self.core.add_destination(destination.key, destination.shaper, pacing)

    def create(
        self,
        key: str,
        domain: str,
        route: Route,
        relay: Relay | None,
        now: float,
        source: Source | None = None,
    ) -> Destination:
        shaping = self.shaping
        hosts = [h.name for h in route.hosts]
        if relay is not None:
            domain = ""  # see _domain_of
        pacing = pacing_for(shaping, domain, hosts)
        named_hop = not route.own_mx  # a relayhost, a route, a smarthost
        shaper = DestinationShaper(
            pacing,
            shaping,
            now,
            self.learned.get(key),
            stated_rate=stated_rate(shaping, domain, hosts, named_hop=named_hop),
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
            named_hop=named_hop,
        )
        for name in (key, destination.base, domain) if domain else (key, destination.base):
            if name in self._overrides:
                self._overrides[name][0](destination.shaper, now)
        self.destinations[key] = destination
        self.core.add_destination(key, shaper, pacing)
        return destination

    def relay_named(self, key: str) -> Relay | None:
        """The smarthost that destination `key` is (one that did not resolve has no live
        destination, but its key)."""
        relay = self._relays_by_key.get(key)
        if relay is None and key in self.destinations:
            relay = self.destinations[key].relay
        return relay

    def retire(self, destination: Destination, now: float) -> None:
        """Forget a destination with nothing to do and nothing to remember: its shaper at
        rest, no replies in its stats window and no mail routed to it still waiting (a
        deferred message keeps its destination's state in `mtaqueue-ctl domains`)."""
        quiet = destination.shaper.at_rest(now) and not destination.recent(now)
        if quiet and not self._still_waiting(destination) and self.core.forget(destination.key):
            self.learned[destination.key] = destination.shaper.learned(now)
            self.destinations.pop(destination.key, None)

    def _still_waiting(self, destination: Destination) -> bool:
        """Whether a message routed to the destination still has a recipient pending there;
        forgets those that have none."""
        for message_id in list(destination.waiting):
            if _pending_at(destination, self.spool.messages.get(message_id)):
                return True
            destination.waiting.discard(message_id)
        return False

    def tidy(self, destination: Destination) -> None:
        """Forget the ids of messages that left the queue (a busy destination is never
        retired, and would keep every id it ever carried; one delivered here is dropped
        as it is settled). Past its domains' cap (DOMAINS_KEPT, then twice what the last
        cut kept), keep the domains its waiting mail is for and the one its pacing rules
        match on: a cut reads every waiting message, so it is rare."""
        messages = self.spool.messages
        destination.waiting.difference_update([i for i in destination.waiting if i not in messages])
        if len(destination.domains) <= destination.domains_cap:
            return
        domains: set[str] = set()
        for message_id in destination.waiting:
            domains |= _pending_at(destination, messages.get(message_id))
        destination.domains = domains | {_domain_of(destination)}
        destination.domains_cap = max(DOMAINS_KEPT, 2 * len(destination.domains))

    def matching(self, name: str) -> list[Destination]:
        return [d for d in self.destinations.values() if named(d, name)]

    def steer(self, name: str, apply: Steer, now: float, until: float | None = None) -> list[str]:
        """Apply to matching destinations now, and to one that appears later (until
        `until`, if it ends); the keys of those it applied to."""
        name = name.lower()
        self._overrides[name] = (apply, until)
        matched = self.matching(name)
        for destination in matched:
            apply(destination.shaper, now)
        return [d.key for d in matched]

    def forget_learned(self, name: str, now: float) -> int:
        """Drop what destinations (by domain or destination name) learned: live ones start
        over from the slow start, remembered ones are no longer saved. Once, unlike a limit:
        what they learn from now on is kept."""
        name = name.lower()
        live = self.matching(name)
        for destination in live:
            destination.shaper.forget(now)
        keys = {d.key for d in live} | ({name} & self.learned.keys())
        for key in keys:
            self.learned.pop(key, None)
            log.info("learned_forgotten", destination=key)
        return len(keys)

    def prune(self, now: float) -> None:
        """Drop the standing steers whose time is over (a limit or backoff until then):
        one that appears later has nothing left to take from them."""
        self._overrides = {
            name: (apply, until)
            for name, (apply, until) in self._overrides.items()
            if until is None or until > now
        }

    def learned_data(self, now: float) -> bytes:
        """The state file: live destinations' lessons over the remembered ones, without
        those forgotten by now or that taught nothing; of the remembered, LEARNED_KEPT at
        most, the latest traffic first."""
        live = {key: d.shaper.learned(now) for key, d in self.destinations.items()}
        kept = rate_learner.kept
        gone = [(k, v) for k, v in self.learned.items() if k not in live and kept(v, now)]
        if len(gone) > LEARNED_KEPT:
            gone = sorted(gone, key=lambda entry: entry[1].at)[-LEARNED_KEPT:]
        remembered = dict(gone)
        self.learned = remembered | {k: v for k, v in live.items() if kept(v, now)}
        return rate_learner.encode(self.learned, self.out_of_step.state(now))

    def sizes(self) -> dict[str, int]:
        """Entries of its maps, by a stable name (DeliveryManager.memory_sizes)."""
        live = self.destinations.values()
        return {
            "destinations": len(self.destinations),
            "destination_messages": sum(len(d.waiting) for d in live),
            "destination_domains": sum(len(d.domains) for d in live),
            "learned": len(self.learned),
            "steers": len(self._overrides),
            "pipelining_hosts": len(self.out_of_step),
        }

    def domains(self, now: float, sender: Sender, egress: EgressState) -> list[dict]:
        """The live destinations' state (for metrics and `mtaqueue-ctl domains`)."""
        by_source: dict[Source | None, dict[str, float]] = {}  # hosts suspended for each
        entries = []
        for d in self.destinations.values():
            if d.source not in by_source:
                by_source[d.source] = sender.suspended_hosts(now, d.source)
            suspended = by_source[d.source]
            entries.append(
                d.snapshot(now, suspended, self.core.waiting(d.key), self.core.slots(d.key)[0])
                | egress.snapshot(d.base, d.source, now)
            )
        return entries


def _domain_of(destination: Destination) -> str:
    """The domain its pacing rules match on: none for a smarthost (a rule for gmail.com
    paces Gmail's MX, not an ESP that carries some of that mail)."""
    if destination.relay is not None:
        return ""
    return min(destination.domains) if destination.domains else destination.key


def _pending_at(destination: Destination, message: Message | None) -> set[str]:
    """The domains of `message`'s recipients still pending at `destination`."""
    if message is None:
        return set()
    pending = {domain_of(r.address) for r in message.recipients if r.state in PENDING}
    return pending if destination.relay is not None else pending & destination.domains


def named(destination: Destination, name: str) -> bool:
    """Whether an operator's name (ctl limit, backoff, forget) means this destination: its
    key, or a domain it serves, unless it is a smarthost (a limit for gmail.com paces
    Gmail's MX, not an ESP that carries some of that mail)."""
    if name in (destination.key, destination.base):
        return True
    return destination.relay is None and name in destination.domains
