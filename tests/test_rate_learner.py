"""A destination's learned message rate (mtaqueue.policy.rate_learner), on a fake clock."""

from __future__ import annotations

import copy

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtaqueue.policy import rate_learner as rl
from mtaqueue.policy.buckets import TokenBucket
from mtaqueue.policy.rate_learner import Learned, RateLearner


def send_for(learner: RateLearner, start: float, seconds: float, ceiling: float = 0.0) -> float:
    """Send at the learned rate, every message delivered; returns the end time."""
    now = start
    while now < start + seconds:
        learner.sent(now)
        learner.delivered(now, ceiling)
        now += 1.0 / learner.limit(ceiling)
    return now


def refused_outright(learner: RateLearner, now: float) -> float:
    """anvil overrun at `now`, and refused again at the first message after the pause
    (its window has not ended); returns when that was."""
    learner.throttled(now, "450 4.7.1 Error: too much mail from 192.0.2.1")
    resumed = now + learner.wait(now)
    learner.sent(resumed)
    learner.throttled(resumed, "450 4.7.1 Error: too much mail from 192.0.2.1")
    return resumed


def test_slow_start_doubles_while_the_allowance_is_used():
    learner = RateLearner(0.0)
    assert learner.rate == rl.SLOW_START
    assert learner.phase(0.0, 0.0) == rl.SLOW_STARTING
    send_for(learner, 0.0, 5.0)
    assert learner.rate >= rl.SLOW_START * 2**4  # about one doubling a second


@pytest.mark.parametrize("cadence", [1.0, 0.96, 0.9])
def test_slow_start_grows_by_the_time_its_evidence_covers(cadence):
    # Paced sending lands deliveries a little inside a round as often as on its end; a
    # round counted only from a delivery past its end lost rounds (240 first attempts
    # took 2.5-2.8 s). Growth in proportion to the time covered: ~2.4 s at any cadence
    # (a doubling every ROUND from 2/s would be 2.1 s; at 2/s the evidence comes 0.5 s
    # apart, and a step grows by one round's doubling at most).
    learner, now = RateLearner(0.0), 0.0
    for _ in range(240):
        learner.sent(now)
        learner.delivered(now, 0.0)
        now += cadence / learner.limit(0.0)
    assert now < 2.45


def test_an_idle_destination_does_not_grow():
    learner = RateLearner(0.0)
    for i in range(100):  # one message every 4 s: far under its 2/s
        learner.sent(4.0 * i)
        learner.delivered(4.0 * i, 0.0)
    assert learner.rate == rl.SLOW_START


def test_the_ceiling_holds_and_0_is_none():
    learner = RateLearner(0.0)
    send_for(learner, 0.0, 30.0, ceiling=5.0)
    assert learner.limit(5.0) == 5.0
    assert learner.phase(30.0, 5.0) == rl.AT_CEILING
    assert learner.limit(0.0) == learner.rate  # no ceiling: still a rate, the learned one


def test_a_signal_pauses_and_cuts_to_a_fraction_of_the_acceptance():
    learner = RateLearner(0.0)
    learner.good, learner.rate = 30.0, 40.0  # past slow start
    for i in range(100):  # 10 a second accepted, sent at 40
        learner.sent(i / 10)
        learner.delivered(i / 10, 0.0)
    assert learner.accepted(10.0) == pytest.approx(10.0, rel=0.05)
    sent_at = learner.rate
    assert learner.throttled(10.0, "421 4.7.28 rate limited")
    assert learner.good == pytest.approx(10.0, rel=0.05)
    assert learner.rate == pytest.approx(rl.BETA * learner.good)
    assert learner.wait(10.0) == pytest.approx(rl.cooldown(sent_at))
    assert learner.phase(10.0, 0.0) == rl.PAUSED
    assert learner.rate_reply == "421 4.7.28 rate limited"


