"""The scheduler's core, sans I/O: what is due, which connection opens, which message goes.

It holds the scheduled queue (message ids by due time), a ready queue per destination
(policy/fairness.py: the first class first, weights, tenants), and the connection slots.
It takes `now` and events (a message due at T, work routed to a destination, a connection
opened or failed, a transaction done, the timer) and returns actions for a driver that
owns the sockets, DNS and the spool (KumoMTA's split of a scheduled queue from ready
queues, Postfix qmgr's one decision-maker): `Dispatch` (route these), `Connect` (open one
connection for this item), `Send` (this item on that open connection), `Close`, `Wake`.

One place permits: every `Connect` has the destination shaper's connect_wait == 0 for a
slot counted with the others (the next MX host of a failed connect, too: its slot counted
out, so the rate and the breaker apply), and every item handed out (`Connect`, `Send`)
has its send_wait, the global rate and its tenant's rate at 0; each takes its tokens. A
slot is a connection: one that ends (the server closed, messages_per_connection reached)
ends its slot, and the next is admitted like any new one. Reserved slots
(pacing.reserved_p0) carry first-class work only. Feedback goes to the shaper: one
signal per distinct reply of a transaction, a failed connect, a connect latency; when a
probe closes the circuit, what waited is released (`Release`) rather than sent at once.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..config import Pacing
from ..policy.breaker import CLOSED, HALF_OPEN
from ..policy.buckets import TokenBucket
from ..policy.classify import Verdict
from ..policy.fairness import FairQueue, class_order
from ..policy.replies import Reply
from ..policy.shaper import DestinationShaper

T = TypeVar("T")

CONNECTING, SENDING, IDLE, WAITING = "connecting", "sending", "idle", "waiting"


@dataclass(frozen=True, slots=True)
class Dispatch:
    """These messages are due: route their pending recipients (then `enqueue`)."""

    message_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Connect(Generic[T]):
    """Open one connection (to the next host not tried yet) for `item`, then report
    `connected` or `connect_failed`."""

    conn: int
    destination: str
    item: T
    first_class: bool  # a reserved slot: it carries first-class work only


@dataclass(frozen=True, slots=True)
class Send(Generic[T]):
    """Send `item` on the open connection `conn`, then report `done`."""

    conn: int
    item: T


@dataclass(frozen=True, slots=True)
class Close:
    """Close `conn` (QUIT); its slot is free already."""

    conn: int


@dataclass(frozen=True, slots=True)
class GiveUp(Generic[T]):
    """No further host may be tried for `item` now (the breaker opened, the slot is no
    longer admitted): settle it with the connect failures it met. Its slot is free."""

    conn: int
    item: T


@dataclass(frozen=True, slots=True)
class Release(Generic[T]):
    """A probe closed `destination`'s circuit: the items that waited while it was open,
    most urgent first, taken out of its queue for the driver to let go spread out (not
    as a herd)."""

    destination: str
    items: tuple[T, ...]


@dataclass(frozen=True, slots=True)
class Wake:
    """Call `tick` at `at` (replaces any earlier Wake; none: nothing is timed)."""

    at: float


Action = Dispatch | Connect | Send | Close | GiveUp | Release | Wake


@dataclass(slots=True)
class _Slot:
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
class _Destination:
    key: str
    shaper: DestinationShaper
    pacing: Pacing
    queue: FairQueue
    slots: dict[int, _Slot] = field(default_factory=dict)

    def counts(self, leaving: _Slot | None = None) -> tuple[int, int]:
        """(slots, reserved slots), `leaving` counted out."""
        slots = [s for s in self.slots.values() if s is not leaving]
        return len(slots), sum(s.first_class for s in slots)


class Scheduler(Generic[T]):
    def __init__(
        self,
        classes: dict[str, tuple[int, int]],
        *,
        max_connections: int,
        connection_idle: float,
        rate: TokenBucket | None = None,
        tenant_rate: float = 0.0,
    ) -> None:
        """`classes` as FairQueue takes them; `max_connections` over all destinations;
        `rate` the global message rate (delivery.max_rate); `tenant_rate` per tenant, per
        second (0: none)."""
        self.classes = classes
        self.first_class = class_order({n: p for n, (p, _) in classes.items()})[0]
        self.max_connections = max_connections
        self.connection_idle = connection_idle
        self.rate = rate
        self.tenant_rate = tenant_rate
        self._tenants: dict[str, TokenBucket] = {}
        self._destinations: dict[str, _Destination] = {}
        self._slots: dict[int, _Slot] = {}
        self._ids = itertools.count(1)
        self._heap: list[tuple[float, int, str]] = []  # (due, seq, message id)
        self._seq = itertools.count()
        # An event looks only at the destinations it touched and those whose time came:
        # each destination's next wake is in a heap (an entry is stale once `_timer_of`
        # moved on), and those that wait for a global connection slot (max_connections
        # reached) are queued, the first class apart, to be served as slots end.
        self._dirty: set[str] = set()
        self._timers: list[tuple[float, int, str]] = []  # (at, seq, destination)
        self._timer_of: dict[str, tuple[float, int]] = {}
        self._starved: dict[bool, dict[str, None]] = {True: {}, False: {}}  # ordered sets

    # -- events ------------------------------------------------------------------------

    def add_destination(self, key: str, shaper: DestinationShaper, pacing: Pacing) -> None:
        """A new destination, or new pacing for a known one (a reload): its queue and
        slots stay."""
        known = self._destinations.get(key)
        if known is None:
            self._destinations[key] = _Destination(key, shaper, pacing, FairQueue(self.classes))
        else:
            known.shaper, known.pacing = shaper, pacing
        self._dirty.add(key)

    def forget(self, key: str) -> bool:
        """Drop a destination with no slots and nothing waiting; whether it was dropped."""
        destination = self._destinations.get(key)
        if destination is None or destination.slots or len(destination.queue):
            return False
        del self._destinations[key]
        self._dirty.discard(key)
        self._timer_of.pop(key, None)
        for starved in self._starved.values():
            starved.pop(key, None)
        return True

    def reclassify(self, classes: dict[str, tuple[int, int]]) -> None:
        """New classes (a reload): waiting items keep their order within a class; those of
        a class that is gone join the first class."""
        self.classes = classes
        self.first_class = class_order({n: p for n, (p, _) in classes.items()})[0]
        for destination in self._destinations.values():
            entries = destination.queue.remove(lambda entry: True)
            destination.queue = FairQueue(classes)
            for item, klass, tenant in entries:
                klass = klass if klass in classes else self.first_class
                destination.queue.push((item, klass, tenant), klass, tenant)
            self._dirty.add(destination.key)

    def schedule(self, now: float, message_id: str, due: float) -> list[Action]:
        """Make a message due at `due`. It is dispatched by the `tick` at or after it,
        with everything else due then (a restart makes thousands due at once: routed
        together), so this only moves the Wake."""
        heapq.heappush(self._heap, (due, next(self._seq), message_id))
        if self._heap[0][2] != message_id:
            return []
        paced = self._next_timer()
        return [Wake(due if paced is None else min(due, paced))]

    def tick(self, now: float, *keys: str) -> list[Action]:
        """The timer, or `keys`: destinations whose pacing changed outside an event (an
        operator's limit) to look at now."""
        self._dirty.update(keys)
        return self._run(now)

    def enqueue(
        self,
        now: float,
        key: str,
        item: T,
        klass: str,
        tenant: str | None = None,
        *,
        run: bool = True,
    ) -> list[Action]:
        """Routed work for destination `key` (added first with add_destination). `run`
        False: more of a batch follows (then `tick`), so that the order within the batch
        (the first class first, tenants in turn) decides what goes first."""
        klass = klass if klass in self.classes else self.first_class
        self._destinations[key].queue.push((item, klass, tenant), klass, tenant)
        self._dirty.add(key)
        return self._run(now) if run else []

    def connected(self, now: float, conn: int, latency: float | None = None) -> list[Action]:
        slot = self._slots[conn]
        shaper = self._destinations[slot.destination].shaper
        self._dirty.add(slot.destination)
        if latency is not None:
            shaper.latency(now, latency)
        slot.state = SENDING  # the item of the Connect goes now, unless first-class work
        self._first_class_first(slot, now)  # came in while the connection opened
        return [Send(conn, slot.item), *self._run(now)]  # type: ignore[arg-type]

    def connect_failed(
        self,
        now: float,
        conn: int,
        *,
        more_hosts: bool,
        reply: Reply | None = None,
        verdict: Verdict | None = None,
    ) -> list[Action]:
        """The connection for a `Connect` failed (with `reply` and its `verdict`, a 421
        greeting say, when there was one: a throttle reply paces as well); `more_hosts`:
        another host may be tried."""
        slot = self._slots[conn]
        destination = self._destinations[slot.destination]
        shaper = destination.shaper
        self._dirty.add(destination.key)
        if reply is None or verdict is None:
            shaper.connect_failed(now)
        else:  # this slot counted: refused as one too many, the others are what worked
            shaper.result(now, reply, verdict, len(destination.slots))
        if more_hosts:
            slot.state = WAITING
            return self._run(now)
        item = slot.item
        self._end(slot)
        return [GiveUp(conn, item), *self._run(now)]

    def done(
        self,
        now: float,
        conn: int,
        *,
        reusable: bool,
        replies: Iterable[tuple[Reply, Verdict]] = (),
    ) -> list[Action]:
        """The transaction of a `Send` (or the one after `connected`) is settled by the
        driver; `reusable`: the connection can take another; `replies`: what it got."""
        slot = self._slots[conn]
        destination = self._destinations[slot.destination]
        self._dirty.add(destination.key)
        probing = destination.shaper.state(now).circuit == HALF_OPEN
        seen: set[int] = set()
        for reply, verdict in replies:  # one signal per reply, not per recipient
            if id(reply) not in seen:
                seen.add(id(reply))
                destination.shaper.result(now, reply, verdict, len(destination.slots))
        slot.item = None
        slot.transactions += 1
        actions: list[Action] = []
        if probing and destination.shaper.state(now).circuit == CLOSED:
            entries = destination.queue.remove(lambda entry: True)
            actions.append(Release(destination.key, tuple(item for item, _, _ in entries)))
        if not reusable or slot.transactions >= destination.pacing.messages_per_connection:
            self._end(slot)
            if reusable:
                actions.append(Close(conn))
        else:
            slot.state, slot.until = IDLE, now + self.connection_idle
        return actions + self._run(now)

    def abandon(self, now: float, conn: int) -> list[Action]:
        """The driver did not open the connection of a `Connect` (every host suspended,
        say): the slot ends without feedback; the item is the driver's to deal with."""
        slot = self._slots[conn]
        self._dirty.add(slot.destination)
        self._end(slot)
        return self._run(now)

    def remove(self, now: float, predicate: Callable[[T], bool], key: str | None = None) -> list[T]:
        """Take waiting items out of the ready queues (held, deleted, bounced), of one
        destination's if `key`; by class, tenant turn, then FIFO."""
        removed: list[T] = []
        chosen = self._destinations.values() if key is None else [self._destinations[key]]
        for destination in chosen:
            entries = destination.queue.remove(lambda entry: predicate(entry[0]))
            removed += [item for item, _, _ in entries]
        return removed

    # -- views -------------------------------------------------------------------------

    def slots(self, key: str) -> tuple[int, int]:
        """(slots open or opening, of which reserved) at destination `key`."""
        return self._destinations[key].counts()

    def waiting(self, key: str) -> dict[str, int]:
        """Items waiting at destination `key`, by class (every class listed)."""
        return self._destinations[key].queue.depth()

    # -- the one place that permits ----------------------------------------------------

    def _run(self, now: float) -> list[Action]:
        """O(log n) and the work released: the destinations an event touched, those whose
        wake came, and those waiting for a global slot while there is one."""
        actions: list[Action] = []
        due: list[str] = []
        while self._heap and self._heap[0][0] <= now:
            due.append(heapq.heappop(self._heap)[2])
        if due:
            actions.append(Dispatch(tuple(due)))
        keys, self._dirty = self._dirty, set()
        while self._timers and self._timers[0][0] <= now:
            at, seq, key = heapq.heappop(self._timers)
            if self._timer_of.get(key) == (at, seq):
                del self._timer_of[key]
                keys.add(key)
        # Destinations with first-class work first: they get the global slots first,
        # before those waiting for one without it.
        touched = [self._destinations[key] for key in sorted(keys) if key in self._destinations]
        first = [d for d in touched if d.queue.first_class_waiting()]
        rest = [d for d in touched if not d.queue.first_class_waiting()]
        for destination in first:
            self._pump(destination, now, actions)
        self._fill(now, actions, first_class_only=True)
        for destination in rest:
            self._pump(destination, now, actions)
        self._fill(now, actions, first_class_only=False)
        wakes = [
            at
            for at in (self._next_timer(), self._heap[0][0] if self._heap else None)
            if at is not None
        ]
        if wakes:
            actions.append(Wake(min(wakes)))
        return actions

    def _fill(self, now: float, actions: list[Action], *, first_class_only: bool) -> None:
        """Serve the destinations waiting for a global slot while there is one: first-class
        work first, then in turn."""
        for first_class in (True,) if first_class_only else (True, False):
            starved = self._starved[first_class]
            while starved and len(self._slots) < self.max_connections:
                key = next(iter(starved))
                del starved[key]
                self._pump(self._destinations[key], now, actions)

    def _next_timer(self) -> float | None:
        """The earliest destination wake (stale heap entries dropped)."""
        timers = self._timers
        while timers and self._timer_of.get(timers[0][2]) != timers[0][:2]:
            heapq.heappop(timers)
        return timers[0][0] if timers else None

    def _pump(self, destination: _Destination, now: float, actions: list[Action]) -> None:
        """Everything destination may do now; its next wake goes in the heap."""
        shaper = destination.shaper
        wakes: list[float] = []
        for starved in self._starved.values():
            starved.pop(destination.key, None)
        # Idle connections no longer admitted close; a failed connect tries the next host.
        for slot in list(destination.slots.values()):
            active, reserved = destination.counts()
            if slot.state == IDLE and not shaper.keeps(now, active, reserved, slot.first_class):
                self._end(slot)
                actions.append(Close(slot.id))
            elif slot.state == WAITING:
                others, others_reserved = destination.counts(leaving=slot)
                wait = shaper.connect_wait(now, others, others_reserved, slot.first_class)
                if wait == math.inf:
                    item = slot.item
                    self._end(slot)
                    actions.append(GiveUp(slot.id, item))
                elif wait > 0:
                    wakes.append(now + wait)
                else:
                    shaper.connected(now)
                    slot.state = CONNECTING
                    actions.append(Connect(slot.id, destination.key, slot.item, slot.first_class))
        # Idle connections take work first (the first class first: it goes on the wire at
        # once, not after a new connection's handshake); one with nothing to do closes
        # after connection_idle. New connections open for what is left.
        for slot in [s for s in destination.slots.values() if s.state == IDLE]:
            entry, wait = self._next(destination, now, slot.first_class)
            if entry is not None:
                slot.state, (slot.item, slot.klass, slot.tenant) = SENDING, entry
                actions.append(Send(slot.id, slot.item))
            elif wait is None and now >= slot.until:
                self._end(slot)
                actions.append(Close(slot.id))
            else:
                wakes.append(slot.until if wait is None else now + wait)
        self._open_slots(destination, now, actions, wakes)
        key = destination.key
        if wakes:
            at = min(wakes)
            if self._timer_of.get(key, (None,))[0] != at:
                entry = (at, next(self._seq))
                self._timer_of[key] = entry
                heapq.heappush(self._timers, (*entry, key))
        else:
            self._timer_of.pop(key, None)

    def _open_slots(
        self, destination: _Destination, now: float, actions: list[Action], wakes: list[float]
    ) -> None:
        """New slots while more work waits than the idle connections take: up to the
        limit with a backlog, as an MTA does (the concurrency limit grows only so)."""
        shaper, queue = destination.shaper, destination.queue
        while True:
            first_waiting = queue.first_class_waiting()
            takers = sum(
                s.state == IDLE and (not s.first_class or first_waiting)
                for s in destination.slots.values()
            )
            if len(queue) <= takers:
                return
            if len(self._slots) >= self.max_connections:  # served when one ends
                self._starved[first_waiting][destination.key] = None
                return
            active, reserved = destination.counts()
            wait = shaper.connect_wait(now, active, reserved, first_class=False)
            first_class = False
            if wait > 0 and first_waiting:
                reserved_wait = shaper.connect_wait(now, active, reserved, first_class=True)
                first_class, wait = reserved_wait == 0, min(wait, reserved_wait)
            if wait > 0:
                if wait != math.inf:
                    wakes.append(now + wait)
                return
            entry, send_wait = self._next(destination, now, first_class)
            if entry is None:
                if send_wait is not None:
                    wakes.append(now + send_wait)
                return
            shaper.connected(now)
            slot = _Slot(next(self._ids), destination.key, first_class, CONNECTING, *entry)
            destination.slots[slot.id] = slot
            self._slots[slot.id] = slot
            actions.append(Connect(slot.id, destination.key, slot.item, first_class))

    def _first_class_first(self, slot: _Slot, now: float) -> None:
        """A slot opened for other work carries first-class work that waits now instead:
        a restart lets the first class in first, but routing finishes in any order, and
        p0 must not wait behind the bulk message that happened to open the connection.
        The first-class item takes the tokens of the one it replaces, which goes back to
        the head of its queue (its tenant's token back: it did not go)."""
        queue = self._destinations[slot.destination].queue
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
        self, destination: _Destination, now: float, first_class: bool
    ) -> tuple[tuple[object, str, str | None] | None, float | None]:
        """The next entry (item, class, tenant) that may go now, its tokens taken; else
        (None, seconds until one may, or None when there is none to wait for)."""
        queue = destination.queue
        if not (queue.first_class_waiting() if first_class else len(queue)):
            return None, None
        wait = destination.shaper.send_wait(now)
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
        destination.shaper.sent(now)
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

    def _end(self, slot: _Slot) -> None:
        self._slots.pop(slot.id, None)
        self._destinations[slot.destination].slots.pop(slot.id, None)
