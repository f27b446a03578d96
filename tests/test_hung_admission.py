"""Hung or slow destinations cannot starve the rest (scheduler/slots.py, scheduler/connecting.py,
the core's hung signal), with a fake clock: one connect until a destination answers, lame
connects parked out of the global count (up to a cap), a fair share while others wait, and a
destination's timeout one outage for its whole queue."""

from __future__ import annotations

from mtaqueue import config
from mtaqueue.config import DEFAULT_CLASSES
from mtaqueue.policy.breaker import CLOSED, OPEN
from mtaqueue.policy.classify import classify
from mtaqueue.policy.replies import Reply
from mtaqueue.policy.shaper import DestinationShaper
from mtaqueue.scheduler.actions import Close, Connect, GiveUp, Send, Wake
from mtaqueue.scheduler.connecting import PARKED_PER_SLOT, PATIENCE, Connecting
from mtaqueue.scheduler.core import Scheduler

CLASSES = {name: (c.priority, c.weight) for name, c in DEFAULT_CLASSES.items()}
T0 = 1_000_000.0
OK = Reply("data_end", 250, "2.0.0", "ok")
NO_BANNER = Reply("banner", 0, "", "timed out waiting for the banner reply", network="timeout")
REFUSED = Reply("connect", 0, "", "refused", network="refused")


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def ok():
    return [(OK, classify(OK, ()))]


def core(slots: int, *keys: str, **pacing) -> Scheduler:
    sched = Scheduler(CLASSES, max_connections=slots, connection_idle=5.0)
    for key in keys:
        add(sched, key, **pacing)
    return sched


def add(sched: Scheduler, key: str, *, shaping=None, **keys) -> DestinationShaper:
    p = config.Pacing(**{"reserved_p0": 0, **keys})
    shaper = DestinationShaper(p, shaping or config.ShapingConfig(), T0)
    sched.add_destination(key, shaper, p)
    return shaper


def failed(sched, now, conn, reply, more_hosts=False):
    return sched.connect_failed(
        now, conn, more_hosts=more_hosts, reply=reply, verdict=classify(reply, ())
    )


# -- connecting.py: parking, pure --------------------------------------------------------


def test_a_connect_unanswered_past_the_patience_stops_counting_up_to_the_cap():
    connecting = Connecting(patience=1.0, parked_per_slot=2)
    for conn in range(1, 5):
        connecting.start(conn, T0 + conn * 0.1)
    assert connecting.in_use(4, 2, T0 + 1.05) == 4 and connecting.parks_at(2) == T0 + 1.1
    assert connecting.in_use(4, 2, T0 + 1.25) == 2  # two lame, parked
    assert connecting.in_use(4, 2, T0 + 9) == 0  # all four: 2 x 2 parked at most
    assert connecting.parks_at(2) is None
    connecting.start(5, T0 + 9)
    assert connecting.in_use(5, 2, T0 + 20) == 1 and connecting.parks_at(2) is None  # capped
    connecting.answered(2)  # it greeted at last (or failed): counted as any slot again
    assert connecting.in_use(4, 2, T0 + 20) == 0 and connecting.parked == 4


# -- one connect until the destination answers ------------------------------------------


def test_a_destination_opens_one_connect_until_it_answers_then_more():
    sched = core(100, "d", initial_connections=3, max_connections=3)
    actions = []
    for i in range(5):
        actions += sched.enqueue(T0, "d", f"m{i}", "p2")
    (first,) = of(actions, Connect)
    assert not of(sched.tick(T0 + 60), Connect)  # no answer, however long: still one
    more = of(sched.connected(T0 + 60, first.conn), Connect)
    assert len(more) == 2  # it answered: up to its limit at once