def test_leaving_slow_start_halves_what_was_measured():
    # A site with a burst allowance takes a slow start's first run at any pace, so the run
    # measures more than its rate: the first signal halves it, as TCP halves at a loss.
    learner = RateLearner(0.0)
    for i in range(40):  # 10 a second accepted while the ramp went far past it
        learner.sent(i / 10)
        learner.delivered(i / 10, 0.0)
    learner.rate = 64.0
    measured = learner.accepted(4.0)
    assert learner.throttled(4.0, "421")
    assert learner.good == pytest.approx(measured / 2)
    assert learner.rate == learner.good  # no further cut: the halving is the cut
    fresh = RateLearner(0.0)
    fresh.sent(0.0)
    fresh.delivered(0.0, 0.0)
    fresh.throttled(0.1, "421")  # measured 1/s over a 1 s floor, sent at 2/s
    assert fresh.good == pytest.approx(min(rl.SLOW_START, 1.0) / 2)


def test_a_lesson_forgotten_in_decay_leaves_slow_start_with_a_guess_again():
    # A limit measured long ago decays to nothing: the next slow start's halved guess is
    # probed past quickly, not held under as if the site had said no there.
    learner = RateLearner(0.0, Learned(5.0, 5.0, at=0.0))
    learner.sent(rl.QUIET + 3 * rl.HALF_LIFE)  # quiet so long that the good rate is gone
    assert learner.good == 0
    now = send_for(learner, rl.QUIET + 3 * rl.HALF_LIFE, 1.0)
    learner.throttled(now, "421 4.7.28 rate limited")
    guess = learner.good
    assert run_to(learner, 1.3 * guess, now + learner.wait(now))[0] < rl.PAST_EVERY


def test_idle_time_before_a_run_is_not_measured():
    # Flushed after an outage: the run began long after the learner did, and what the
    # site took is measured over the run, not over the quiet window before it.
    learner = RateLearner(0.0)
    for i in range(10):  # 10 a second, from t=100
        learner.sent(100 + i / 10)
        learner.delivered(100 + i / 10, 0.0)
    assert learner.accepted(101.0) == pytest.approx(10.0)


def test_idle_time_before_a_series_is_not_refused_time():
    """A flush after an outage: the learner was made a minute before the site took a
    message, and what it let go in the outage failed to connect. An anvil window overrun,
    then refused outright: what it took is measured from the first message it took, not
    from the quiet minute (that read 2 a second at a site taking 5)."""
    learner = RateLearner(0.0)
    learner.good, learner.rate = 8.0, 10.0  # past slow start
    for t in range(0, 55, 5):
        learner.sent(float(t))  # (connection refused: no answer for the learner)
    now = send_for(learner, 60.0, 10.0)
    delivered = learner._run_delivered
    resumed = refused_outright(learner, now)
    assert learner.good == pytest.approx(delivered / (resumed - 60.0), rel=0.01)


def test_a_step_past_the_limit_is_not_the_good_rate():
    # A step from 10 to 12 a second met the limit: the run measures at the rate sent (the
    # site's allowance lasted a while), and the limit lies between the rate before the
    # step and this one: the good rate is their middle, so recovery stays under the limit.
    learner = RateLearner(0.0)
    learner.good = learner.rate = 10.0
    learner._confirmed = True
    learner._set_rate(12.0, 0.0, "")
    for i in range(60):  # 12 a second, all taken
        learner.sent(i / 12)
        learner.delivered(i / 12, 0.0)
    assert learner.accepted(5.0) >= 12.0
    learner.throttled(5.0, "421 4.7.28 rate limited")
    assert learner.good == pytest.approx((10.0 * 12.0) ** 0.5)


def test_replies_of_one_episode_are_one_signal():
    learner = RateLearner(0.0)
    send_for(learner, 0.0, 5.0)
    assert learner.throttled(5.0, "421 a")
    rate, pause = learner.rate, learner.wait(5.0)
    for k in range(10):  # in flight when the first came, and during the cool-down
        assert not learner.throttled(5.0 + k * pause / 10, "421 b")
    assert learner.rate == rate and learner.rate_reply == "421 a"


