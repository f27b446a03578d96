"""policy/warmup.py: a warming source's daily allowance per destination, its step, its hold."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtaqueue import config
from mtaqueue.policy import warmup
from mtaqueue.policy.egress import EgressState
from mtaqueue.policy.warmup import DAY, Warmups
from mtaqueue.routing.pools import Pools, Source

NEW = Source("192.0.2.11", warmup=(2, 5, 10))
WARM = Source("192.0.2.12")
MX = "mx.example.org"
T0 = 20_000 * DAY + 3600.0  # an hour into a UTC day


def send(warmups: Warmups, now: float, accepted: int, deferred: int = 0) -> None:
    for _ in range(accepted):
        warmups.record(MX, NEW, now, True)
    for _ in range(deferred):
        warmups.record(MX, NEW, now, False)


def test_a_day_allows_its_step_then_the_next_day_the_next_step() -> None:
    warmups = Warmups()
    assert warmups.left(MX, NEW, T0) == 2 and warmups.left(MX, WARM, T0) is None
    send(warmups, T0, 2)
    assert warmups.left(MX, NEW, T0 + 3600) == 0
    assert warmups.left("mx.other.test", NEW, T0) == 2  # per destination
    assert warmups.left(MX, NEW, T0 + DAY) == 5
    (step,) = warmups.drain()
    assert not step.held and step.step == 2 and step.allowance == 5 and step.sent == 2
    send(warmups, T0 + DAY, 5)
    send(warmups, T0 + 2 * DAY, 1)
    assert warmups.left(MX, NEW, T0 + 3 * DAY) is None  # past the schedule: warm
    assert warmups.drain()[-1].allowance is None


def test_rising_deferrals_hold_the_step_and_a_quiet_day_changes_nothing() -> None:
    warmups = Warmups()
    send(warmups, T0, 2)
    send(warmups, T0 + DAY, 4, deferred=1)  # 20% deferred: held at 5
    assert warmups.left(MX, NEW, T0 + 2 * DAY) == 5
    (_, held) = warmups.drain()
    assert held.held and held.step == 2 and held.rate == pytest.approx(0.2)
    assert held.previous_rate == 0.0 and held.deferred == 1
    # A day without mail: no step; the last rate stays the one to beat.
    assert warmups.left(MX, NEW, T0 + 3 * DAY) == 5 and not warmups.drain()
    send(warmups, T0 + 3 * DAY, 5)
    assert warmups.left(MX, NEW, T0 + 4 * DAY) == 10


def test_a_small_steady_deferral_rate_does_not_hold_the_ramp() -> None:
    ramp = warmup.Ramp(step=0, day=1, sent=97, deferred=3, rate=0.02)
    rolled, held = warmup.roll(ramp, (100, 200), 2 * DAY)
    assert held is False and rolled.step == 1 and rolled.sent == 0
    assert warmup.roll(rolled, (100, 200), 2 * DAY - 1) == (rolled, None)  # a clock gone back


def test_waiting_mail_comes_back_early_the_next_day_spread() -> None:
    rng = random.Random(1)
    wakes = [warmup.wake(T0, rng, 3600.0) for _ in range(50)]
    assert all(20_001 * DAY <= t <= 20_001 * DAY + 3600.0 for t in wakes)
    assert len(set(wakes)) == 50


def test_the_pools_warmup_spread_says_over_how_much_of_the_next_day() -> None:
    rng = random.Random(2)
    assert warmup.wake(T0, rng, 0.0) == 20_001 * DAY  # "0s": at midnight
    assert warmup.wake(20_001 * DAY - 0.001, rng, 0.0) == 20_001 * DAY  # a moment before
    wakes = [warmup.wake(T0, rng, 10.0) for _ in range(50)]
    assert all(20_001 * DAY <= t <= 20_001 * DAY + 10.0 for t in wakes)
    sources = 'pools.b.sources=["192.0.2.11"]'
    assert Pools(config.load(None, [sources])).pools["b"].warmup_spread == 3600.0  # 1h
    cfg = config.load(None, [sources, 'pools.b.warmup_spread="10s"'])
    assert Pools(cfg).pools["b"].warmup_spread == 10.0
    with pytest.raises(config.ConfigError, match=r"pools.b.warmup_spread: must be from 0s to 1d"):
        config.load(None, [sources, 'pools.b.warmup_spread="2d"'])


@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=5, unique=True).map(sorted),
    st.lists(st.tuples(st.floats(0, 3 * DAY), st.booleans()), max_size=300),
)
def test_a_day_never_carries_more_than_its_allowance_and_holds_never_advance(
    schedule: list[int], events: list[tuple[float, bool]]
) -> None:
    source = Source("192.0.2.13", warmup=tuple(schedule))
    egress = EgressState()
    accepted: dict[int, int] = {}
    step = 1
    for offset, ok in sorted(events):
        now = T0 + offset
        chosen = egress.choose((source,), MX, {4}, lambda _: 0, now)
        for change in egress.warmup.drain():
            assert change.step == (step if change.held else min(step + 1, len(schedule) + 1))
            assert change.held == (change.rate >= 0.1 or change.rate > change.previous_rate + 0.05)
            step = change.step
        if chosen is None:
            continue
        egress.warmup.record(MX, source, now, ok)
        day = warmup.day_of(now)
        accepted[day] = accepted.get(day, 0) + ok
        if step <= len(schedule):
            assert accepted[day] <= schedule[step - 1]


def test_the_ramps_survive_a_restart() -> None:
    egress = EgressState()
    egress.warmup.record(MX, NEW, T0, True)
    again = EgressState()
    again.restore(egress.encode(T0))
    assert again.warmup.left(MX, NEW, T0) == 1
    assert again.snapshot(MX, NEW, T0)["warmup"] == {
        "step": 1,
        "steps": 3,
        "allowance": 2,
        "sent_today": 1,
        "deferred_today": 0,
        "held": False,
        "last_rate": 0.0,
    }
    assert again.snapshot(MX, WARM, T0)["warmup"] is None


def test_a_full_source_is_not_chosen_counting_its_waiting_mail() -> None:
    egress = EgressState()
    load = {NEW: 1, WARM: 5}
    assert egress.choose((NEW, WARM), MX, {4}, load.__getitem__, T0) == NEW
    egress.warmup.record(MX, NEW, T0, True)  # 1 sent + 1 waiting = the day's 2
    assert egress.choose((NEW, WARM), MX, {4}, load.__getitem__, T0) == WARM
    assert egress.choose((NEW,), MX, {4}, load.__getitem__, T0) is None
    assert egress.warming((NEW,), MX, {4}, T0)
    egress.exclude(MX, NEW, T0, 60.0)
    assert not egress.warming((NEW,), MX, {4}, T0)


def test_a_source_table_names_its_schedule_which_must_grow() -> None:
    cfg = config.load(None, ['pools.b.sources=[{address = "192.0.2.11", warmup = [5, 50]}]'])
    (pool,) = Pools(cfg).pools.values()
    assert pool.sources == (Source("192.0.2.11", warmup=(5, 50)),)
    for bad in ("[5, 5]", "[0, 5]", "[50, 5]"):
        with pytest.raises(config.ConfigError, match=r"pools.b.sources\[0\].warmup: use incr"):
            config.load(None, [f'pools.b.sources=[{{address = "::1", warmup = {bad}}}]'])


# -- an operator's restart and finish (mtaqueue-ctl warmup) ------------------------------------


def test_a_restart_goes_back_to_the_first_step_and_today_still_counts() -> None:
    warmups = Warmups()
    send(warmups, T0, 2)
    send(warmups, T0 + DAY, 5)
    send(warmups, T0 + 2 * DAY, 1)  # day 3: step 3 (10 a day), 1 sent
    ramp = warmups.move(MX, NEW, T0 + 2 * DAY + 60, to_first=True)
    assert ramp == warmup.Ramp(step=0, day=20_002, sent=1, deferred=0, rate=0.0, held=False)
    assert warmups.left(MX, NEW, T0 + 2 * DAY + 120) == 1  # the first step's 2, less today's 1
    assert warmups.left(MX, NEW, T0 + 3 * DAY) == 5  # and it ramps again from there
    assert warmups.bases(NEW.address) == [MX] and warmups.bases(WARM.address) == []


def test_a_restart_after_a_day_end_rolls_first() -> None:
    held = warmup.Ramp(step=1, day=20_000, sent=8, deferred=2, rate=0.2, held=True)
    again = warmup.restart(held, NEW.warmup, T0 + DAY)
    assert again == warmup.Ramp(step=0, day=20_001)  # yesterday's counts are yesterday's


def test_a_finished_ramp_is_warm_keeps_the_day_and_survives_a_restart() -> None:
    egress = EgressState()
    send(egress.warmup, T0, 2)
    assert egress.warmup.left(MX, NEW, T0) == 0
    ramp = egress.warmup.move(MX, NEW, T0 + 60, to_first=False)
    assert ramp.step == len(NEW.warmup) and ramp.sent == 2 and not ramp.held
    assert egress.warmup.left(MX, NEW, T0 + 60) is None
    again = EgressState()
    again.restore(egress.encode(T0 + 60))
    shown = again.snapshot(MX, NEW, T0 + 60)["warmup"]
    assert shown["step"] == 4 and shown["allowance"] is None and shown["sent_today"] == 2
    # Restarted, it is on the first step again, whatever it did before.
    assert again.warmup.move(MX, NEW, T0 + 120, to_first=True).step == 0
    assert again.warmup.left(MX, NEW, T0 + 120) == 0  # 2 sent today: the first step's 2
    assert again.choose((NEW,), MX, {4}, lambda _: 0, T0 + 120) is None
    again.warmup.move(MX, NEW, T0 + 180, to_first=False)
    assert again.warmup.left(MX, NEW, T0 + 5 * DAY) is None  # warm stays warm


def test_a_move_logs_the_day_end_it_came_across() -> None:
    warmups = Warmups()
    send(warmups, T0, 2)
    warmups.move(MX, NEW, T0 + DAY, to_first=True)
    (step,) = warmups.drain()
    assert step.step == 2 and not step.held  # the day end, as at any first look of the day