def test_a_lame_connect_holds_its_destination_back_even_with_one_up():
    sched = core(100, "d", initial_connections=4, max_connections=4)
    (first,) = of(sched.enqueue(T0, "d", "m0", "p2"), Connect)
    sched.connected(T0, first.conn)
    (second,) = of(sched.enqueue(T0 + 1, "d", "m1", "p2"), Connect)  # one up: may open
    assert not of(sched.enqueue(T0 + 1 + PATIENCE, "d", "m2", "p2"), Connect)  # second lame
    assert of(sched.connected(T0 + 2, second.conn), Connect)  # it answered: m2 goes


# -- lame connects parked: the one that answers gets a slot ------------------------------


def follow(sched: Scheduler, actions: list, until: float, on_connect) -> float:
    """Run the fake clock along the core's Wakes up to `until`; `on_connect(connect, now)`
    for each Connect. The time reached."""
    now = T0
    while True:
        for connect in of(actions, Connect):
            on_connect(connect, now)
        wakes = of(actions, Wake)
        if not wakes or wakes[-1].at > until:
            return now
        now = max(now, wakes[-1].at)
        actions = sched.tick(now)


def test_500_hung_destinations_do_not_keep_the_one_that_answers_from_a_slot():
    """Every hung destination's mail first, the healthy one's last: it still connects
    within a few PATIENCEs (100 slots a round), each hung one holding one connect."""
    sched = core(100)
    actions = []
    for i in range(500):
        add(sched, f"hung{i}")
        for j in range(3):  # several messages each: still one connect each
            actions += sched.enqueue(T0, f"hung{i}", f"h{i}.{j}", "p2")
    add(sched, "healthy")
    actions += sched.enqueue(T0, "healthy", "mail", "p0")
    seen: dict[str, float] = {}

    def on_connect(connect, now):
        assert connect.destination not in seen, "a second connect to a hung destination"
        seen[connect.destination] = now

    follow(sched, actions, T0 + 2, on_connect)
    assert seen["healthy"] <= T0 + 6 * PATIENCE <= T0 + 2
    assert len(seen) == 501
    assert sched.slots("hung0") == (1, 0)


def test_past_the_parking_cap_lame_connects_count_again():
    limit = 1
    sched = core(limit)
    cap = limit * PARKED_PER_SLOT
    hung = [f"hung{i}" for i in range(cap + 1)]
    actions = []
    for key in hung:
        add(sched, key)
        actions += sched.enqueue(T0, key, f"m-{key}", "p2")
    add(sched, "healthy")
    actions += sched.enqueue(T0, "healthy", "mail", "p2")
    connects: dict[str, int] = {}
    follow(sched, actions, T0 + 60, lambda c, now: connects.setdefault(c.destination, c.conn))
    assert set(connects) == set(hung)  # cap parked, one counted: the healthy one waits
    assert not of(sched.tick(T0 + 600), Connect)
    # One of them times out: its slot goes to the one waiting.
    actions = failed(sched, T0 + 600, connects["hung0"], NO_BANNER)
    assert [c.destination for c in of(actions, Connect)] == ["healthy"]


# -- a timeout is one outage for the destination's queue ---------------------------------


def test_a_banner_timeout_opens_the_breaker_and_the_queue_waits_for_one_probe():
    shaping = config.ShapingConfig(breaker_cooldown=30.0)
    sched = core(100)
    shaper = add(sched, "d", shaping=shaping)
    actions = []
    for i in range(50):
        actions += sched.enqueue(T0, "d", f"m{i}", "p1")
    (first,) = of(actions, Connect)
    actions = failed(sched, T0 + 300, first.conn, NO_BANNER)
    assert [g.item for g in of(actions, GiveUp)] == ["m0"]  # the one attempt charged
    assert shaper.state(T0 + 300).circuit == OPEN  # one outage: the breaker, at once
    assert not of(actions, Connect) and sched.waiting("d")["p1"] == 49  # they wait, uncharged
    assert of(actions, Wake)[-1].at == T0 + 330
    (probe,) = of(sched.tick(T0 + 330), Connect)  # one probe after the cooldown
    assert not of(sched.tick(T0 + 400), Connect)  # nothing more while it is out
    sched.connected(T0 + 401, probe.conn)
    actions = sched.done(T0 + 401, probe.conn, reusable=True, replies=ok())
    assert shaper.state(T0 + 401).circuit == CLOSED