def test_recovery_is_fast_then_the_probe_is_slow():
    learner = RateLearner(0.0)
    learner.good, learner.rate = 100.0, rl.BETA * 100.0
    now = send_for(learner, 0.0, 1.5)
    assert learner.rate == pytest.approx(rl.NEAR * 100.0)  # 80 -> 90 in a round
    assert learner.phase(now, 0.0) == rl.PROBING
    start, delivered = now, 0
    while learner.rate < 100.0:  # to the known limit by ever smaller steps
        learner.sent(now)
        learner.delivered(now, 0.0)
        now += 1.0 / learner.rate
        delivered += 1
    # Seconds and hundreds of messages between episodes...
    assert now - start >= 7 * rl.PROBE_SECONDS and delivered >= 7 * rl.PROBE_EVERY
    # ... but past the known limit the steps double: a lifted limit is found soon.
    start = now
    while learner.rate < 150.0:
        learner.sent(now)
        learner.delivered(now, 0.0)
        now += 1.0 / learner.rate
    assert now - start <= 7 * rl.PROBE_SECONDS


def run_to(learner: RateLearner, rate: float, start: float = 0.0) -> tuple[int, float]:
    """Send at the learned rate, all taken, until it reaches `rate`: (deliveries, seconds)."""
    now, count = start, 0
    while learner.rate < rate:
        learner.sent(now)
        learner.delivered(now, 0.0)
        now += 1.0 / learner.rate
        count += 1
    return count, now - start


def test_past_a_measured_limit_the_probe_waits_longer_than_past_a_guess():
    # A limit measured outside slow start is known: each step past it waits PAST_EVERY
    # deliveries (a refused probe costs a reply per several hundred messages). Past a
    # slow start's halved guess nothing is known: the steps come fast and grow larger.
    measured = RateLearner(0.0)
    measured.good = measured.rate = 5.0
    measured._confirmed = True
    guessed = RateLearner(0.0)
    guessed.good = guessed.rate = 5.0
    assert run_to(measured, 5.5)[0] >= 3 * rl.PAST_EVERY
    assert run_to(guessed, 5.5)[0] <= 5 * rl.PROBE_EVERY
    guessed = RateLearner(0.0)
    guessed.good = guessed.rate = 100.0
    measured = RateLearner(0.0)
    measured.good = measured.rate = 100.0
    measured._confirmed = True
    assert run_to(guessed, 300.0)[0] < run_to(measured, 300.0)[0] / 2


def test_closing_in_on_a_measured_limit_stops_under_it():
    # A limit measured at a signal is where the site said no (the run's measurement is
    # an upper bound): recovery and closing in stop at UNDER of it, and only the slow
    # probe goes past.
    learner = RateLearner(0.0)
    learner.good, learner.rate = 5.0, 4.0
    learner._confirmed = True
    now, steps = 0.0, []  # (rate, deliveries at it)
    while learner.rate < 5.0:  # until it first reaches the measured limit
        if not steps or steps[-1][0] != learner.rate:
            steps.append((learner.rate, 0))
        steps[-1] = (learner.rate, steps[-1][1] + 1)
        learner.sent(now)
        learner.delivered(now, 0.0)
        now += 1.0 / learner.rate
    assert next(rate for rate, _ in steps if rate > rl.NEAR * 5.0) <= rl.UNDER * 5.0
    assert any(rate == pytest.approx(rl.UNDER * 5.0) for rate, _ in steps)
    # From NEAR it on, every step is a slow one: it may be a little high.
    near = [n for rate, n in steps if rate >= rl.NEAR * 5.0]
    assert len(near) >= 2 and min(near) >= rl.PAST_EVERY


def test_the_cool_down_is_some_messages_long_within_bounds():
    assert rl.cooldown(rl.SLOW_START) == rl.COOLDOWN  # a small site: the longest
    assert rl.cooldown(rl.PAUSE_MESSAGES / 3) == 3.0
    assert rl.cooldown(1000.0) == rl.COOLDOWN_MIN  # refilled in a second; no longer


