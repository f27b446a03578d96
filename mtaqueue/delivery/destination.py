"""A destination: the mail waiting for one set of MX hosts, and how hard to push it.

Domains hosted by one provider resolve to the same MX hosts and so share one
destination, its limits and its state (shaping.group_by = "mx"); with
group_by = "domain" every domain is its own destination. A smarthost of a class or a
tenant is one of its own, whatever domains it carries (routing/relays.py `Relay.key`).
Mail of a source pool is a destination per (source, destination), "<key>@<address>"
(routing/pools.py): providers limit per client IP, so each source has its own pacing,
breaker and learned limits there.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from ..config import Pacing
from ..model import PENDING, Message
from ..policy.hosts import host_key
from ..policy.replies import Reply
from ..policy.shaper import DestinationShaper
from ..routing.pools import Source
from ..routing.relays import Relay
from ..routing.resolver import Route
from ..smtp.addresses import domain_of
from ..smtp.client import Smarthost

STATS_WINDOW = 600.0  # seconds of replies behind the 4xx rate
# Domains a live destination remembers serving before the sweep cuts them back to those
# with mail there: one MX set (a hosting provider's) serves countless domains, and a busy
# destination is never retired.
DOMAINS_KEPT = 1_000


@dataclass(slots=True)
class WorkItem:
    message_id: str
    indexes: list[int]  # recipients of the message in this transaction
    route: Route
    klass: str
    tenant: str | None = None


def destination_key(domain: str, route: Route, group_by: str, relay: Relay | None = None) -> str:
    """The destination's name without a source (see `sourced`)."""
    if relay is not None:
        return relay.key
    if group_by == "domain":
        return domain
    names = ",".join(sorted({host.name for host in route.hosts}))
    return names if route.port == 25 else f"{names}:{route.port}"


def sourced(base: str, source: Source | None) -> str:
    """The key of `base` as sent to from `source` (None: the default source, `base`)."""
    return base if source is None else f"{base}@{source.address}"


class Destination:
    def __init__(
        self,
        key: str,
        pacing: Pacing,
        shaper: DestinationShaper,
        *,
        hosts: Iterable[str] | None = None,
        port: int = 25,
        relay: Relay | None = None,
        smarthost: Smarthost | None = None,
        source: Source | None = None,
        named_hop: bool = False,
    ) -> None:
        """Its ready queue and connections are the scheduler core's. `hosts` (and `port`):
        the host names of its route; None: those of an MX key ("names[:port][@source]")."""
        self.key = key
        self.source = source  # the pool's address its connections bind to; None: default
        self.base = key.removesuffix(f"@{source.address}") if source is not None else key
        self.pacing = pacing
        self.shaper = shaper
        if hosts is None:
            names, _, number = self.base.rpartition(":")  # destination_key's "names[:port]"
            if not number.isdigit():
                names, number = self.base, "25"
            hosts, port = names.split(","), int(number)
        self.hosts = tuple(hosts)
        self.port = port
        self.relay = relay  # a class's or tenant's smarthost, or None (MX, routes)
        self.named_hop = named_hop  # a next hop the operator named: no slow start there
        self.smarthost = smarthost  # its TLS and AUTH (the password: kept, never shown)
        self.domains: set[str] = set()
        self.domains_cap = DOMAINS_KEPT  # Registry.tidy cuts `domains` past it
        self.last_replies: deque[str] = deque(maxlen=5)
        self.waiting: set[str] = set()  # ids of messages routed here, perhaps still pending
        self._window: deque[tuple[float, int]] = deque()  # (time, reply class digit)

    def record(self, now: float, reply: Reply) -> None:
        self.last_replies.append(reply.line())
        self._window.append((now, reply.code // 100 if reply.code else 4))
        while self._window and self._window[0][0] < now - STATS_WINDOW:
            self._window.popleft()

    def recent(self, now: float) -> bool:
        """Whether it had replies within STATS_WINDOW, behind its 4xx rate and last replies."""
        return bool(self._window) and self._window[-1][0] >= now - STATS_WINDOW

    def deferral_rate(self, now: float) -> float:
        """Share of 4xx (and no-reply) outcomes over the last STATS_WINDOW seconds."""
        recent = [c for t, c in self._window if t >= now - STATS_WINDOW]
        return sum(c == 4 for c in recent) / len(recent) if recent else 0.0

    def snapshot(
        self, now: float, suspended: dict[str, float], queued: dict[str, int], active: int
    ) -> dict:
        """`queued`: its waiting items by class; `active`: its connections."""
        shaping = self.shaper.snapshot(now)
        hosts = {host_key(name, self.port) for name in self.hosts}
        return {
            "destination": self.key,
            "routed": True,
            "relay": self.relay.source if self.relay is not None else None,
            "source": self.source.address if self.source is not None else None,
            "domains": sorted(self.domains),
            "queued": queued,
            "active": active,
            **shaping,
            "suspended_hosts": {h: until for h, until in suspended.items() if h in hosts},
            "deferral_rate": round(self.deferral_rate(now), 3),
            "last_replies": list(self.last_replies),
        }


class DestinationsView:
    """Every destination with waiting mail or state to show, by name (`mtaqueue-ctl
    domains`), built a message at a time (a walk over a large queue yields as it goes):
    the live ones' snapshots (`live`), each with `deferred`, the messages by class with a
    recipient there waiting for its retry time (pending, not held, not queued or in
    transit: `busy`); and for deferred mail no live destination has routed (after a
    restart, say) one entry per domain, `routed` false, with its recipients' last
    replies. Mail of a class or tenant with a smarthost counts there (`relay_of`: its
    destination key, or None), not at its domains' MX."""

    def __init__(
        self,
        live: list[dict],
        busy: Mapping[str, Collection[int]],
        relay_of: Callable[[Message], str | None] = lambda message: None,
    ) -> None:
        self._live = live
        # A smarthost carries many domains, and owns none of them.
        self._owner = {
            domain: d["destination"] for d in live if not d.get("relay") for domain in d["domains"]
        }
        self._names = {d["destination"] for d in live}
        self._busy = busy
        self._relay_of = relay_of
        self._deferred: dict[str, Counter[str]] = {}
        self._replies: dict[str, list[tuple[float, str]]] = {}

    def add(self, message: Message) -> None:
        if message.held:
            return
        in_transit = self._busy.get(message.id, ())
        relay = self._relay_of(message)
        seen: set[str] = set()
        for i, rcpt in enumerate(message.recipients):
            if rcpt.state not in PENDING or i in in_transit:
                continue
            domain = domain_of(rcpt.address)
            name = relay or self._owner.get(domain, domain)
            if name not in seen:  # a message counts once per destination
                seen.add(name)
                self._deferred.setdefault(name, Counter())[message.klass] += 1
            if name not in self._names and rcpt.last_reply:
                self._replies.setdefault(name, []).append(
                    (rcpt.last_attempt or 0.0, rcpt.last_reply)
                )

    def entries(self) -> list[dict]:
        deferred = self._deferred
        view = [{**d, "deferred": dict(deferred.pop(d["destination"], {}))} for d in self._live]
        for name, counts in deferred.items():
            last = sorted(set(self._replies.get(name, [])))[-5:]
            view.append(
                {
                    "destination": name,
                    "routed": False,
                    "domains": [name],
                    "queued": {},
                    "deferred": dict(counts),
                    "active": 0,
                    "last_replies": [reply for _, reply in last],
                }
            )
        return sorted(view, key=lambda d: d["destination"])