def test_a_timeout_with_another_host_to_try_or_a_connection_up_is_no_outage():
    sched = core(100)
    shaper = add(sched, "d", initial_connections=4, max_connections=4)
    (first,) = of(sched.enqueue(T0, "d", "m0", "p2"), Connect)
    actions = failed(sched, T0 + 30, first.conn, NO_BANNER, more_hosts=True)  # limit 4 -> 2
    assert of(actions, Connect) == [Connect(first.conn, "d", "m0", False)]  # the next host
    assert shaper.state(T0 + 30).circuit == CLOSED
    sched.connected(T0 + 31, first.conn)
    (second,) = of(sched.enqueue(T0 + 31, "d", "m1", "p2"), Connect)
    failed(sched, T0 + 60, second.conn, NO_BANNER)  # the site answers on the other one
    assert shaper.state(T0 + 60).circuit == CLOSED
    sched2 = core(100)
    shaper2 = add(sched2, "d")
    (refused,) = of(sched2.enqueue(T0, "d", "m0", "p2"), Connect)
    failed(sched2, T0, refused.conn, REFUSED)  # an answer (RST), counted as usual
    assert shaper2.state(T0).circuit == CLOSED


# -- a fair share while others wait -----------------------------------------------------


def test_a_destination_over_its_share_gives_a_slot_to_one_waiting():
    sched = core(4, "big", "small", initial_connections=4, max_connections=4)
    actions = []
    for i in range(20):
        actions += sched.enqueue(T0, "big", f"b{i}", "p2")
    (first,) = of(actions, Connect)
    conns = [first.conn] + [c.conn for c in of(sched.connected(T0, first.conn), Connect)]
    assert len(conns) == 4  # alone, it gets every global slot its pacing allows
    for conn in conns[1:]:
        sched.connected(T0, conn)
    assert not of(sched.enqueue(T0 + 1, "small", "s0", "p2"), Connect)  # no slot: it waits
    actions = sched.done(T0 + 2, conns[0], reusable=True, replies=ok())
    assert of(actions, Close) == [Close(conns[0])]  # 4 > 4 // 2: not more work, closed
    (small,) = of(actions, Connect)
    assert small.destination == "small"
    sched.connected(T0 + 2, small.conn)
    # Nobody waits now: big goes on with its three.
    actions = sched.done(T0 + 3, conns[1], reusable=True, replies=ok())
    assert of(actions, Send) == [Send(conns[1], "b4")] and not of(actions, Close)


def test_an_idle_connection_closes_at_once_while_another_destination_waits():
    sched = core(1, "a", "b")
    (conn,) = of(sched.enqueue(T0, "a", "a0", "p2"), Connect)
    sched.connected(T0, conn.conn)
    assert not of(sched.enqueue(T0, "b", "b0", "p2"), Connect)  # the one slot is a's
    actions = sched.done(T0 + 1, conn.conn, reusable=True, replies=ok())
    assert of(actions, Close) == [Close(conn.conn)]  # not kept idle for connection_idle
    assert [c.destination for c in of(actions, Connect)] == ["b"]


def test_alone_a_destination_keeps_its_idle_connection_and_is_not_capped():
    sched = core(2, "a", initial_connections=2, max_connections=2)
    (conn,) = of(sched.enqueue(T0, "a", "a0", "p2"), Connect)
    sched.connected(T0, conn.conn)
    actions = sched.done(T0 + 1, conn.conn, reusable=True, replies=ok())
    assert not of(actions, Close)  # idle for connection_idle: nobody waits
    assert of(sched.tick(T0 + 6), Close) == [Close(conn.conn)]
