"""The message rate of one destination, learned from what it accepts (sans-IO).

Nobody tells us Gmail's or a small provider's limits, so each destination's rate is found
the way TCP finds a path's capacity (AIMD with slow start), with the reply that taught it
kept for people:

- Slow start: a destination with no history starts at SLOW_START messages a second (or
  at the rate an admin stated for it, if higher) and doubles each ROUND in which it was
  sent at least USED of what the rate allowed (an idle destination proves nothing, so it
  does not grow); a delivery is the evidence, and the growth it brings is in proportion
  to the time since the last step (from half a round, at most a round's).
- A throttle signal (the shaper decides what is one: 421, 4.7.28, "too much mail",
  rising latency...) pauses all sending to the destination for a cool-down (PAUSE_MESSAGES
  at the rate it was sent at, between COOLDOWN_MIN and COOLDOWN seconds: a site taking
  hundreds a second refills its limiter in a second, and a longer pause costs a short
  backlog's drain most), and the rate becomes BETA times the last known good rate: the
  acceptance measured over the WINDOW just before the signal, never more than the middle
  (geometric) of the rate sent and the one before the last step up, between which the
  limit lies (a run just past the limit measures at the rate it was sent at, and a
  recovery to NEAR of that would meet the limit again). The first signal ends
  slow start: its run began on the site's burst allowance, which the measurement counts
  as rate, so the good rate and the new one are half of what was measured (as TCP halves
  at its first loss), a guess that probing corrects.
  Signals during the cool-down are replies of the same episode (already in flight): one
  signal. A signal before REPEAT deliveries went through after a cool-down (the site is
  still unhappy) doubles the next one, up to COOLDOWN_MAX. When it refused outright (not
  one delivery since the resume), the acceptance is measured over the whole series since
  the first message its first run delivered (time before it, an outage before a flush,
  is not the site's), refused time included: a fixed-window limiter (Postfix's anvil)
  that was overrun refuses for the rest of its window, and what it took over that span
  is its rate; refused time included, that is under the limit, and is probed past at
  the ordinary pace. The pause then lasts, if longer, until what the series took is
  paid for at the new rate: a window of a minute (anvil's default) that gave its whole
  allowance at once refuses for the rest of the minute, and doubling from 2 s alone
  would spend a refusal on each of 4, 8, 16 and 32 s.
- Then it recovers by RECOVER times a round up to NEAR the good rate, closes in on it by a
  quarter of the distance (at least PROBE_STEP of it) every PROBE_EVERY deliveries and
  PROBE_SECONDS (PROBE_SLOW at most), up to slow start's guess or UNDER a measured limit
  (where the site said no: the run's measurement is an upper bound), and probes above it
  by PROBE_STEP. Past it each step doubles (up to STRIDE_MAX times PROBE_STEP), as TCP
  CUBIC leaves the last known limit: a limit that was lifted is found again. From NEAR a
  measured limit on, each step waits PAST_EVERY deliveries (PAST_SLOW seconds at most),
  so that a step that meets the limit costs one reply per several hundred messages; past
  slow start's guess nothing was measured, and the steps double up to GUESS_STRIDE. An
  episode that finds the same limit again (within SAME) makes the next probe twice as
  patient (up to PATIENCE_MAX), in deliveries and in seconds: the plateau is known.
- "Too many connections" caps the concurrency at the connections that worked (the shaper
  says how many) and pauses for the first signal's cool-down, without a cut and without
  making the next rate signal a repeat: it says nothing of the rate.
- The rate never passes the configured ceiling (`messages_per_minute`, an operator's
  limit); a ceiling of 0 means none, not no pacing.

What was learned survives restarts (`Learned`, saved by delivery/upkeep.py) and decays toward
the slow start (a stated rate, if higher: a relayhost's) after hours without traffic:
HALF_LIFE after QUIET, and a destination quiet for FORGET starts over. All times are
seconds, rates messages per second.
"""

from __future__ import annotations