def test_a_signal_right_after_a_cool_down_doubles_the_next():
    learner = RateLearner(0.0)
    learner.throttled(0.0, "421")
    assert learner.wait(0.0) == rl.COOLDOWN
    learner.throttled(rl.COOLDOWN, "421")  # nothing went through in between
    assert learner.wait(rl.COOLDOWN) == 2 * rl.COOLDOWN
    # Once it took mail again, the next episode starts from the short cool-down.
    now = send_for(learner, 3 * rl.COOLDOWN, 30.0)
    sent_at = learner.rate
    learner.throttled(now, "421")
    assert learner.wait(now) == pytest.approx(rl.cooldown(sent_at))


def test_a_site_that_refuses_outright_after_the_pause_is_measured_over_the_series():
    """anvil overrun: 300 taken in the first 3 s, then nothing for the rest of its 60 s
    window. What it took over the series, refusals included, is the next rate's base."""
    learner = RateLearner(0.0)
    learner.good, learner.rate = 80.0, 100.0  # past slow start
    now = send_for(learner, 0.0, 3.0)
    delivered = len(learner._deliveries)
    learner.throttled(now, "450 4.7.1 Error: too much mail from 192.0.2.1")
    after_first = learner.rate
    resumed = now + learner.wait(now)
    learner.sent(resumed)
    learner.throttled(resumed, "450 4.7.1 Error: too much mail from 192.0.2.1")
    assert learner.good == pytest.approx(delivered / resumed, rel=0.05)
    assert learner.rate < after_first * rl.BETA  # deeper than one more cut of the same


def test_refused_outright_it_pauses_until_what_the_series_took_is_paid_for():
    """A minute's window (anvil's default unit) overrun after half a minute at 30/s: the
    refusal outright after the first pause means its window has not ended. Instead of the
    doubled cool-down (a probe 4 s on, refused again), the pause lasts until the 900 it
    took are paid for at the new rate."""
    learner = RateLearner(0.0)
    learner.good, learner.rate = 40.0, 30.0  # past slow start, recovering
    now = send_for(learner, 0.0, 30.0)
    delivered = learner._run_delivered
    resumed = refused_outright(learner, now)
    until = resumed + learner.wait(resumed)
    assert until == pytest.approx(delivered / learner.rate)  # (the series began at 0)
    assert until > resumed + 2 * rl.COOLDOWN_MIN + 2.0  # well past the doubled cool-down


def test_what_a_series_took_is_probed_past_at_the_ordinary_pace():
    # Refused time included, what an overrun anvil took is under its limit, not where it
    # said no: held at the slow pace of a measured limit it cost a flushed drain 1.4x.
    learner = RateLearner(0.0)
    learner.good, learner.rate = 4.0, 6.0  # past slow start, at anvil's 60 per 10 s
    now = send_for(learner, 0.0, 3.0)
    resumed = refused_outright(learner, now)
    start = resumed + learner.wait(resumed)
    held = copy.deepcopy(learner)
    held._confirmed = True  # as if the site had said no there

    target = 1.3 * learner.good
    assert run_to(learner, target, start)[1] < run_to(held, target, start)[1] / 2


def test_too_many_connections_is_remembered_with_its_reply():
    learner = RateLearner(0.0)
    learner.too_many_connections(3, "421 4.7.0 Error: too many connections from 127.0.0.1")
    learner.too_many_connections(3, "421 4.7.0 Error: too many connections from 127.0.0.1")
    assert learner.concurrency == 3
    assert [(c.what, c.old, c.new) for c in learner.changes()] == [("concurrency", 0, 3)]
    assert learner.changes() == []
    assert learner.learned().concurrency == 3


