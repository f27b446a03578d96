"""Adaptive concurrency (mtaqueue.policy.concurrency)."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mtaqueue.policy.concurrency import HOLD, HOLD_MAX, AdaptiveConcurrency


def limits_after_successes(
    concurrency: AdaptiveConcurrency, count: int, now: float = 0.0, calm: bool = True
) -> list[int]:
    """Each success followed by a latency round (calm unless told otherwise)."""
    limits = []
    for _ in range(count):
        concurrency.success(now)
        concurrency.steady(calm)
        limits.append(concurrency.limit)
    return limits


def test_starts_at_initial_within_bounds():
    assert AdaptiveConcurrency(2, 10).limit == 2
    assert AdaptiveConcurrency(20, 10).limit == 10
    assert AdaptiveConcurrency(0, 10).limit == 1
    with pytest.raises(ValueError):
        AdaptiveConcurrency(1, 0)


def test_grows_by_one_after_limit_successes():
    concurrency = AdaptiveConcurrency(2, 5)
    # 2 successes at 2, 3 at 3, 4 at 4, then the ceiling.
    assert limits_after_successes(concurrency, 12) == [2, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5]


def test_each_step_up_waits_for_a_calm_round():
    concurrency = AdaptiveConcurrency(2, 10)
    assert concurrency.success(0.0) is False
    assert concurrency.success(0.0) is True  # the first step needs no round
    assert concurrency.raised_at == 0.0
    for _ in range(10):  # no round closed since: the level is not judged yet
        assert concurrency.success(1.0) is False
    concurrency.steady(False)  # a slow or mixed round: still no
    assert concurrency.success(1.0) is False
    concurrency.steady(True)
    assert concurrency.success(2.0) is True
    assert (concurrency.limit, concurrency.raised_at) == (4, 2.0)


def test_throttled_halves_down_to_one():
    concurrency = AdaptiveConcurrency(10, 10)
    halvings = []
    for _ in range(5):
        concurrency.throttled()
        halvings.append(concurrency.limit)
    assert halvings == [5, 2, 1, 1, 1]


def test_a_cut_restarts_the_success_count():
    concurrency = AdaptiveConcurrency(4, 10)
    limits_after_successes(concurrency, 3)  # one short of growing
    concurrency.throttled()
    assert concurrency.limit == 2
    assert limits_after_successes(concurrency, 2) == [2, 3]


def step_up(concurrency: AdaptiveConcurrency, now: float, tries: int = 50) -> bool:
    """Calm rounds and successes until the limit grows once (no round judges it after)."""
    for _ in range(tries):
        concurrency.steady(True)
        if concurrency.success(now):
            return True
    return False


def test_a_step_back_holds_at_the_knee_then_probes_again():
    concurrency = AdaptiveConcurrency(6, 10)
    assert step_up(concurrency, 0.0) and concurrency.limit == 7
    concurrency.step_back(10.0)  # 7 slowed the site: 6 is its knee
    assert (concurrency.limit, concurrency.knee) == (6, 6)
    assert not step_up(concurrency, 10.0 + HOLD - 1)
    assert step_up(concurrency, 10.0 + HOLD) and concurrency.limit == 7  # a probe
    concurrency.step_back(200.0)  # the same knee again: held twice as long
    assert not step_up(concurrency, 200.0 + 2 * HOLD - 1)
    assert step_up(concurrency, 200.0 + 2 * HOLD) and concurrency.limit == 7
    concurrency.steady(True)  # a calm round past the knee: forgotten
    assert concurrency.knee == 0
    assert step_up(concurrency, 1000.0) and concurrency.limit == 8


def test_the_hold_doubles_up_to_its_ceiling():
    concurrency = AdaptiveConcurrency(3, 10)
    now = 0.0
    for _ in range(10):
        assert step_up(concurrency, now) and concurrency.limit == 4  # the hold is over
        concurrency.step_back(now)
        now += HOLD_MAX
    assert not step_up(concurrency, now - 1)
    assert step_up(concurrency, now)


def test_below_the_knee_growth_is_not_held():
    concurrency = AdaptiveConcurrency(8, 10)
    limits_after_successes(concurrency, 8)
    concurrency.step_back(0.0)  # knee 8
    concurrency.throttled()  # a slowdown at a level it liked: halved, the knee unknown
    assert (concurrency.limit, concurrency.knee) == (4, 0)
    assert limits_after_successes(concurrency, 4 + 5 + 6 + 7, now=1.0)[-1] == 8


def test_a_learned_knee_is_held_from_the_start():
    concurrency = AdaptiveConcurrency(2, 10, knee=4, now=100.0)
    assert max(limits_after_successes(concurrency, 40, now=100.0 + HOLD - 1)) == 4
    assert limits_after_successes(concurrency, 4, now=100.0 + HOLD)[-1] == 5


def test_reset_ramps_from_one():
    concurrency = AdaptiveConcurrency(2, 10)
    limits_after_successes(concurrency, 30)
    concurrency.success(0.0)  # a step up that no round judged yet
    concurrency.reset()
    assert concurrency.limit == 1
    assert limits_after_successes(concurrency, 6) == [2, 2, 3, 3, 3, 4]
    concurrency.reset(50)
    assert concurrency.limit == 10
    concurrency.reset(0)
    assert concurrency.limit == 1


def test_cap_moves_the_ceiling():
    concurrency = AdaptiveConcurrency(8, 10)
    concurrency.cap(3)
    assert (concurrency.limit, concurrency.maximum) == (3, 3)
    concurrency.cap(10)
    assert concurrency.limit == 3  # grows back by successes, not at once
    assert limits_after_successes(concurrency, 3) == [3, 3, 4]
    concurrency.cap(0)
    assert (concurrency.limit, concurrency.maximum) == (1, 1)


class Concurrency(RuleBasedStateMachine):
    """Random feedback: the limit stays within its bounds, grows one step at a time and
    only after a calm round, and never past a knee while it is held."""

    def __init__(self) -> None:
        super().__init__()
        self.concurrency = AdaptiveConcurrency(2, 10)
        self.now = 0.0
        self.calm = True
        self.held_until = 0.0

    @rule()
    def success(self):
        before, knee = self.concurrency.limit, self.concurrency.knee
        grew = self.concurrency.success(self.now)
        assert self.concurrency.limit == before + grew
        if grew:
            assert self.calm
            assert not knee or before < knee or self.now >= self.held_until
            self.calm = False

    @rule(calm=st.booleans())
    def steady(self, calm):
        self.concurrency.steady(calm)
        self.calm = calm

    @rule()
    def throttled(self):
        before = self.concurrency.limit
        self.concurrency.throttled()
        assert self.concurrency.limit == max(1, before // 2)

    @rule()
    def step_back(self):
        before = self.concurrency.limit
        self.concurrency.step_back(self.now)
        assert self.concurrency.limit == self.concurrency.knee == max(1, before - 1)
        self.held_until = self.now + HOLD

    @rule(seconds=st.sampled_from([1.0, 60.0, HOLD, HOLD_MAX]))
    def wait(self, seconds):
        self.now += seconds

    @rule(limit=st.integers(-5, 30))
    def reset(self, limit):
        self.concurrency.reset(limit)
        self.calm = True
        assert self.concurrency.limit == min(max(1, limit), self.concurrency.maximum)

    @rule(maximum=st.integers(-5, 30))
    def cap(self, maximum):
        self.concurrency.cap(maximum)
        assert self.concurrency.maximum == max(1, maximum)

    @invariant()
    def within_bounds(self):
        assert 1 <= self.concurrency.limit <= self.concurrency.maximum


TestConcurrency = Concurrency.TestCase
