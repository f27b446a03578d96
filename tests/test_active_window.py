"""The active window (scheduler/active.py) and the warm-up waits (delivery/warm_waits.py):
pure state, no clock but the `now` passed in."""

from __future__ import annotations

import random

from mtaqueue.delivery.warm_waits import WarmWaits
from mtaqueue.policy import warmup
from mtaqueue.scheduler.active import ActiveWindow

DAY = 86_400.0
T0 = 20_000 * DAY + 3_600.0  # 01:00 UTC on some day


def test_busy_recipients_hold_room_until_the_last_is_freed():
    window = ActiveWindow(chunk=10, limit=3)
    window.occupy("a").update({0, 1})
    window.occupy("b").add(0)
    assert window.room() == 1
    window.free("a", [0])
    assert window.busy["a"] == {1} and window.room() == 1
    window.free("a", [1])  # its last recipient: the message leaves the window
    assert "a" not in window.busy and window.room() == 2
    window.admit("c")  # let in at start: holds room until dispatched
    assert window.room() == 1


def test_the_line_lets_the_first_class_through_first_a_chunk_at_a_time():
    window = ActiveWindow(chunk=2, limit=100)
    window.line_up(["b1", "p1", "b2", "p2", "p3"], first={"p1", "p2", "p3"})
    assert window.waiting()
    assert window.take() == ["p1", "p2"]
    assert window.take() == ["p3"]  # the first class's line empties before the rest
    assert window.take() == ["b1", "b2"]
    assert not window.waiting() and window.take() == []


def test_the_line_waits_while_the_window_is_full():
    window = ActiveWindow(chunk=5, limit=2)
    window.occupy("x").add(0)
    window.occupy("y").add(0)
    window.line_up(["m"], first=set())
    assert window.take() == []  # no room: nothing is let through
    window.free("x", [0])
    assert window.take() == ["m"]


def test_an_internal_wait_goes_uncharged_once_per_attempt():
    window = ActiveWindow(chunk=1)
    assert window.uncharged_wait("m")
    assert not window.uncharged_wait("m")  # a repeat counts as an attempt
    window.refused("m", 2)
    assert window.refusals("m") == 2
    window.attempted("m")  # an attempt: both count from here
    assert window.uncharged_wait("m") and window.refusals("m") == 0


def test_end_forgets_everything_of_a_message():
    window = ActiveWindow(chunk=1)
    window.occupy("m").add(3)
    window.uncharged_wait("m")
    window.refused("m", 1)
    window.end("m")
    assert "m" not in window.busy and window.refusals("m") == 0 and window.uncharged_wait("m")


def test_a_destinations_waiting_mail_comes_back_together_on_the_next_day():
    waits = WarmWaits()
    rng = random.Random(7)
    first = waits.wait("mx.example", "m1", T0, rng, 3_600.0, back=None)
    second = waits.wait("mx.example", "m2", T0 + 60, rng, 3_600.0, back=None)
    assert first == second  # one wake a destination, not one a message
    assert warmup.day_of(first) == warmup.day_of(T0) + 1
    assert waits.waiting_for("m1", T0)["until"] == first
    assert waits.waiting_for("m1", first) is None  # over once the wake came
    other = waits.wait("mx.other", "m3", T0, rng, 3_600.0, back=T0 + 10)
    assert other == T0 + 10  # the source is usable again sooner: it goes then


def test_a_wake_drawn_for_a_day_that_has_begun_is_drawn_again():
    waits = WarmWaits()
    rng = random.Random(1)
    wake = waits.wait("mx.example", "m1", T0, rng, 60.0, back=None)
    later = wake + 10  # that next day has begun: a new wait is for the day after
    again = waits.wait("mx.example", "m2", later, rng, 60.0, back=None)
    assert warmup.day_of(again) == warmup.day_of(later) + 1


def test_a_finished_ramp_releases_its_waiting_mail_and_prune_forgets_the_past():
    waits = WarmWaits()
    rng = random.Random(3)
    waits.wait("mx.example", "m1", T0, rng, 60.0, back=None)
    waits.wait("mx.example", "m2", T0, rng, 60.0, back=T0 + 5)
    assert waits.release("mx.example", T0 + 6) == ["m1"]  # m2's wait is over already
    assert waits.release("mx.example", T0 + 6) == []
    waits.wait("mx.b", "m3", T0, rng, 60.0, back=T0 + 5)
    waits.prune(T0 + 6)
    assert waits.waiting_for("m3", T0) is None
