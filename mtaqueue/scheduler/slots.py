"""Slot admission: the one place that permits every connection and every send.

    Admission(classes, max_connections=, connection_idle=, rate=, tenant_rate=)
    .stations: dict[str, Station]   each destination's shaper, pacing, queue and slots
    .slots: dict[int, Slot]         every connection slot, by id
    .starved[first_class]           destinations waiting for a global slot, in turn
    .held_back                      those at their fair share, served after the starved
    .pump(station, now, actions)    everything a destination may do now -> its next wake
    .room(now) / .parks_at()        a global slot free; when a connect next stops counting
    .answered(slot)                 its connect opened or failed
    .first_class_first(slot, now)   a just-opened slot takes first-class work instead
    .follow(slot, now) -> item      the next item, written behind a transaction's content
    .unfollow(slot, now)            it did not go: back at the head of its queue
    .end(slot)                      a slot is over (a follower goes back)
    .prune(now)                     drop the tenants' buckets that are full (as new)
    .sizes() -> {name: entries}

Every `Connect` has the destination shaper's connect_wait == 0 for a slot counted with
the others (the next MX host of a failed connect too), and every item handed out has its
send_wait, the global rate and its tenant's rate at 0; each takes its tokens. Reserved
slots (pacing.reserved_p0) carry first-class work only. Sans I/O: `now` is passed in.

Hung or slow destinations cannot starve the rest (Postfix's qmgr and KumoMTA keep one
site from taking the whole process limit):
- One connect until it answers: a destination with a connect in flight opens no other
  while none of its connections is up (it has not answered yet: unknown, or its last
  connects hung), nor while one of its connects is lame (scheduler/connecting.py: no
  answer after PATIENCE). Its answer (`connected`, `connect_failed`) pumps it again. A
  destination that never answers so holds one socket, as a half-open probe would; its
  timeout opens its breaker (core.py), so its queue waits as one, uncharged.
- Lame connects are parked: they stop counting against max_connections (up to
  PARKED_PER_SLOT times it, for the file descriptors), so 500 destinations that accept
  TCP and never greet let the one that answers have a slot within a few PATIENCEs.
- Fair share: while another destination waits for a global slot, none opens a
  connection past max(1, max_connections // destinations holding or waiting for one),
  one over it closes an idle connection instead of giving it more work, and every idle
  connection with nothing to do closes at once instead of after connection_idle. With
  nobody waiting, a destination gets what its pacing allows, as if alone.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import Pacing
from ..policy.breaker import CLOSED
from ..policy.buckets import TokenBucket
from ..policy.fairness import FairQueue, class_order
from ..policy.shaper import DestinationShaper
from .actions import Action, Close, Connect, GiveUp, Send
from .connecting import Connecting

CONNECTING, SENDING, IDLE, WAITING = "connecting", "sending", "idle", "waiting"
PENDING, UP = (CONNECTING, WAITING), (SENDING, IDLE)  # not answered yet; answered
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
    since: float = 0.0  # CONNECTING: when its Connect went out
    follower: Entry | None = None  # SENDING: the next item, written behind this one


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
        count = reserved = 0
        for slot in self.slots.values():
            if slot is not leaving:
                count += 1
                reserved += slot.first_class
        return count, reserved


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
        self.held_back: dict[str, None] = {}
        self.connecting = Connecting()
        self._holders = 0  # destinations holding a slot
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
        self.held_back.pop(station.key, None)
        # Idle connections no longer admitted close; a failed connect tries the next host.
        # (Every idle slot of a class gets the same answer until one closes: asked once.)
        keeps: dict[bool, bool] = {}
        for slot in list(station.slots.values()):
            if slot.state == IDLE:
                if slot.first_class not in keeps:
                    active, reserved = station.counts()
                    keeps[slot.first_class] = shaper.keeps(now, active, reserved, slot.first_class)
                if not keeps[slot.first_class]:
                    self.end(slot)
                    actions.append(Close(slot.id))
                    keeps.clear()
            elif slot.state == WAITING:
                keeps.clear()  # (it may end, or take a connection: ask again after it)
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
                    self._connect(slot, now)
                    actions.append(Connect(slot.id, station.key, slot.item, slot.first_class))
        # Idle connections take work first (the first class first: it goes on the wire at
        # once, not after a new connection's handshake); one with nothing to do closes
        # after connection_idle, or at once while another destination waits for a slot,
        # as does one over the fair share. New connections open for what is left.
        starving = self._others_starve(station.key)
        for slot in [s for s in station.slots.values() if s.state == IDLE]:
            if starving and self._over_share(station, 1):  # its slot goes to them
                self.end(slot)
                actions.append(Close(slot.id))
                continue
            entry, wait = self._next(station, now, slot.first_class)
            if entry is not None:
                slot.state, (slot.item, slot.klass, slot.tenant) = SENDING, entry
                actions.append(Send(slot.id, slot.item))
            elif wait is None and (now >= slot.until or starving):
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
            if len(queue) <= takers or self._unanswered(station, now):
                return  # (unanswered: its answer pumps it again)
            if self._over_share(station, 0):  # the others first
                self.held_back[station.key] = None
                return
            if not self.room(now):  # served when one ends or parks
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
            self._holders += not station.slots
            station.slots[slot.id] = slot
            self.slots[slot.id] = slot
            self._connect(slot, now)
            actions.append(Connect(slot.id, station.key, slot.item, first_class))

    def room(self, now: float) -> bool:
        """A global slot is free (parked connects not counted)."""
        limit = self.max_connections
        return self.connecting.in_use(len(self.slots), limit, now) < limit

    def parks_at(self) -> float | None:
        """When a connect in flight would next stop counting (a slot for the starved)."""
        return self.connecting.parks_at(self.max_connections)

    def answered(self, slot: Slot) -> None:
        """Its connect opened or failed: no longer in flight."""
        self.connecting.answered(slot.id)

    def _connect(self, slot: Slot, now: float) -> None:
        slot.state, slot.since = CONNECTING, now
        self.connecting.start(slot.id, now)

    def _unanswered(self, station: Station, now: float) -> bool:
        """A connect of its own is in flight while none of its connections is up, or is
        lame: the destination opens no other until it answers."""
        slots = station.slots.values()
        pending = [s for s in slots if s.state in PENDING]
        if not pending:
            return False
        if not any(s.state in UP for s in slots):
            return True
        lame = self.connecting.lame
        return any(s.state == CONNECTING and lame(s.since, now) for s in pending)

    def _others_starve(self, key: str) -> bool:
        """Another destination waits for a global slot."""
        return any(k != key for starved in self.starved.values() for k in starved)

    def _over_share(self, station: Station, leeway: int) -> bool:
        """Another destination waits for a global slot, and this one holds its fair share
        plus `leeway` or more (0: it may open no other; 1: it is over, an idle one closes).
        The share: max(1, max_connections // destinations holding a slot or waiting)."""
        if not station.slots or not self._others_starve(station.key):
            return False
        stations = self.stations
        waiting = sum(not stations[k].slots for s in self.starved.values() for k in s)
        share = max(1, self.max_connections // max(1, self._holders + waiting))
        return len(station.slots) >= share + leeway

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

    def follow(self, slot: Slot, now: float) -> object | None:
        """The item that goes right behind the transaction on `slot` (PIPELINING: its
        commands ride behind the content's final dot), its tokens taken; None unless the
        connection would take it at once anyway (under messages_per_connection, kept by
        the shaper, its circuit closed, no other destination waiting for a slot) and the
        round trip it saves is worth it (`DestinationShaper.pipelines`)."""
        station = self.stations[slot.destination]
        shaper = station.shaper
        if slot.follower is not None or self._others_starve(station.key):
            return None
        if not shaper.pipelines(now):  # a round trip too short to be worth a MAIL ahead
            return None
        if slot.transactions + 2 > station.pacing.messages_per_connection:
            return None
        active, reserved = station.counts()
        if shaper.state(now).circuit != CLOSED or not shaper.keeps(
            now, active, reserved, slot.first_class
        ):
            return None
        entry, _ = self._next(station, now, slot.first_class)
        slot.follower = entry
        return entry[0] if entry is not None else None

    def unfollow(self, slot: Slot, now: float | None = None) -> None:
        """The follower did not go (the connection ended first, or the driver could not
        write it): it goes back to the head of its queue (with `now`: its tenant's token
        back too)."""
        entry, slot.follower = slot.follower, None
        if entry is None:
            return
        self.stations[slot.destination].queue.put_back(entry, entry[1], entry[2])
        tenant = entry[2]
        if tenant is not None and self.tenant_rate and now is not None:
            self._bucket(tenant, now).give_back(now)

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

    def prune(self, now: float) -> None:
        """A full bucket is a new one: a tenant idle for a token's time keeps none."""
        self._tenants = {t: b for t, b in self._tenants.items() if not b.full(now)}

    def sizes(self) -> dict[str, int]:
        return {"stations": len(self.stations), "tenant_buckets": len(self._tenants)}

    def end(self, slot: Slot) -> None:
        if slot.id in self.slots:
            self.unfollow(slot)
        self.connecting.answered(slot.id)
        self.slots.pop(slot.id, None)
        station = self.stations[slot.destination]
        if station.slots.pop(slot.id, None) is not None and not station.slots:
            self._holders -= 1