import math
from collections import deque

import msgspec

SLOW_START = 2.0  # no history: 120/min, polite to a small server, ramps fast
MIN_RATE = 1 / 60  # a throttle never stops a destination for good: one a minute
ROUND = 0.25  # growth step of slow start and recovery: 2/s reaches 1,000/s in ~2.5 s
USED = 0.5  # share of a round's allowance sent, for it to count as evidence
BETA = 0.8  # new rate after a signal, of the acceptance measured before it
WINDOW = 5.0  # behind the acceptance measurement
RECOVER = 1.25  # per round while under NEAR x good
NEAR = 0.9  # (with BETA: a fixed-window limiter, anvil's, is used to ~80%, not ~60%)
PROBE_STEP = 0.01  # of the good rate, per step above NEAR x good
PROBE_EVERY = 30  # deliveries per probe step, and
PROBE_SECONDS = 2.0  # seconds per probe step (both times the patience); but a slow
PROBE_SLOW = 10.0  # destination steps after this long, however few it delivered
UNDER = 0.97  # of a measured limit: the highest rate closing in reaches
PAST_EVERY = 150  # from NEAR a measured good rate on: deliveries per step, and
PAST_SLOW = 60.0  # seconds at most (both times the patience)
STRIDE_MAX = 16  # past the good rate, steps double up to this many PROBE_STEPs
GUESS_STRIDE = 64  # (past a slow start's halved guess: nothing was measured there)
SAME = 0.15  # a limit found again within this share is the same plateau
PATIENCE_MAX = 8  # at most this many times PROBE_EVERY
COOLDOWN = 5.0  # at most, for the first signal of a series
COOLDOWN_MIN = 2.0  # a site may list a sender that is back within a second or two
PAUSE_MESSAGES = 50.0
COOLDOWN_MAX = 300.0
REPEAT = 10  # deliveries after a cool-down that show the site took us back
QUIET = 900.0  # without traffic before what was learned starts to decay
HALF_LIFE = 3 * 3600.0
FORGET = 7 * 86400.0  # quiet this long: nothing is kept

SLOW_STARTING = "slow-start"
PAUSED = "paused"
RECOVERING = "recovering"
PROBING = "probing"
AT_CEILING = "at-ceiling"


class Learned(msgspec.Struct, frozen=True):
    """What a destination taught, as it is saved across restarts."""

    rate: float  # messages per second it was last sent at
    good: float = 0.0  # acceptance measured at the last throttle signal; 0: none yet
    rate_reply: str = ""  # the reply that taught the rate
    concurrency: int = 0  # connections that worked when one more was refused; 0: no cap
    concurrency_reply: str = ""
    at: float = 0.0  # the last traffic; decay counts from here
    sessions: int = 0  # connections past which its replies slowed (the knee); 0: none known
    latency: dict[str, float] = {}  # reply-latency baselines by kind (policy/latency.py)
    paced: float = 0.0  # the rate ceiling latency taught (policy/pace_cap.py); 0: none


class Change(msgspec.Struct, frozen=True):
    """A learned limit moved (the `limit_learned` log event)."""

    what: str  # "rate" or "concurrency"
    old: float
    new: float
    reply: str  # what taught it ("" for growth in slow start)


def cooldown(rate: float) -> float:
    """The pause after the first signal of a series, at `rate` messages a second."""
    return max(COOLDOWN_MIN, min(COOLDOWN, PAUSE_MESSAGES / rate))


def decayed(learned: Learned, now: float, start: float = SLOW_START) -> Learned | None:
    """`learned` after the time without traffic since `learned.at`, drifting toward
    `start` (the slow start, or a stated rate above it); None once forgotten."""
    idle = now - learned.at
    if idle >= FORGET:
        return None
    if idle <= QUIET:
        return learned
    weight = 0.5 ** ((idle - QUIET) / HALF_LIFE)
    good = learned.good * weight if weight >= 0.25 else 0.0  # long quiet: slow start again
    return msgspec.structs.replace(
        learned,
        rate=start + (learned.rate - start) * weight,
        good=good,
        concurrency=learned.concurrency if weight >= 0.25 else 0,
        sessions=learned.sessions if weight >= 0.25 else 0,
        paced=learned.paced if weight >= 0.25 else 0.0,
    )


