"""Stress mode of the listener (mtaqueue.smtp.stress): when it starts and ends, and who
gives way to a newcomer."""

from __future__ import annotations

from mtaqueue.smtp.stress import QUIET_MIN, SessionView, Stress, shed


def test_stress_enters_at_80_percent_and_leaves_under_70():
    stress = Stress(100)
    assert [stress.update(n) for n in (10, 79)] == [None, None] and not stress.active
    assert stress.update(80) == "entered" and stress.active
    assert [stress.update(n) for n in (100, 75, 70)] == [None, None, None]  # no flapping
    assert stress.update(69) == "left" and not stress.active


def view(key: str, client: str, quiet: float, in_data: bool = False) -> SessionView:
    return SessionView(key, client, quiet, in_data)


def test_the_busiest_address_gives_way_its_quietest_session_first():
    sessions = [
        view("a1", "192.0.2.1", 50.0),  # the quietest of all, but its address holds one slot
        view("b1", "192.0.2.2", 3.0),
        view("b2", "192.0.2.2", 8.0),
        view("b3", "192.0.2.2", 0.1),
    ]
    assert shed(sessions, "192.0.2.9") == "b2"
    assert shed(sessions, "192.0.2.2") == "b2"  # its own newcomer too, a quiet one


def test_for_another_address_a_young_session_of_the_busiest_gives_way():
    # A flood that reconnects keeps its sessions young: another client still gets in...
    young = [view("b1", "192.0.2.2", 0.2), view("b2", "192.0.2.2", 0.1)]
    assert shed(young, "192.0.2.9") == "b1"
    # ...but the flood's own newcomers push out only sessions quiet for QUIET_MIN.
    assert shed(young, "192.0.2.2") is None


def test_a_session_in_data_or_busy_never_gives_way():
    sessions = [
        view("d1", "192.0.2.2", 30.0, in_data=True),  # a message on its way
        view("d2", "192.0.2.2", 30.0, in_data=True),
        view("c1", "192.0.2.3", QUIET_MIN / 2),
    ]
    assert shed(sessions, "192.0.2.2") is None
    assert shed([*sessions, view("c2", "192.0.2.3", QUIET_MIN)], "192.0.2.3") == "c2"
    assert shed(sessions, "192.0.2.9") == "c1"  # 192.0.2.3 holds fewer slots than .2 but
    # .2's are all in DATA: .3's young session goes for a newcomer holding none