def test_a_connection_refused_pauses_without_making_the_next_signal_a_repeat():
    """Postfix's anvil answers one connection too many with a 421 at the greeting: a
    pause (a strict site lists a client that goes on), but no cut, and no escalation of
    the cool-down of the rate signal that may follow soon after."""
    learner = RateLearner(0.0)
    learner.good, learner.rate = 10.0, 8.0
    now = send_for(learner, 0.0, 10.0)
    rate = learner.rate
    assert learner.throttled(now, "421 4.7.0 too many connections", rate=False)
    assert learner.rate == rate and learner.wait(now) == pytest.approx(rl.cooldown(rate))
    now += learner.wait(now)
    learner.sent(now)
    learner.delivered(now, 0.0)  # one went through, then the rate limit
    assert learner.throttled(now + 0.5, "421 4.7.28 rate limited")
    assert learner.wait(now + 0.5) == pytest.approx(rl.cooldown(rate))  # not doubled
    assert learner.rate < rate


def test_changes_report_cuts_and_growth_by_a_quarter():
    learner = RateLearner(0.0)
    send_for(learner, 0.0, 3.0)
    learner.throttled(3.0, "450 4.7.1 Error: too much mail from 127.0.0.1")
    changes = learner.changes()
    assert [c.what for c in changes] == ["rate"] * len(changes)
    growth, cut = changes[:-1], changes[-1]
    assert all(c.new >= 1.25 * c.old for c in growth) and growth
    assert cut.new < cut.old and cut.reply.startswith("450 4.7.1")


def test_what_was_learned_survives_and_decays_after_hours():
    learner = RateLearner(0.0)
    learner.good, learner.rate = 50.0, 40.0
    learner.too_many_connections(4, "421 too many connections")
    send_for(learner, 0.0, 1.0)
    saved = msgspec.json.decode(msgspec.json.encode(learner.learned()), type=Learned)
    # A restart a minute later starts where it was.
    again = RateLearner(60.0, saved)
    assert (again.rate, again.good, again.concurrency) == (learner.rate, 50.0, 4)
    # After hours without traffic it is halfway (per HALF_LIFE) back to the slow start...
    later = RateLearner(saved.at + rl.QUIET + rl.HALF_LIFE, saved)
    assert later.rate == pytest.approx(rl.SLOW_START + (learner.rate - rl.SLOW_START) / 2)
    # ... and after days it starts over.
    assert rl.decayed(saved, saved.at + rl.FORGET) is None
    fresh = RateLearner(saved.at + rl.FORGET, saved)
    assert (fresh.rate, fresh.good, fresh.concurrency) == (rl.SLOW_START, 0.0, 0)


def test_a_stated_start_is_what_a_quiet_destination_decays_back_to():
    # A relayhost (a named hop starts at a stated rate) cut to 40/s, then quiet for hours:
    # it drifts back toward its stated 1,000/s, not toward the 2/s slow start...
    learner = RateLearner(0.0, start=1000.0)
    learner.good, learner.rate = 50.0, 40.0
    send_for(learner, 0.0, 1.0)
    saved = learner.learned()
    later = RateLearner(saved.at + rl.QUIET + rl.HALF_LIFE, saved, start=1000.0)
    assert later.rate == pytest.approx(1000.0 + (learner.rate - 1000.0) / 2)
    # ...and once forgotten it starts there again.
    assert RateLearner(saved.at + rl.FORGET, saved, start=1000.0).rate == 1000.0
    # The same happens to a live learner when traffic comes back after the quiet.
    learner.sent(saved.at + rl.QUIET + rl.HALF_LIFE)
    assert learner.rate == pytest.approx(later.rate)


def test_only_lessons_are_kept():
    assert not rl.kept(Learned(rl.SLOW_START, at=0.0), 1.0)  # a message or two: nothing
    assert rl.kept(Learned(8.0, at=0.0), 1.0)  # grew: the rate it took
    assert rl.kept(Learned(rl.SLOW_START, concurrency=2, at=0.0), 1.0)
    assert not rl.kept(Learned(8.0, 9.0, at=0.0), rl.FORGET)


def test_a_long_quiet_spell_in_one_run_decays_too():
    learner = RateLearner(0.0)
    learner.good, learner.rate = 50.0, 40.0
    learner.sent(0.0)
    learner.sent(rl.QUIET + 3 * rl.HALF_LIFE)
    assert learner.rate < 40.0 / 4 + rl.SLOW_START


