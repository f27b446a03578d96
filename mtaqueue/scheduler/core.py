"""The scheduler's core, sans I/O: what is due, which connection opens, which message goes.

    Scheduler(classes, max_connections=, connection_idle=, rate=, tenant_rate=)
    events:  add_destination, forget, configure, reclassify, schedule, tick, enqueue,
             connected, connect_failed, done, abandon, remove   -> list[Action]
             follow(now, conn, timings) -> item | None; unfollow(now, conn) -> list[Action]
    .load    OwnLoad: the driver tells it how late the event loop runs (policy/latency.py)
    views:   slots(key), waiting(key), inserted (schedules by reason); .admission (slots.py)

It holds the scheduled queue (message ids by due time), a ready queue per destination
(policy/fairness.py: the first class first, weights, tenants), and the connection slots.
It takes `now` and events (a message due at T, work routed to a destination, a connection
opened or failed, a transaction done, the timer) and returns actions for a driver that
owns the sockets, DNS and the spool (KumoMTA's split of a scheduled queue from ready
queues, Postfix qmgr's one decision-maker): `Dispatch` (route these), `Connect` (open one
connection for this item), `Send` (this item on that open connection), `Close`, `Wake`
(scheduler/actions.py).

One place permits every `Connect` and every item handed out (scheduler/slots.py). A
slot is a connection: one that ends (the server closed, messages_per_connection reached)
ends its slot, and the next is admitted like any new one. Reserved slots
(pacing.reserved_p0) carry first-class work only. Feedback goes to the shaper: one
signal per distinct reply of a transaction, a failed connect, the replies it timed (a
latency round is judged against our own load first: `OwnLoad` sees every destination);
when a probe closes the circuit, what waited is released (`Release`), not sent at once.

A destination that does not answer is one outage, not one per message: a connect or
greeting timeout that leaves no host to try, while none of the destination's connections
is up, opens its breaker at once (`DestinationShaper.hung`). Its queue then waits,
uncharged, for the one probe after the cooldown, instead of each message burning a
timeout and climbing the retry ladder in turn; the probe's success releases it. (How hung
connects are kept from taking every global slot: scheduler/slots.py.)
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from ..config import Pacing
from ..policy.breaker import CLOSED, HALF_OPEN
from ..policy.buckets import TokenBucket
from ..policy.fairness import FairQueue
from ..policy.latency import OwnLoad
from ..policy.replies import Reply
from ..policy.shaper import DestinationShaper
from ..policy.verdict import Verdict
from .actions import Action, Close, Dispatch, GiveUp, Release, Send, Wake
from .slots import IDLE, SENDING, UP, WAITING, Admission, Station

T = TypeVar("T")
Timing = tuple[str, float]  # a reply timed: (kind, seconds) (policy/latency.py)

# Why a message goes (back) into the scheduled queue, as KumoMTA's InsertReason: every
# `schedule` names one, and the core counts them (`inserted`: the metric
# mtaqueue_scheduled_total{reason}), so a dashboard shows what keeps the queue busy.
ACCEPTED = "accepted"  # a new message is durable
STARTUP = "startup"  # the queue read at start
RETRY = "retry"  # a settlement's next attempt (policy/settle.py)
WAIT = "wait"  # an internal wait, uncharged once: every host suspended, a pool's sources out
WARMUP = "warmup"  # over a warming source's allowance: the next day
RELEASE = "release"  # a probe closed the circuit: what waited goes, spread out
OPERATOR = "operator"  # an operator's release or flush, a ramp finished
RECOVER = "recover"  # after a bug of ours (uncharged once)
REASONS = (ACCEPTED, STARTUP, RETRY, WAIT, WARMUP, RELEASE, OPERATOR, RECOVER)


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
        self.admission = Admission(
            classes,
            max_connections=max_connections,
            connection_idle=connection_idle,
            rate=rate,
            tenant_rate=tenant_rate,
        )
        self._stations, self._slots = self.admission.stations, self.admission.slots
        self._heap: list[tuple[float, int, str]] = []  # (due, seq, message id)
        self._seq = itertools.count()
        # An event looks only at the destinations it touched and those whose time came:
        # each destination's next wake is in a heap (an entry is stale once `_timer_of`
        # moved on), and those that wait for a global connection slot (max_connections
        # reached) are queued, the first class apart, to be served as slots end.
        self._dirty: set[str] = set()
        self._timers: list[tuple[float, int, str]] = []  # (at, seq, destination)
        self._timer_of: dict[str, tuple[float, int]] = {}
        self.inserted: Counter[str] = Counter({reason: 0 for reason in REASONS})
        self.load = OwnLoad()

    @property
    def classes(self) -> dict[str, tuple[int, int]]:
        return self.admission.classes

    # -- events ------------------------------------------------------------------------

    def add_destination(self, key: str, shaper: DestinationShaper, pacing: Pacing) -> None:
        """A new destination, or new pacing for a known one (a reload): its queue and
        slots stay."""
        known = self._stations.get(key)
        if known is None:
            self._stations[key] = Station(key, shaper, pacing, FairQueue(self.classes))
        else:
            known.shaper, known.pacing = shaper, pacing
        self._dirty.add(key)

    def forget(self, key: str) -> bool:
        """Drop a destination with no slots and nothing waiting; whether it was dropped."""
        station = self._stations.get(key)
        if station is None or station.slots or len(station.queue):
            return False
        del self._stations[key]
        self._dirty.discard(key)
        self._timer_of.pop(key, None)
        for starved in self.admission.starved.values():
            starved.pop(key, None)
        self.admission.held_back.pop(key, None)
        return True

    def reclassify(self, classes: dict[str, tuple[int, int]]) -> None:
        """New classes (a reload): waiting items keep their order within a class; those of
        a class that is gone join the first class."""
        self.admission.set_classes(classes)
        first_class = self.admission.first_class
        for station in self._stations.values():
            entries = station.queue.remove(lambda entry: True)
            station.queue = FairQueue(classes)
            for item, klass, tenant in entries:
                klass = klass if klass in classes else first_class
                station.queue.push((item, klass, tenant), klass, tenant)
            self._dirty.add(station.key)

    def configure(
        self,
        *,
        max_connections: int,
        connection_idle: float,
        rate: TokenBucket | None,
        tenant_rate: float,
    ) -> None:
        """New global limits (a reload); `tick` applies them."""
        admission = self.admission
        admission.max_connections, admission.connection_idle = max_connections, connection_idle
        admission.rate, admission.tenant_rate = rate, tenant_rate

    def schedule(self, now: float, message_id: str, due: float, reason: str) -> list[Action]:
        """Make a message due at `due`, for `reason` (one of REASONS). It is dispatched
        by the `tick` at or after it, with everything else due then (a restart makes
        thousands due at once: routed together), so this only moves the Wake."""
        self.inserted[reason] += 1
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
        klass = klass if klass in self.classes else self.admission.first_class
        self._stations[key].queue.push((item, klass, tenant), klass, tenant)
        self._dirty.add(key)
        return self._run(now) if run else []

    def connected(self, now: float, conn: int, timings: Iterable[Timing] = ()) -> list[Action]:
        """The connection of a `Connect` is open; `timings`: its handshake timed."""
        slot = self._slots[conn]
        self._dirty.add(slot.destination)
        self.admission.answered(slot)
        self._timed(now, slot.destination, timings)
        slot.state = SENDING  # the item of the Connect goes now, unless first-class work
        self.admission.first_class_first(slot, now)  # came in while the connection opened
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
        destination = self._stations[slot.destination]
        shaper = destination.shaper
        self._dirty.add(destination.key)
        self.admission.answered(slot)
        if reply is None or verdict is None:
            shaper.connect_failed(now)
        else:  # this slot counted: refused as one too many, the others are what worked
            shaper.result(now, reply, verdict, len(destination.slots))
            up = any(s.state in UP for s in destination.slots.values())
            if not more_hosts and not up and _hung(reply):
                shaper.hung(now)  # one outage: the queue waits for the probe
        if more_hosts:
            slot.state = WAITING
            return self._run(now)
        item = slot.item
        self.admission.end(slot)
        return [GiveUp(conn, item), *self._run(now)]

    def follow(self, now: float, conn: int, timings: Iterable[Timing] = ()) -> object | None:
        """Content is next on `conn` (`timings`: its replies so far): the item that may
        ride behind its final dot (RFC 2920) if the connection would take it at once anyway
        (slots.py `follow`); `done` sends it or puts it back, `unfollow` if not written."""
        slot = self._slots[conn]
        self._timed(now, slot.destination, timings)
        return self.admission.follow(slot, now)

    def unfollow(self, now: float, conn: int) -> list[Action]:
        """The item `follow` gave was not written: back at the head of its queue, and what
        may go now (another connection may take it)."""
        slot = self._slots[conn]
        self.admission.unfollow(slot, now)
        self._dirty.add(slot.destination)
        return self._run(now)

    def done(
        self,
        now: float,
        conn: int,
        *,
        reusable: bool,
        replies: Iterable[tuple[Reply, Verdict]] = (),
        timings: Iterable[Timing] = (),
    ) -> list[Action]:
        """The transaction of a `Send` (or the one after `connected`) is settled by the
        driver; `reusable`: the connection can take another; `replies`: what it got;
        `timings`: its replies timed, as (kind, seconds)."""
        slot = self._slots[conn]
        destination = self._stations[slot.destination]
        self._dirty.add(destination.key)
        self._timed(now, destination.key, timings)
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
            self.admission.end(slot)  # (a follower goes back: its commands got no reply)
            if reusable:
                actions.append(Close(conn))
        elif slot.follower is not None:  # already on the wire: it goes on
            (slot.item, slot.klass, slot.tenant), slot.follower = slot.follower, None
            actions.append(Send(conn, slot.item))
        else:
            slot.state, slot.until = IDLE, now + self.admission.connection_idle
        return actions + self._run(now)

    def _timed(self, now: float, key: str, timings: Iterable[Timing]) -> None:
        shaper = self._stations[key].shaper
        closed = shaper.timed(now, timings, self.load.lagging(now))
        if closed is not None:
            self.load.reported(now, key, closed.verdict)
            shaper.react(now, closed, self.load.ours(now))

    def abandon(self, now: float, conn: int) -> list[Action]:
        """The driver did not open the connection of a `Connect` (every host suspended,
        say): the slot ends without feedback; the item is the driver's to deal with."""
        slot = self._slots[conn]
        self._dirty.add(slot.destination)
        self.admission.end(slot)
        return self._run(now)

    def remove(self, now: float, predicate: Callable[[T], bool], key: str | None = None) -> list[T]:
        """Take waiting items out of the ready queues (held, deleted, bounced), of one
        destination's if `key`; by class, tenant turn, then FIFO."""
        removed: list[T] = []
        chosen = self._stations.values() if key is None else [self._stations[key]]
        for destination in chosen:
            entries = destination.queue.remove(lambda entry: predicate(entry[0]))
            removed += [item for item, _, _ in entries]
        return removed

    # -- views -------------------------------------------------------------------------

    def slots(self, key: str) -> tuple[int, int]:
        """(slots open or opening, of which reserved) at destination `key`."""
        return self._stations[key].counts()

    def waiting(self, key: str) -> dict[str, int]:
        """Items waiting at destination `key`, by class (every class listed)."""
        return self._stations[key].queue.depth()

    # -- what is due, and when each destination next may act ---------------------------

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
        touched = [self._stations[key] for key in sorted(keys) if key in self._stations]
        first = [d for d in touched if d.queue.first_class_waiting()]
        rest = [d for d in touched if not d.queue.first_class_waiting()]
        for station in first:
            self._pump(station, now, actions)
        self._fill(now, actions, first_class_only=True)
        for station in rest:
            self._pump(station, now, actions)
        self._fill(now, actions, first_class_only=False)
        admission = self.admission
        waiting = admission.held_back or any(admission.starved.values())
        parks = admission.parks_at() if waiting else None  # a slot for them then
        wakes = [
            at
            for at in (self._next_timer(), self._heap[0][0] if self._heap else None, parks)
            if at is not None
        ]
        if wakes:
            actions.append(Wake(min(wakes)))
        return actions

    def _fill(self, now: float, actions: list[Action], *, first_class_only: bool) -> None:
        """Serve the destinations waiting for a global slot while there is one: first-class
        work first, then in turn; then those held back at their fair share."""
        admission = self.admission
        lines = [admission.starved[True]]
        if not first_class_only:
            lines += [admission.starved[False], admission.held_back]
        for line in lines:
            while line and admission.room(now):
                key = next(iter(line))
                del line[key]
                self._pump(self._stations[key], now, actions)

    def _pump(self, station: Station, now: float, actions: list[Action]) -> None:
        """Everything the destination may do now; its next wake goes in the heap."""
        at = self.admission.pump(station, now, actions)
        key = station.key
        if at is None:
            self._timer_of.pop(key, None)
        elif self._timer_of.get(key, (None,))[0] != at:
            entry = (at, next(self._seq))
            self._timer_of[key] = entry
            heapq.heappush(self._timers, (*entry, key))

    def _next_timer(self) -> float | None:
        """The earliest destination wake (stale heap entries dropped)."""
        timers = self._timers
        while timers and self._timer_of.get(timers[0][2]) != timers[0][:2]:
            heapq.heappop(timers)
        return timers[0][0] if timers else None


def _hung(reply: Reply) -> bool:
    """No answer: the connect or the greeting timed out (not a refusal, not a reply)."""
    return reply.network == "timeout" and reply.phase in ("connect", "banner")
