"""Slot admission: the one place that permits every connection and every send.

    Admission(classes, max_connections=, connection_idle=, rate=, tenant_rate=)
    .stations: dict[str, Station]   each destination's shaper, pacing, queue and slots
    .slots: dict[int, Slot]         every connection slot, by id
    .starved[first_class]           destinations waiting for a global slot, in turn
    .pump(station, now, actions)    everything a destination may do now -> its next wake
    .first_class_first(slot, now)   a just-opened slot takes first-class work instead
    .end(slot)                      a slot is over

Every `Connect` has the destination shaper's connect_wait == 0 for a slot counted with
the others (the next MX host of a failed connect too), and every item handed out has its
send_wait, the global rate and its tenant's rate at 0; each takes its tokens. Reserved
slots (pacing.reserved_p0) carry first-class work only. Sans I/O: `now` is passed in.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import Pacing
from ..policy.buckets import TokenBucket
from ..policy.fairness import FairQueue, class_order
from ..policy.shaper import DestinationShaper
from .actions import Action, Close, Connect, GiveUp, Send

CONNECTING, SENDING, IDLE, WAITING = "connecting", "sending", "idle", "waiting"
Entry = tuple[object, str, str | None]  # (item, class, tenant)


@dataclass(slots=True)
class Slot:
    id: int
    destination: str
    first_class: bool
    state: str
    item: object | None = None  # CONNECTING, WAITING (for the next host), SENDING
    klass: str = ""  # the item's class and tenant
    tenant: str | None = None
    transactions: int = 0
    until: float = 0.0  # IDLE: closes then


@dataclass(slots=True)
class Station:
    """A destination as the core sees it: its pacing, ready queue and slots."""

    key: str
    shaper: DestinationShaper
    pacing: Pacing
    queue: FairQueue
    slots: dict[int, Slot] = field(default_factory=dict)

    def counts(self, leaving: Slot | None = None) -> tuple[int, int]:
        """(slots, reserved slots), `leaving` counted out."""
        slots = [s for s in self.slots.values() if s is not leaving]
        return len(slots), sum(s.first_class for s in slots)


class Admission:
    def __init__(
        self,
        classes: dict[str, tuple[int, int]],
        *,
        max_connections: int,
        connection_idle: float,
        rate: TokenBucket | None,
        tenant_rate: float,
    ) -> None:
        self.max_connections = max_connections
        self.connection_idle = connection_idle
        self.rate = rate
        self.tenant_rate = tenant_rate
        self.stations: dict[str, Station] = {}
        self.slots: dict[int, Slot] = {}
        self.starved: dict[bool, dict[str, None]] = {True: {}, False: {}}  # ordered sets
        self._tenants: dict[str, TokenBucket] = {}
        self._ids = itertools.count(1)
        self.set_classes(classes)

    def set_classes(self, classes: dict[str, tuple[int, int]]) -> None:
        self.classes = classes
        self.first_class = class_order({n: p for n, (p, _) in classes.items()})[0]

    def pump(self, station: Station, now: float, actions: list[Action]) -> float | None:
        """Everything `station` may do now; when it next may (None: nothing is timed)."""
        shaper = station.shaper
        wakes: list[float] = []
        for starved in self.starved.values():
            starved.pop(station.key, None)
        # Idle connections no longer admitted close; a failed connect tries the next host.
        for slot in list(station.slots.values()):
            active, reserved = station.counts()
            if slot.state == IDLE and not shaper.keeps(now, active, reserved, slot.first_class):
                self.end(slot)
                actions.append(Close(slot.id))
            elif slot.state == WAITING:
                others, others_reserved = station.counts(leaving=slot)
                wait = shaper.connect_wait(now, others, others_reserved, slot.first_class)
                if wait == math.inf:
                    item = slot.item
                    self.end(slot)
                    actions.append(GiveUp(slot.id, item))
                elif wait > 0:
                    wakes.append(now + wait)
                else:
                    shaper.connected(now)
                    slot.state = CONNECTING
                    actions.append(Connect(slot.id, station.key, slot.item, slot.first_class))
        # Idle connections take work first (the first class first: it goes on the wire at
        # once, not after a new connection's handshake); one with nothing to do closes
        # after connection_idle. New connections open for what is left.
        for slot in [s for s in station.slots.values() if s.state == IDLE]:
            entry, wait = self._next(station, now, slot.first_class)
            if entry is not None:
                slot.state, (slot.item, slot.klass, slot.tenant) = SENDING, entry
                actions.append(Send(slot.id, slot.item))
            elif wait is None and now >= slot.until:
                self.end(slot)
                actions.append(Close(slot.id))
            else:
                wakes.append(slot.until if wait is None else now + wait)
        self._open_slots(station, now, actions, wakes)
        return min(wakes) if wakes else None

    def _open_slots(
        self, station: Station, now: float, actions: list[Action], wakes: list[float]
    ) -> None:
        """New slots while more work waits than the idle connections take: up to the
        limit with a backlog, as an MTA does (the concurrency limit grows only so)."""
        shaper, queue = station.shaper, station.queue
        while True:
            first_waiting = queue.first_class_waiting()
            takers = sum(
                s.state == IDLE and (not s.first_class or first_waiting)
                for s in station.slots.values()
            )
            if len(queue) <= takers:
                return
            if len(self.slots) >= self.max_connections:  # served when one ends
                self.starved[first_waiting][station.key] = None
                return
            active, reserved = station.counts()
            wait = shaper.connect_wait(now, active, reserved, first_class=False)
            first_class = False
            if wait > 0 and first_waiting:
                reserved_wait = shaper.connect_wait(now, active, reserved, first_class=True)
                first_class, wait = reserved_wait == 0, min(wait, reserved_wait)
            if wait > 0:
                if wait != math.inf:
                    wakes.append(now + wait)
                return
            entry, send_wait = self._next(station, now, first_class)
            if entry is None:
                if send_wait is not None:
                    wakes.append(now + send_wait)
                return
            shaper.connected(now)
            slot = Slot(next(self._ids), station.key, first_class, CONNECTING, *entry)
            station.slots[slot.id] = slot
            self.slots[slot.id] = slot
            actions.append(Connect(slot.id, station.key, slot.item, first_class))

    def first_class_first(self, slot: Slot, now: float) -> None:
        """A slot opened for other work carries first-class work that waits now instead:
        a restart lets the first class in first, but routing finishes in any order, and
        p0 must not wait behind the bulk message that happened to open the connection.
        The first-class item takes the tokens of the one it replaces, which goes back to
        the head of its queue (its tenant's token back: it did not go)."""
        queue = self.stations[slot.destination].queue
        # (A class gone in a reload counts as the first class, as in `enqueue`.)
        first = slot.klass == self.first_class or slot.klass not in self.classes
        if first or not queue.first_class_waiting():
            return
        eligible = self._eligible(now) if self.tenant_rate else None
        entry = queue.pop(first_class_only=True, eligible=eligible)
        if entry is None:  # only capped tenants' first-class work waits
            return
        queue.put_back((slot.item, slot.klass, slot.tenant), slot.klass, slot.tenant)
        if self.tenant_rate:
            if slot.tenant is not None:
                self._bucket(slot.tenant, now).give_back(now)
            if entry[2] is not None:
                self._bucket(entry[2], now).take(now)
        slot.item, slot.klass, slot.tenant = entry

    def _next(
        self, station: Station, now: float, first_class: bool
    ) -> tuple[Entry | None, float | None]:
        """The next entry (item, class, tenant) that may go now, its tokens taken; else
        (None, seconds until one may, or None when there is none to wait for)."""
        queue = station.queue
        if not (queue.first_class_waiting() if first_class else len(queue)):
            return None, None
        wait = station.shaper.send_wait(now)
        if self.rate is not None:
            wait = max(wait, self.rate.wait(now))
        if wait > 0:
            return None, wait
        eligible = self._eligible(now) if self.tenant_rate else None
        entry = queue.pop(first_class_only=first_class, eligible=eligible)
        if entry is None:  # only capped tenants wait
            waits = [b.wait(now) for b in self._tenants.values()]
            return None, min((w for w in waits if w > 0), default=None)
        tenant = entry[2]
        station.shaper.sent(now)
        if self.rate is not None:
            self.rate.take(now)
        if tenant is not None and self.tenant_rate:
            self._bucket(tenant, now).take(now)
        return entry, None

    def _eligible(self, now: float) -> Callable[[str | None], bool]:
        return lambda tenant: tenant is None or self._bucket(tenant, now).wait(now) == 0

    def _bucket(self, tenant: str, now: float) -> TokenBucket:
        bucket = self._tenants.get(tenant)
        if bucket is None:
            bucket = self._tenants[tenant] = TokenBucket(self.tenant_rate, 1, now)
        return bucket

    def end(self, slot: Slot) -> None:
        self.slots.pop(slot.id, None)
        self.stations[slot.destination].slots.pop(slot.id, None)