# -- properties: a provider whose limit nobody told us ------------------------------------------


def drive(limit: float, burst: int, in_flight: int, seconds: float, ceiling: float = 0.0):
    """Send at the learned rate to a provider that takes `limit` a second (a token bucket
    of `burst`) and throttles the rest; `in_flight` transactions are out when the first
    throttle reply comes, and all get one. Returns (learner, delivered, throttle replies,
    the highest rate seen, whether every pause was honoured)."""
    learner = RateLearner(0.0)
    provider = TokenBucket(limit, burst, 0.0)
    now, delivered, replies, highest, honoured = 0.0, 0, 0, 0.0, True
    while now < seconds:
        wait = learner.wait(now)
        if wait:
            now += wait
            continue
        honoured &= learner.wait(now) == 0
        learner.sent(now)
        if provider.wait(now) == 0:
            provider.take(now)
            learner.delivered(now, ceiling)
            delivered += 1
        else:
            for k in range(in_flight):  # one episode: only the first is a signal
                signal = learner.throttled(now + k * 1e-3, "421 4.7.28 rate limited")
                assert signal == (k == 0)
            replies += in_flight
        highest = max(highest, learner.limit(ceiling))
        now += 1.0 / learner.limit(ceiling)
    return learner, delivered, replies, highest, honoured


@settings(max_examples=40, deadline=None)
@given(
    limit=st.floats(1.0, 300.0),
    burst_share=st.floats(0.0, 1.0),
    in_flight=st.integers(1, 5),
)
def test_it_converges_under_any_limit_with_few_throttle_replies(limit, burst_share, in_flight):
    """A provider of a few to hundreds a second: after ten minutes most of its capacity was
    used, and throttle replies stay a handful per thousand delivered."""
    seconds = 600.0
    burst = max(1, int(limit * burst_share))
    learner, delivered, replies, _, honoured = drive(limit, burst, in_flight, seconds)
    assert honoured
    assert delivered >= 0.7 * limit * seconds
    assert replies <= 5 * in_flight + 4 * in_flight * delivered / 1000
    assert learner.rate <= 1.5 * limit  # near it, not racing away


class FixedWindow:
    """Postfix's anvil: `limit` messages per `unit` seconds, the window starting at the
    first message after the last one ended; the rest of a full window is refused."""

    def __init__(self, limit: int, unit: float) -> None:
        self.limit, self.unit, self.start, self.count = limit, unit, -unit, 0

    def take(self, now: float) -> bool:
        if now - self.start >= self.unit:
            self.start, self.count = now, 0
        self.count += 1
        return self.count <= self.limit


@pytest.mark.parametrize(("limit", "unit"), [(600, 60.0), (3000, 60.0), (60, 10.0), (6, 1.0)])
def test_a_fixed_window_limiter_is_learned_close_to_its_rate(limit, unit):
    """anvil_rate_time_unit windows: over ten minutes at least 75% of the allowed rate,
    without drawing more than a few refusals per thousand delivered."""
    learner, provider = RateLearner(0.0), FixedWindow(limit, unit)
    now, delivered, refused, seconds = 0.0, 0, 0, 600.0
    while now < seconds:
        if wait := learner.wait(now):
            now += wait
            continue
        learner.sent(now)
        if provider.take(now):
            learner.delivered(now, 0.0)
            delivered += 1
        else:
            learner.throttled(now, "450 4.7.1 Error: too much mail from 192.0.2.1")
            refused += 1
        now += 1.0 / learner.limit(0.0)
    assert delivered >= 0.75 * limit / unit * seconds
    assert refused <= 5 + 5 * delivered / 1000


@settings(max_examples=30, deadline=None)
@given(limit=st.floats(0.5, 300.0), ceiling=st.floats(0.1, 400.0))
def test_the_ceiling_is_never_passed(limit, ceiling):
    learner, *_, highest, _ = drive(limit, 1, 2, 120.0, ceiling=ceiling)
    assert highest <= ceiling + 1e-9
    assert learner.rate >= rl.MIN_RATE
