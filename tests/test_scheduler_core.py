"""The scheduler's sans-IO core (mtaqueue.scheduler.core) with a fake clock: every connection
and every message permitted in one place, whatever the order of events."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mtaqueue import config
from mtaqueue.config import DEFAULT_CLASSES
from mtaqueue.policy.classify import classify
from mtaqueue.policy.replies import Reply
from mtaqueue.policy.shaper import DestinationShaper
from mtaqueue.scheduler.actions import Close, Connect, Dispatch, GiveUp, Release, Send, Wake
from mtaqueue.scheduler.connecting import PARKED_PER_SLOT, PATIENCE
from mtaqueue.scheduler.core import ACCEPTED, REASONS, RETRY, Scheduler

CLASSES = {name: (c.priority, c.weight) for name, c in DEFAULT_CLASSES.items()}
T0 = 1_000_000.0
OK = Reply("data_end", 250, "2.0.0", "ok")
THROTTLED = Reply("mail", 421, "4.7.28", "rate limited")
DEFERRED = Reply("rcpt", 451, "4.3.0", "try later")


def pacing(**keys) -> config.Pacing:
    return config.Pacing(**keys)


def scheduler(p: config.Pacing, *, max_connections: int = 100, idle: float = 5.0):
    sched = Scheduler(CLASSES, max_connections=max_connections, connection_idle=idle)
    sched.add_destination("d", DestinationShaper(p, config.ShapingConfig(), T0), p)
    return sched


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def enqueue_many(sched, now: float, klass: str, prefix: str, count: int) -> list:
    """`count` items PREFIX0, PREFIX1... of `klass` for destination "d"; the actions."""
    actions = []
    for i in range(count):
        actions += sched.enqueue(now, "d", f"{prefix}{i}", klass)
    return actions


def test_due_messages_are_dispatched_together_when_due():
    sched = scheduler(pacing())
    assert sched.schedule(T0, "m1", T0 + 5, ACCEPTED) == [Wake(T0 + 5)]
    assert sched.schedule(T0, "m2", T0 + 6, RETRY) == []  # not the first due: the Wake stands
    assert sched.schedule(T0, "m3", T0 + 4, RETRY) == [Wake(T0 + 4)]
    assert sched.inserted[ACCEPTED] == 1 and sched.inserted[RETRY] == 2  # by reason
    assert set(sched.inserted) == set(REASONS)  # every reason counted, 0 too
    assert of(sched.tick(T0 + 4.5), Dispatch) == [Dispatch(("m3",))]
    assert of(sched.tick(T0 + 6), Dispatch) == [Dispatch(("m1", "m2"))]


def test_a_reload_reclassifies_waiting_items_and_an_idle_destination_is_forgotten():
    sched = scheduler(pacing(initial_connections=1, max_connections=1))
    (first,) = of(sched.enqueue(T0, "d", "x", "p2"), Connect)
    sched.enqueue(T0, "d", "gone", "bulk2")  # an unknown class goes with the first class
    sched.enqueue(T0, "d", "y", "p2")
    assert sched.waiting("d") == {"p0": 1, "p1": 0, "p2": 1}
    assert not sched.forget("d")  # a slot and waiting items
    sched.reclassify({"p0": (0, 1), "p2": (2, 1)})
    assert sched.waiting("d") == {"p0": 1, "p2": 1}
    assert sched.remove(T0, lambda item: True, key="d") == ["gone", "y"]
    sched.abandon(T0, first.conn)  # every host suspended, say: no feedback, slot free
    assert sched.slots("d") == (0, 0)
    assert sched.forget("d")


def test_the_connection_rate_holds_across_reconnects_and_the_next_host():
    """connections_per_minute=3 (burst 3) with one message per connection: the first
    connect fails over to the next host, the next connections follow the rate."""
    p = pacing(connections_per_minute=3, burst=3, messages_per_connection=1, initial_connections=1)
    sched = scheduler(p)
    now = T0
    actions = enqueue_many(sched, now, "p1", "m", 5)
    (first,) = of(actions, Connect)
    (again,) = of(sched.connect_failed(now, first.conn, more_hosts=True), Connect)
    assert again.conn == first.conn and again.item == first.item  # the next host: token 2
    opened = [again]
    send = of(sched.connected(now, again.conn), Send)
    for _ in range(3):
        assert send
        actions = sched.done(now, send[0].conn, reusable=True, replies=[(OK, classify(OK, ()))])
        assert of(actions, Close)  # messages_per_connection
        connects = of(actions, Connect)
        if not connects:
            break
        opened += connects
        send = of(sched.connected(now, connects[0].conn), Send)
    assert len(opened) == 2  # tokens 2 and 3; the fourth is 20 s away
    (wake,) = of(actions, Wake)
    assert wake.at == T0 + 20
    assert of(sched.tick(T0 + 19.9), Connect) == []
    assert len(of(sched.tick(T0 + 20), Connect)) == 1


def test_p0_takes_a_reserved_slot_while_bulk_holds_the_others():
    p = pacing(max_connections=2, initial_connections=2, reserved_p0=1)
    sched = scheduler(p)
    (bulk,) = of(
        enqueue_many(sched, T0, "p2", "bulk", 3), Connect
    )  # one ordinary slot: max(1, 2 - 1)
    assert not bulk.first_class
    assert of(sched.connected(T0, bulk.conn), Send)  # the destination answered
    (reset,) = of(sched.enqueue(T0, "d", "reset", "p0"), Connect)
    assert reset.item == "reset" and reset.first_class
    assert sched.slots("d") == (2, 1)


def test_p0_goes_on_the_idle_connection_while_bulk_waits_for_a_new_one():
    sched = scheduler(pacing(max_connections=2, initial_connections=2, reserved_p0=0))
    (first,) = of(sched.enqueue(T0, "d", "bulk0", "p2"), Connect)
    sched.connected(T0, first.conn)
    sched.done(T0 + 1, first.conn, reusable=True, replies=[(OK, classify(OK, ()))])
    sched.enqueue(T0 + 2, "d", "bulk1", "p2", run=False)
    sched.enqueue(T0 + 2, "d", "reset", "p0", run=False)
    actions = sched.tick(T0 + 2)
    assert of(actions, Send) == [Send(first.conn, "reset")]  # on the wire at once
    assert [c.item for c in of(actions, Connect)] == ["bulk1"]


def test_p0_routed_while_a_bulk_connection_opens_goes_first_on_it():
    """A restart lets p0 in first, but routing finishes in any order: the one connection
    opened for a bulk message carries the p0 that came meanwhile; the bulk one is next."""
    sched = scheduler(pacing(max_connections=1, initial_connections=1, reserved_p0=0))
    (opening,) = of(enqueue_many(sched, T0, "p2", "bulk", 2), Connect)
    assert opening.item == "bulk0" and not opening.first_class
    assert not of(sched.enqueue(T0, "d", "reset", "p0"), Connect)  # the one slot is taken
    assert of(sched.connected(T0 + 0.1, opening.conn), Send) == [Send(opening.conn, "reset")]
    assert sched.waiting("d") == {"p0": 0, "p1": 0, "p2": 2}
    actions = sched.done(T0 + 0.2, opening.conn, reusable=True, replies=[(OK, classify(OK, ()))])
    assert of(actions, Send) == [Send(opening.conn, "bulk0")]  # back at the head of p2


def test_the_swapped_item_gives_its_tenant_token_back():
    p = pacing(max_connections=1, initial_connections=1, reserved_p0=0)
    sched = Scheduler(CLASSES, max_connections=10, connection_idle=5.0, tenant_rate=1 / 60)
    sched.add_destination("d", DestinationShaper(p, config.ShapingConfig(), T0), p)
    (opening,) = of(sched.enqueue(T0, "d", "news", "p2", "shop"), Connect)
    sched.enqueue(T0, "d", "reset", "p0", "bank")
    assert of(sched.connected(T0, opening.conn), Send) == [Send(opening.conn, "reset")]
    sched.enqueue(T0, "d", "bill", "p0", "bank")  # bank's one token went with "reset"
    actions = sched.done(T0 + 1, opening.conn, reusable=True, replies=[(OK, classify(OK, ()))])
    assert of(actions, Send) == [Send(opening.conn, "news")]  # shop got its token back


def test_the_next_item_rides_behind_the_dot_while_the_connection_may_take_it():
    """PIPELINING: when a transaction's content is next, the core gives the item this
    connection would take next; done() sends it, or puts it back if the connection ended."""
    ok = [(OK, classify(OK, ()))]
    p = pacing(max_connections=1, initial_connections=1, reserved_p0=0, messages_per_connection=3)
    sched = scheduler(p)
    (opening,) = of(enqueue_many(sched, T0, "p2", "m", 4), Connect)
    conn = opening.conn
    loopback = [("connect", 0.0002), ("ehlo", 0.0004), ("ehlo", 0.0003)]
    assert of(sched.connected(T0, conn, loopback), Send) == [Send(conn, "m0")]
    assert sched.follow(T0, conn) is None  # loopback: a round trip is not worth a MAIL ahead
    sched = scheduler(p)
    (opening,) = of(enqueue_many(sched, T0, "p2", "m", 4), Connect)
    conn = opening.conn
    assert of(sched.connected(T0, conn, [("ehlo", 0.05)] * 2), Send) == [Send(conn, "m0")]
    assert sched.follow(T0, conn) == "m1"
    assert sched.waiting("d")["p2"] == 2
    assert of(sched.done(T0 + 1, conn, reusable=True, replies=ok), Send) == [Send(conn, "m1")]
    assert sched.follow(T0 + 1, conn) == "m2"  # the connection's third and last
    assert not of(sched.unfollow(T0 + 1, conn), Send)  # not written: back at the head
    assert sched.waiting("d")["p2"] == 2
    assert sched.follow(T0 + 1, conn) == "m2"
    assert of(sched.done(T0 + 2, conn, reusable=True, replies=ok), Send) == [Send(conn, "m2")]
    assert sched.follow(T0 + 2, conn) is None  # messages_per_connection reached
    actions = sched.done(T0 + 3, conn, reusable=True, replies=ok)
    assert of(actions, Close) == [Close(conn)]
    # A follower written on a connection that then ended goes back, and goes next.
    (again,) = of(actions, Connect)
    assert again.item == "m3"
    sched.connected(T0 + 3, again.conn, [("ehlo", 0.05)])
    sched.enqueue(T0 + 3, "d", "m4", "p2")
    assert sched.follow(T0 + 3, again.conn) == "m4"
    actions = sched.done(T0 + 4, again.conn, reusable=False, replies=ok)
    assert not of(actions, Send) and [c.item for c in of(actions, Connect)] == ["m4"]


def test_a_throttle_reply_stops_new_connections_and_idle_ones_close():
    p = pacing(max_connections=4, initial_connections=4, reserved_p0=0)
    sched = scheduler(p)
    (first,) = of(enqueue_many(sched, T0, "p1", "m", 8), Connect)  # one until it answers
    connects = [first, *of(sched.connected(T0, first.conn), Connect)]
    assert len(connects) == 4
    for c in connects[1:]:
        sched.connected(T0, c.conn)
    verdict = classify(THROTTLED, ())
    actions = sched.done(T0, connects[0].conn, reusable=True, replies=[(THROTTLED, verdict)])
    assert of(actions, Close)  # over the new limit: it closes instead of taking more
    assert sched.slots("d")[0] <= 3


def test_a_probe_that_closes_the_circuit_releases_what_waited():
    shaping = config.ShapingConfig(breaker_failures=1, breaker_cooldown=10.0)
    p = pacing(initial_connections=1, max_connections=1)
    sched = Scheduler(CLASSES, max_connections=10, connection_idle=5.0)
    sched.add_destination("d", DestinationShaper(p, shaping, T0), p)
    (first,) = of(sched.enqueue(T0, "d", "m0", "p1"), Connect)
    for i in range(1, 4):
        sched.enqueue(T0, "d", f"m{i}", "p1")
    refused = Reply("connect", 0, network="refused")
    actions = sched.connect_failed(
        T0, first.conn, more_hosts=False, reply=refused, verdict=classify(refused, ())
    )
    assert of(actions, GiveUp) and not of(actions, Connect)  # the breaker is open
    (probe,) = of(sched.tick(T0 + 10), Connect)  # half-open: one probe
    sched.connected(T0 + 10, probe.conn)
    actions = sched.done(T0 + 10, probe.conn, reusable=True, replies=[(OK, classify(OK, ()))])
    assert of(actions, Release) == [Release("d", ("m2", "m3"))]
    assert not of(actions, Send) and sched.waiting("d")["p1"] == 0


def test_an_event_looks_only_at_the_destinations_it_touched(monkeypatch):
    """With many destinations an event costs the work it releases, not a walk over all
    of them (a million messages to 100,000 domains)."""
    p = pacing(max_connections=1, initial_connections=1)
    sched = Scheduler(CLASSES, max_connections=1000, connection_idle=5.0)
    sends = {}
    for i in range(300):
        key = f"d{i}"
        sched.add_destination(key, DestinationShaper(p, config.ShapingConfig(), T0), p)
        (connect,) = of(sched.enqueue(T0, key, f"m{i}", "p2"), Connect)
        sends[key] = of(sched.connected(T0, connect.conn), Send)[0]
    pumped = []
    pump = Scheduler._pump
    monkeypatch.setattr(
        Scheduler, "_pump", lambda self, d, *rest: (pumped.append(d.key), pump(self, d, *rest))
    )
    sched.enqueue(T0 + 1, "d7", "next", "p2", run=False)
    actions = sched.done(T0 + 1, sends["d7"].conn, reusable=True, replies=[(OK, classify(OK, ()))])
    assert of(actions, Send) == [Send(sends["d7"].conn, "next")]
    assert set(pumped) == {"d7"}


class Storm(RuleBasedStateMachine):
    """A driver that completes the core's actions in any order, against two destinations,
    with the clock moving; every permission is checked against what pacing allows."""

    @initialize(
        max_connections=st.integers(1, 4),
        initial=st.integers(1, 4),
        reserved=st.integers(0, 2),
        connections_per_minute=st.sampled_from([0, 3, 30]),
        messages_per_minute=st.sampled_from([0, 6, 60]),
        burst=st.integers(1, 3),
        per_connection=st.integers(1, 3),
        total=st.integers(1, 5),
    )
    def setup(
        self,
        max_connections,
        initial,
        reserved,
        connections_per_minute,
        messages_per_minute,
        burst,
        per_connection,
        total,
    ):
        self.pacing = pacing(
            max_connections=max_connections,
            initial_connections=initial,
            reserved_p0=reserved,
            connections_per_minute=connections_per_minute,
            messages_per_minute=messages_per_minute,
            burst=burst,
            messages_per_connection=per_connection,
        )
        self.total = total
        self.now = T0
        self.sched = Scheduler(CLASSES, max_connections=total, connection_idle=5.0)
        self.shapers = {}
        for key in ("a", "b"):
            shaper = DestinationShaper(self.pacing, config.ShapingConfig(), T0)
            self.shapers[key] = shaper
            self.sched.add_destination(key, shaper, self.pacing)
        self.ids = itertools.count()
        self.klass: dict[str, str] = {}
        self.waiting = {key: {"p0": 0, "p2": 0} for key in self.shapers}
        self.slots: dict[int, dict] = {}  # conn -> destination, first_class, state, item
        self.connects = {key: [] for key in self.shapers}
        self.messages = {key: [] for key in self.shapers}
        self.wake: float | None = None

    # -- what the core says -------------------------------------------------------------

    def apply(self, actions) -> None:
        # p0 is not put on a new connection (a handshake away) while an open one of its
        # destination takes bulk in the same decision.
        connects = {
            a.destination
            for a in actions
            if isinstance(a, Connect) and a.conn not in self.slots and self.klass[a.item] == "p0"
        }
        for a in actions:
            if isinstance(a, Send) and self.slots[a.conn]["state"] == "idle":
                bulk = self.klass[a.item] != "p0"
                assert not (bulk and self.slots[a.conn]["destination"] in connects), "p0 behind"
        for action in actions:
            if isinstance(action, Connect):
                self.connect(action)
            elif isinstance(action, Send):
                slot = self.slots[action.conn]
                assert slot["state"] in ("connected", "idle", "followed")
                if slot["state"] == "idle":
                    self.hand_out(slot["destination"], action.item)
                elif slot["state"] == "followed":  # handed out when it was written ahead
                    assert action.item == slot.pop("follower")
                elif action.item != slot["item"]:  # p0 came while it opened: p0 goes
                    self.swap(slot["destination"], slot["item"], action.item)
                elif self.klass[action.item] != "p0":
                    assert self.waiting[slot["destination"]]["p0"] == 0, "p0 behind bulk"
                slot["state"], slot["item"] = "sending", action.item
                slot["sent"] = slot.get("sent", 0) + 1
            elif isinstance(action, Close):
                assert self.slots.pop(action.conn)["state"] in ("idle", "done")
            elif isinstance(action, GiveUp):
                assert self.slots.pop(action.conn)["state"] in ("waiting", "failed")
            elif isinstance(action, Release):
                for item in action.items:  # the driver schedules them again, spread out
                    self.waiting[action.destination][self.klass[item]] -= 1
            elif isinstance(action, Wake):
                self.wake = action.at
            else:
                assert isinstance(action, Dispatch)

    def connect(self, action: Connect) -> None:
        key = action.destination
        shaper = self.shapers[key]
        self.connects[key].append(self.now)
        slot = self.slots.get(action.conn)
        if slot is not None:  # the next host of a failed connect: the same slot and item
            assert slot["state"] == "waiting" and slot["item"] == action.item
            slot["state"], slot["since"] = "connecting", self.now
            return
        assert not self.unanswered(key), "a second connect before the first answered"
        self.hand_out(key, action.item)
        self.slots[action.conn] = {
            "destination": key,
            "first_class": action.first_class,
            "state": "connecting",
            "item": action.item,
            "since": self.now,
        }
        assert action.first_class == (self.klass[action.item] == "p0") or not action.first_class
        here = [s for s in self.slots.values() if s["destination"] == key]
        limit = shaper.concurrency.limit
        assert self.counted() <= self.total, "the global connection cap"
        assert len(here) <= limit <= max(self.pacing.max_connections, limit), "the limit"
        if not action.first_class:
            ordinary = sum(not s["first_class"] for s in here)
            assert ordinary <= max(1, limit - self.pacing.reserved_p0), "a reserved slot"

    def lame(self, slot: dict) -> bool:
        return slot["state"] == "connecting" and self.now - slot["since"] >= PATIENCE

    def counted(self) -> int:
        """Slots against the global cap: connects unanswered past PATIENCE are parked."""
        parked = sum(self.lame(s) for s in self.slots.values())
        return len(self.slots) - min(parked, self.total * PARKED_PER_SLOT)

    def unanswered(self, key: str) -> bool:
        """A connect in flight while none is up, or one lame: no other opens."""
        here = [s for s in self.slots.values() if s["destination"] == key]
        pending = [s for s in here if s["state"] in ("connecting", "waiting")]
        up = [s for s in here if s["state"] in ("connected", "sending", "idle", "done")]
        return bool(pending) and (not up or any(self.lame(s) for s in pending))

    def swap(self, key: str, opened_for: str, item: str) -> None:
        """The connection opened for bulk carries waiting p0 instead (its tokens), and
        the bulk item waits again."""
        assert self.klass[opened_for] != "p0" and self.klass[item] == "p0"
        self.waiting[key]["p0"] -= 1
        self.waiting[key][self.klass[opened_for]] += 1

    def hand_out(self, key: str, item: str) -> None:
        klass = self.klass[item]
        if klass != "p0":
            assert self.waiting[key]["p0"] == 0, "bulk went while p0 waited"
        self.waiting[key][klass] -= 1
        self.messages[key].append(self.now)

    # -- what the driver does ------------------------------------------------------------

    @rule(key=st.sampled_from(["a", "b"]), klass=st.sampled_from(["p0", "p2"]))
    def enqueue(self, key, klass):
        item = f"{klass}-{next(self.ids)}"
        self.klass[item] = klass
        self.waiting[key][klass] += 1
        self.apply(self.sched.enqueue(self.now, key, item, klass))

    @rule(
        key=st.sampled_from(["a", "b"]),
        classes=st.lists(st.sampled_from(["p0", "p2"]), min_size=2, max_size=4),
    )
    def enqueue_batch(self, key, classes):
        """A routed batch, as the driver queues one: then one tick decides."""
        for klass in classes:
            item = f"{klass}-{next(self.ids)}"
            self.klass[item] = klass
            self.waiting[key][klass] += 1
            assert self.sched.enqueue(self.now, key, item, klass, run=False) == []
        self.apply(self.sched.tick(self.now))

    @rule(seconds=st.floats(0, 30) | st.sampled_from([0.5, 1.0, 2.0]))
    def advance(self, seconds):
        self.now += seconds
        self.apply(self.sched.tick(self.now))

    @precondition(lambda self: self.wake is not None)
    @rule()
    def timer(self):
        self.now = max(self.now, self.wake)
        self.wake = None
        self.apply(self.sched.tick(self.now))

    def pick(self, state: str, index: int) -> int | None:
        conns = sorted(c for c, s in self.slots.items() if s["state"] == state)
        return conns[index % len(conns)] if conns else None

    @rule(index=st.integers(0, 9), latency=st.floats(0.0001, 2.0))
    def connected(self, index, latency):
        conn = self.pick("connecting", index)
        if conn is not None:
            self.slots[conn]["state"] = "connected"
            self.apply(self.sched.connected(self.now, conn, [("connect", latency)]))

    @rule(index=st.integers(0, 9))
    def abandon(self, index):
        conn = self.pick("connecting", index)
        if conn is not None:
            del self.slots[conn]
            self.apply(self.sched.abandon(self.now, conn))

    @rule(index=st.integers(0, 9), more=st.booleans())
    def connect_failed(self, index, more):
        conn = self.pick("connecting", index)
        if conn is not None:
            self.slots[conn]["state"] = "waiting" if more else "failed"
            reply = Reply("banner", 421, "4.7.0", "too many connections") if more else None
            failed = self.sched.connect_failed(
                self.now,
                conn,
                more_hosts=more,
                reply=reply,
                verdict=None if reply is None else classify(reply, ()),
            )
            self.apply(failed)

    @rule(
        index=st.integers(0, 9),
        reusable=st.booleans(),
        reply=st.sampled_from([OK, THROTTLED, DEFERRED]),
        seconds=st.sampled_from([0.0005, 0.001, 0.5, 2.0]),  # calm, or slowed down
    )
    def done(self, index, reusable, reply, seconds):
        conn = self.pick("sending", index)
        if conn is not None:
            slot = self.slots[conn]
            key, follower = slot["destination"], slot.get("follower")
            slot["state"] = "idle" if reusable else "gone"
            slot["item"] = None
            if not reusable:
                del self.slots[conn]  # its slot ends: the core says nothing more of it
            actions = self.sched.done(
                self.now,
                conn,
                reusable=reusable,
                replies=[(reply, classify(reply, ()))],
                timings=[("mail", 0.0005), ("dot", seconds)],
            )
            sends = [a for a in actions if isinstance(a, Send) and a.conn == conn]
            if follower is not None and reusable and sends == [Send(conn, follower)]:
                slot["state"] = "followed"  # written behind the dot: it goes on
                self.apply(actions)
                return
            if follower is not None:  # the connection ended: it waits again
                assert not sends and (not reusable or of(actions, Close))
                slot.pop("follower")
                self.waiting[key][self.klass[follower]] += 1
            if reusable and conn in self.slots:
                slot["state"] = "done"  # a Close or a Send follows, or it idles
                closes = [a for a in actions if isinstance(a, Close) and a.conn == conn]
                sends = [a for a in actions if isinstance(a, Send) and a.conn == conn]
                if not closes:
                    slot["state"] = "idle"
                self.apply(actions)
                assert closes or sends or self.slots[conn]["state"] == "idle"
            else:
                self.apply(actions)

    @rule(index=st.integers(0, 9))
    def follow(self, index):
        """The content is next: the core may give the item that rides behind the dot."""
        conn = self.pick("sending", index)
        if conn is not None and "follower" not in self.slots[conn]:
            slot = self.slots[conn]
            item = self.sched.follow(self.now, conn)
            if item is not None:
                assert slot["sent"] + 1 <= self.pacing.messages_per_connection
                self.hand_out(slot["destination"], item)
                slot["follower"] = item

    @rule(index=st.integers(0, 9))
    def unfollow(self, index):
        """It could not be written (held meanwhile, say): back to its queue."""
        conns = sorted(c for c, s in self.slots.items() if s.get("follower"))
        if conns:
            conn = conns[index % len(conns)]
            slot = self.slots[conn]
            actions = self.sched.unfollow(self.now, conn)
            self.waiting[slot["destination"]][self.klass[slot.pop("follower")]] += 1
            self.apply(actions)

    @rule(key=st.sampled_from(["a", "b"]), concurrency=st.integers(1, 3))
    def operator_limit(self, key, concurrency):
        self.shapers[key].override(
            self.now, rate_per_minute=None, concurrency=concurrency, until=None
        )
        self.apply(self.sched.tick(self.now, key))

    # -- what must hold -------------------------------------------------------------------

    @invariant()
    def rates_hold(self):
        for key in self.shapers:
            for times, per_minute in (
                (self.connects[key], self.pacing.connections_per_minute),
                (self.messages[key], self.pacing.messages_per_minute),
            ):
                if not per_minute:
                    continue
                for i, j in itertools.combinations(range(len(times)), 2):
                    allowed = self.pacing.burst + per_minute / 60 * (times[j] - times[i])
                    assert j - i + 1 <= allowed + 1e-6, f"{key}: rate exceeded"

    @invariant()
    def idle_connections_are_admitted(self):
        """An idle connection over a lowered limit (a throttle cut, an operator) closed."""
        for key, shaper in self.shapers.items():
            here = [s for s in self.slots.values() if s["destination"] == key]
            reserved = sum(s["first_class"] for s in here)
            for slot in here:
                if slot["state"] == "idle":
                    assert shaper.keeps(self.now, len(here), reserved, slot["first_class"])

    @invariant()
    def work_goes_when_it_may(self):
        """No destination is left out of a decision: one whose pacing would let a message
        go now has no idle connection, and none could open while a global slot is free
        (whichever event freed it, at whichever destination)."""
        for key, shaper in self.shapers.items():
            waiting = sum(self.waiting[key].values())
            if not waiting or shaper.send_wait(self.now) > 0:
                continue
            here = [s for s in self.slots.values() if s["destination"] == key]
            p0 = self.waiting[key]["p0"] > 0  # a reserved connection takes only p0
            takers = [s for s in here if s["state"] == "idle" and (p0 or not s["first_class"])]
            assert not takers, "an idle connection"
            reserved = sum(s["first_class"] for s in here)
            if self.counted() < self.total and not self.unanswered(key):
                wait = shaper.connect_wait(self.now, len(here), reserved, first_class=False)
                assert wait > 0, "work could have had a connection"

    @invariant()
    def p0_goes_when_it_may(self):
        """p0 never waits behind bulk: if it waits at a destination whose pacing would
        let it go now, the core has acted (work-conserving for the first class)."""
        for key, shaper in self.shapers.items():
            if not self.waiting[key]["p0"] or shaper.send_wait(self.now) > 0:
                continue
            here = [s for s in self.slots.values() if s["destination"] == key]
            assert not any(s["state"] == "idle" for s in here), "an idle connection"
            reserved = sum(s["first_class"] for s in here)
            if self.counted() < self.total and not self.unanswered(key):
                wait = shaper.connect_wait(self.now, len(here), reserved, first_class=True)
                assert wait > 0, "p0 could have had a connection"


Storm.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_storm = Storm.TestCase