def kept(learned: Learned, now: float) -> bool:
    """Whether `learned` is worth saving at `now`: not forgotten yet, and more than a
    fresh slow start (most destinations get a message or two and never grow)."""
    current = decayed(learned, now)
    return current is not None and (
        current.good > 0
        or current.concurrency > 0
        or current.sessions > 0
        or current.paced > 0
        or current.rate != SLOW_START
    )


class RateLearner:
    def __init__(self, now: float, learned: Learned | None = None, *, start: float = 0.0) -> None:
        """`start`: the rate (messages a second) to begin at without history, if more than
        SLOW_START (an admin's stated rate for this destination)."""
        self._start = max(SLOW_START, start)  # where it begins, and decays back to
        learned = decayed(learned, now, self._start) if learned is not None else None
        if learned is None:
            learned = Learned(self._start, at=now)
        self.rate = learned.rate
        self.good = learned.good
        self.rate_reply = learned.rate_reply
        self.concurrency = learned.concurrency
        self.concurrency_reply = learned.concurrency_reply
        self.paused_until = 0.0
        self._at = learned.at  # the last traffic
        self._cooldown = COOLDOWN
        self._resumed = REPEAT  # deliveries since the last cool-down, up to REPEAT
        self._patience = 1  # times PROBE_EVERY
        self._confirmed = self.good > 0  # `good` is where the site said no (or was kept)
        self._held = self.rate  # the rate before the last step up
        self._stride = 1  # times PROBE_STEP
        self._round_at = now
        self._round_sent = 0
        self._probe_count = 0
        self._probe_at = now
        self._since = now  # the measurement counts from here: the run's first delivery
        self._run_delivered = 0  # since `_since`
        self._series_at = now  # where this series of episodes began
        self._series_delivered = 0  # in the runs of the series before this one
        self._deliveries: deque[float] = deque()
        self._changes: list[Change] = []
        self._logged_rate = self.rate

    # -- what the shaper asks --------------------------------------------------------------

    def limit(self, ceiling: float) -> float:
        """The rate to send at under `ceiling` (0: none)."""
        return min(self.rate, ceiling) if ceiling else self.rate

    def wait(self, now: float) -> float:
        """Seconds left of a cool-down (0.0: may send)."""
        return max(0.0, self.paused_until - now)

    def phase(self, now: float, ceiling: float) -> str:
        if now < self.paused_until:
            return PAUSED
        if ceiling and self.rate >= ceiling:
            return AT_CEILING
        if not self.good:
            return SLOW_STARTING
        return RECOVERING if self.rate < NEAR * self.good else PROBING

    # -- what it is told ---------------------------------------------------------------------

    def sent(self, now: float) -> None:
        """A message was let go (a round's use)."""
        self._wake(now)
        self._round_sent += 1

    def delivered(self, now: float, ceiling: float) -> None:
        """A transaction the site took at our pace (a real 2xx after the data, or a
        greylisting answer): evidence, and a step of growth when one is due."""
        self._wake(now)
        if not self._run_delivered:
            # The run starts with the first message the site took: time before it (an
            # outage before a flush, its failed connects included) says nothing of the
            # site, and over a series it would count as refused time (a flushed drain was
            # cut to under half the site's rate).
            self._since = max(self._since, now)
        self._deliveries.append(now)
        self._run_delivered += 1
        while self._deliveries and self._deliveries[0] < now - WINDOW:
            self._deliveries.popleft()
        if now < self.paused_until:
            return
        self._resumed = min(self._resumed + 1, REPEAT)
        if self.good and self.rate >= NEAR * self.good:
            self._probe(now, ceiling)
            return
        elapsed = now - self._round_at
        if elapsed < ROUND / 2:
            return
        used = self._round_sent / (elapsed * self.rate)
        self._round_at, self._round_sent = now, 0
        if used < USED:
            return  # sent below its allowance: nothing shows it would take more
        # Growth in proportion to the time the evidence covers, from half a round: paced
        # deliveries land just inside a round as often as past it, and a round counted
        # only from a delivery past its end lasted two (at a paced 4/s: 0.5 s, and 240
        # first attempts took 0.45 s longer). One round's growth at most: a long gap's
        # evidence is mostly the opening burst, which says nothing of the rate.
        rounds = min(elapsed / ROUND, 1.0)
        if not self.good:
            self._set_rate(self.rate * 2**rounds, ceiling, self.rate_reply)
        else:
            grown = self.rate * RECOVER**rounds
            self._set_rate(min(grown, NEAR * self.good), ceiling, self.rate_reply)

    def throttled(self, now: float, reply: str, *, rate: bool = True) -> bool:
        """A throttle signal: pause, and cut the rate to BETA x the acceptance measured
        just before (unless `rate` is False: a connection refused as one too many says
        nothing of the rate). False when it belongs to the episode already cooled down."""
        self._wake(now)
        if now < self.paused_until:
            return False
        if not rate:  # a pause of the base length; the series and the rate stand
            self.paused_until = now + cooldown(self.rate)
            self._series_delivered += self._run_delivered
            self._restart_measurement()
            return True
        repeat = self._resumed < REPEAT
        if not repeat:  # a new series of episodes begins with the run that ended here
            self._series_at, self._series_delivered = self._since, 0
        self._series_delivered += self._run_delivered
        outright = repeat and not self._resumed
        if outright:
            # Refused outright since the resume: it took less than we measured. What it
            # took is measured over the whole series, its refused time included.
            measured = self._series_delivered / max(now - self._series_at, 1.0)
        else:
            measured = self.accepted(now)
        if repeat:
            self._cooldown = min(self._cooldown * 2, COOLDOWN_MAX)
        else:
            self._cooldown = cooldown(self.rate)
        self.paused_until = now + self._cooldown
        self._resumed = 0
        # Over a series the refused time counts: what it took is under the limit, not
        # where the site said no, and is probed past at the ordinary pace.
        self._cut(reply, measured, upper=not outright)
        if outright:
            paid = self._series_at + self._series_delivered / self.rate
            self.paused_until = max(self.paused_until, min(paid, now + COOLDOWN_MAX))
        self._restart_measurement()
        return True

    def _restart_measurement(self) -> None:
        """The measurement and the rounds start over when sending resumes."""
        self._since = self._round_at = self._probe_at = self.paused_until
        self._round_sent = self._probe_count = self._run_delivered = 0
        self._deliveries.clear()

    def _cut(self, reply: str, measured: float, *, upper: bool) -> None:
        if not self.good:
            # Leaving slow start: its run began on the site's burst allowance, which the
            # measurement counts as rate. Half of it is the rate and the good one, as TCP
            # halves at its first loss: a guess, not where the site said no.
            good = (min(self.rate, measured) if measured else self.rate) / 2
            rate, upper = good, False
        else:
            # The step that met the signal went past the limit, which lies between the
            # rate before it and this one: their middle is the good rate, unless less was
            # measured (a run just over the limit measures at the rate sent, and a
            # recovery to NEAR of that would meet it again; a big step's rate before is
            # far under the limit).
            between = math.sqrt(self._held * self.rate)
            good = min(between, measured) if measured else self.rate * BETA
            if abs(good - self.good) <= SAME * self.good:
                self._patience = min(self._patience * 2, PATIENCE_MAX)
            rate = BETA * good
        self.good, self._confirmed = good, upper
        self._set_rate(max(MIN_RATE, rate), 0.0, reply)
        self._stride = 1

    def too_many_connections(self, working: int, reply: str) -> None:
        """One more connection than `working` was refused: the cap, remembered."""
        working = max(1, working)
        if working != self.concurrency:
            self._changes.append(Change("concurrency", self.concurrency, working, reply))
        self.concurrency, self.concurrency_reply = working, reply

    def accepted(self, now: float) -> float:
        """Deliveries a second over the WINDOW, from the first of them in it: time with
        nothing on the wire (before a flush, say) measures nothing of the site."""
        recent = [t for t in self._deliveries if t >= now - WINDOW]
        return len(recent) / max(now - recent[0], 1.0) if recent else 0.0

    def changes(self) -> list[Change]:
        """The changes since the last call (for the log)."""
        changes, self._changes = self._changes, []
        return changes

    def learned(self) -> Learned:
        return Learned(
            self.rate,
            self.good,
            self.rate_reply,
            self.concurrency,
            self.concurrency_reply,
            self._at,
        )

    # -- internals ---------------------------------------------------------------------------

    def _probe(self, now: float, ceiling: float) -> None:
        self._probe_count += 1
        elapsed = now - self._probe_at
        if elapsed < PROBE_SECONDS * self._patience:
            return
        # A measured limit is where the site said no: closing in stops UNDER it, and near
        # it every step is a slow one (its measurement may be a little high).
        near = self.good * (UNDER if self._confirmed else 1.0)
        slow_steps = self._confirmed and self.rate >= NEAR * self.good
        every = (PAST_EVERY if slow_steps else PROBE_EVERY) * self._patience
        slow = PAST_SLOW * self._patience if slow_steps else PROBE_SLOW
        if self._probe_count < every and elapsed < slow:
            return
        self._probe_count, self._probe_at = 0, now
        if self.rate >= near:
            self._stride = min(self._stride * 2, STRIDE_MAX if self._confirmed else GUESS_STRIDE)
            step = PROBE_STEP * self.good * self._stride
        else:  # a quarter of the way to the known limit: small steps as it comes near
            step = min(max(PROBE_STEP * self.good, (near - self.rate) / 4), near - self.rate)
        self._set_rate(self.rate + step, ceiling, self.rate_reply)

    def _set_rate(self, rate: float, ceiling: float, reply: str) -> None:
        old = self.rate
        self.rate = min(rate, ceiling) if ceiling else rate
        self._held = old if self.rate > old else self.rate
        self.rate_reply = reply
        # A cut is always news; growth is, once it adds up to a quarter (not every step).
        if self.rate < old or self.rate >= self._logged_rate * 1.25:
            self._changes.append(Change("rate", self._logged_rate, self.rate, reply))
            self._logged_rate = self.rate

    def _wake(self, now: float) -> None:
        """Traffic at `now`: what decayed while it was quiet is taken as learned."""
        if now - self._at > QUIET:
            current = decayed(self.learned(), now, self._start)
            fresh = Learned(self._start, at=now) if current is None else current
            self.rate, self.good, self.concurrency = fresh.rate, fresh.good, fresh.concurrency
        self._at = max(self._at, now)


class _Saved(msgspec.Struct, omit_defaults=True):
    destinations: dict[str, Learned]
    version: int  # (always written: 1)
    lockstep: dict[str, float] = {}  # hosts spoken to in lock-step (policy/pipelining.py)


def encode(learned: dict[str, Learned], lockstep: dict[str, float] | None = None) -> bytes:
    """The state file's content (spool/statefile.py writes it)."""
    saved = _Saved(dict(sorted(learned.items())), 1, lockstep or {})
    return msgspec.json.encode(saved)


def decode(data: bytes) -> tuple[dict[str, Learned], dict[str, float]]:
    """The destinations' lessons and the lock-step hosts; raises msgspec.DecodeError (a
    subclass of ValueError) for a damaged file."""
    saved = msgspec.json.decode(data, type=_Saved)
    return saved.destinations, saved.lockstep
