"""A destination: the mail waiting for one set of MX hosts, and how hard to push it.

Domains hosted by one provider resolve to the same MX hosts and so share one
destination, its limits and its state (shaping.group_by = "mx"); with
group_by = "domain" every domain is its own destination.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from ..config import Pacing
from ..policy.fairness import FairQueue
from ..policy.hosts import host_key
from ..policy.replies import Reply
from ..policy.shaper import DestinationShaper
from ..routing.resolver import Route

STATS_WINDOW = 600.0  # seconds of replies behind the 4xx rate


@dataclass(slots=True)
class WorkItem:
    message_id: str
    indexes: list[int]  # recipients of the message in this transaction
    route: Route
    klass: str
    tenant: str | None = None


def destination_key(domain: str, route: Route, group_by: str) -> str:
    if group_by == "domain":
        return domain
    names = ",".join(sorted({host.name for host in route.hosts}))
    return names if route.port == 25 else f"{names}:{route.port}"


class Destination:
    def __init__(
        self,
        key: str,
        pacing: Pacing,
        shaper: DestinationShaper,
        classes: dict[str, tuple[int, int]],
    ) -> None:
        self.key = key
        self.pacing = pacing
        self.shaper = shaper
        self.classes = classes
        self.queue: FairQueue[WorkItem] = FairQueue(classes)
        self.domains: set[str] = set()
        self.active = 0  # open connections (workers)
        self.reserved = 0  # of which for first-class work only
        self.idle = 0  # of which waiting for the next item
        self.arrived = asyncio.Event()  # wakes idle workers: new work, or a lower limit
        self.pump_at: asyncio.TimerHandle | None = None
        self.last_replies: deque[str] = deque(maxlen=5)
        self._window: deque[tuple[float, int]] = deque()  # (time, reply class digit)

    def record(self, now: float, reply: Reply) -> None:
        self.last_replies.append(reply.line())
        self._window.append((now, reply.code // 100 if reply.code else 4))
        while self._window and self._window[0][0] < now - STATS_WINDOW:
            self._window.popleft()

    def deferral_rate(self, now: float) -> float:
        """Share of 4xx (and no-reply) outcomes over the last STATS_WINDOW seconds."""
        recent = [c for t, c in self._window if t >= now - STATS_WINDOW]
        return sum(c == 4 for c in recent) / len(recent) if recent else 0.0

    def snapshot(self, now: float, suspended: dict[str, float]) -> dict:
        shaping = self.shaper.snapshot(now)
        names, _, port = self.key.rpartition(":")  # destination_key's "names[:port]"
        if not port.isdigit():
            names, port = self.key, "25"
        hosts = {host_key(name, int(port)) for name in names.split(",")}
        return {
            "destination": self.key,
            "domains": sorted(self.domains),
            "queued": self.queue.depth(),
            "active": self.active,
            **shaping,
            "suspended_hosts": {h: until for h, until in suspended.items() if h in hosts},
            "deferral_rate": round(self.deferral_rate(now), 3),
            "last_replies": list(self.last_replies),
        }
