"""Adaptive concurrency of one destination: AIMD, and the knee latency taught.

    AdaptiveConcurrency(initial, maximum, knee=0, now=0.0)
    .success(now) -> bool      a delivery; True when the limit grew by one
    .steady(calm)              the last latency round: growth waits for a calm one
    .throttled()               halve (floor 1)
    .step_back(now)            the last step up made the site slow: back one, held there
    .reset(limit)  .cap(maximum)  .limit  .maximum  .knee  .raised_at

The limit starts low and grows by one after `limit` successes at the current level
(Postfix's gentle 1/N positive feedback, which its published measurement against a
421-ing server found to defer the least mail). A throttle signal halves it, never below 1.

Growth also waits for the site's reply latency (policy/latency.py): one step up per calm
round, none while replies are slower than its baseline. A step up that the next round
finds slow was one too many: the limit steps back to where latency was calm (the knee)
and stays there for HOLD, then probes one step again; the hold doubles, up to HOLD_MAX,
each time the same knee is found. A calm round above the knee forgets it.
"""

from __future__ import annotations

HOLD = 120.0  # seconds at the knee before the next probe up
HOLD_MAX = 1800.0


class AdaptiveConcurrency:
    def __init__(self, initial: int, maximum: int, knee: int = 0, now: float = 0.0) -> None:
        """`knee`: the level latency rose past, as learned before (0: none), held at for
        HOLD from `now`."""
        if maximum < 1:
            raise ValueError("maximum concurrency must be at least 1")
        self.maximum = maximum
        self.limit = min(max(1, initial), maximum)
        self.knee = knee
        self.raised_at: float | None = None  # when the limit last grew
        self._held_until = now + HOLD if knee else 0.0
        self._hold = HOLD
        self._successes = 0  # at the current limit
        self._calm = True  # no latency round since the last step up said otherwise

    def success(self, now: float) -> bool:
        """A delivery went through: +1 after `limit` of them at this level, if latency
        allows; whether it grew."""
        self._successes += 1
        if self._successes < self.limit or self.limit >= self.maximum or not self._calm:
            return False
        if self.knee and self.limit >= self.knee and now < self._held_until:
            return False
        self._successes = 0
        self.limit += 1
        self.raised_at = now
        self._calm = False  # the next step waits for a calm round at this level
        return True

    def steady(self, calm: bool) -> None:
        """A latency round closed: calm (near the baseline) lets the limit grow a step."""
        self._calm = calm
        if calm and self.knee and self.limit > self.knee:
            self.knee, self._hold = 0, HOLD  # the probe past the knee went well

    def throttled(self) -> None:
        """A throttle signal: halve the limit (floor 1)."""
        self.limit = max(1, self.limit // 2)
        self._successes = 0
        self.knee = 0

    def step_back(self, now: float) -> None:
        """The last step up slowed the site: one back, and held there for a while."""
        self.limit = max(1, self.limit - 1)
        if self.knee == self.limit:
            self._hold = min(self._hold * 2, HOLD_MAX)  # the same knee again
        else:
            self.knee, self._hold = self.limit, HOLD
        self._held_until = now + self._hold
        self._successes = 0

    def reset(self, limit: int = 1) -> None:
        """Start over at `limit` (after a circuit breaker closes: ramp up from 1)."""
        self.limit = min(max(1, limit), self.maximum)
        self._successes = 0
        self._calm = True  # a new start: its first step, as at the very first

    def cap(self, maximum: int) -> None:
        """Move the ceiling (backoff mode, an operator's limit). Lowering it lowers the limit
        at once; raising it does not: the limit grows back by successes."""
        self.maximum = max(1, maximum)
        self.limit = min(self.limit, self.maximum)
