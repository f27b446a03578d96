"""The rate ceiling reply latency teaches (mtaqueue.policy.pace_cap): pure, time passed in."""

from __future__ import annotations

import pytest

from mtaqueue.policy.pace_cap import BETA, GROW, HOLD, HOLD_MAX, SETTLE, STEP, PaceCap


def test_no_ceiling_until_a_cut_and_then_a_margin_under_what_was_taken():
    pace = PaceCap()
    assert pace.rate == 0.0 and not pace.binds(1000.0)
    assert not pace.grow(100.0)  # nothing to grow
    assert pace.cut(10.0, 16.0)
    assert pace.rate == pytest.approx(BETA * 16.0)
    assert pace.binds(BETA * 16.0) and not pace.binds(0.5 * BETA * 16.0)


def test_one_cut_an_episode_the_site_remembers_its_window():
    pace = PaceCap()
    pace.cut(10.0, 16.0)
    assert not pace.cut(10.0 + SETTLE / 2, 14.0)  # the same episode's replies
    assert pace.rate == pytest.approx(BETA * 16.0)
    assert pace.cut(10.0 + SETTLE, 12.0)  # still stretched: again, under both
    assert pace.rate == pytest.approx(BETA * 12.0)


def test_steps_up_one_at_a_time_spaced_and_steps_back_with_a_margin_held():
    pace = PaceCap()
    pace.cut(0.0, 10.0)
    level = pace.rate
    assert not pace.grow(STEP / 2)  # a change shows only after the site's window
    assert pace.grow(STEP) and pace.rate == pytest.approx(level * GROW)
    assert pace.raised_at == STEP
    pace.step_back(STEP + 1, accepted=level / BETA)  # that step stretched the replies
    assert pace.rate == pytest.approx(level)  # back where it was calm
    assert pace.raised_at is None
    assert not pace.grow(STEP + 1 + HOLD / 2)  # held at the level found
    assert pace.grow(STEP + 1 + HOLD)


def test_a_step_back_under_a_ceiling_that_was_itself_too_high_goes_lower():
    pace = PaceCap()
    pace.cut(0.0, 20.0)  # 17
    pace.grow(STEP)  # 18.7
    pace.step_back(STEP + 1, accepted=15.0)  # the site took 15: 12.75
    assert pace.rate == pytest.approx(BETA * 15.0)


def test_the_same_level_found_again_doubles_the_hold_up_to_a_maximum():
    pace, holds = PaceCap(), []
    pace.cut(0.0, 10.0)
    level, now = pace.rate, STEP
    assert pace.grow(now)
    for _ in range(7):
        pace.step_back(now, accepted=level / BETA)
        assert pace.rate == pytest.approx(level)
        start = now
        while not pace.grow(now):
            now += 1.0
        holds.append(now - start)
    assert holds == [HOLD, 2 * HOLD, 4 * HOLD, 8 * HOLD, HOLD_MAX, HOLD_MAX, HOLD_MAX]


def test_what_was_learned_is_held_after_a_restart_and_forgotten_on_reset():
    pace = PaceCap(12.0, now=100.0)
    assert pace.rate == 12.0
    assert not pace.grow(100.0 + HOLD / 2)  # a restart holds the level learned
    assert pace.grow(100.0 + HOLD)
    pace.reset()
    assert pace.rate == 0.0 and pace.raised_at is None
