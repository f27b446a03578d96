"""Circuit breaker of one destination: stop knocking on a door that keeps failing.

    CircuitBreaker(failures, window, cooldown, cooldown_max)
    .state(now) -> CLOSED | OPEN | HALF_OPEN     .wait(now) -> seconds     .allow(now) -> bool
    .failure(now) .success(now) .trip(now, at_least) .probe(now)

closed: attempts flow. `failures` failures (connection failures, 421s at the greeting,
timeouts) within `window` seconds trip it; a success in between starts the count over, so
a site that mostly answers never trips (Postfix's cohort limit of 1 kills a destination on
one bad burst; this tolerates scattered failures).

open: no attempts for the cooldown, which doubles with each consecutive trip up to
`cooldown_max`. Failures reported while open come from connections that were in flight
when it tripped: one outage, counted once.

`trip` opens it at once, for a failure that every attempt would repeat; `probe` makes it
half-open at once (an operator's flush or unsuspend).

half-open: after the cooldown, one probe connection is allowed. Its success closes the
breaker (and forgets the trips); its failure opens it again for the next, longer cooldown.
A probe that reports nothing for a whole cooldown (its connection closed without a result,
say its mail was held meanwhile) is taken as lost and another is allowed, so a missing
report cannot wedge the destination.
"""

from __future__ import annotations

import math
from collections import deque

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half-open"

# Keeps 2**n finite on a very long streak; 64 doublings outgrow any sane maximum.
_MAX_DOUBLINGS = 64


class CircuitBreaker:
    def __init__(self, failures: int, window: float, cooldown: float, cooldown_max: float) -> None:
        if failures < 1:
            raise ValueError("a circuit breaker needs failures >= 1")
        self.failures = failures
        self.window = window
        self.cooldown = cooldown
        self.cooldown_max = cooldown_max
        self.reopen_at: float | None = None  # set while open or half-open
        self.trips = 0  # consecutive trips; 0 when closed
        self._recent: deque[float] = deque(maxlen=failures)  # failure times while closed
        self._probe_at: float | None = None  # when the half-open probe went out

    def state(self, now: float) -> str:
        if self.reopen_at is None:
            return CLOSED
        return OPEN if now < self.reopen_at else HALF_OPEN

    def wait(self, now: float) -> float:
        """Like `allow` but without taking the probe: 0.0 when a connection may be made,
        the cooldown left while open, math.inf while the probe is out."""
        if self.reopen_at is None:
            return 0.0
        if now < self.reopen_at:
            return self.reopen_at - now
        if self._probe_at is not None and now < self._probe_at + self._current_cooldown():
            return math.inf
        return 0.0

    def allow(self, now: float) -> bool:
        """May a connection be made? Half-open, this takes the one probe."""
        if self.wait(now) != 0.0:
            return False
        if self.reopen_at is not None:
            self._probe_at = now
        return True

    def failure(self, now: float) -> None:
        state = self.state(now)
        if state == OPEN:
            return  # in flight when it tripped: the same outage
        if state == HALF_OPEN:
            self._trip(now)
            return
        self._recent.append(now)
        if len(self._recent) == self.failures and now - self._recent[0] <= self.window:
            self._trip(now)

    def trip(self, now: float, at_least: float = 0.0) -> None:
        """Open now, whatever the count: a failure every attempt would repeat (a smarthost
        refusing our credentials; `at_least` that long, a site that blocked our address).
        While open it is the same outage, counted once."""
        if self.state(now) != OPEN:
            self._trip(now)
            self.reopen_at = max(self.reopen_at or now, now + at_least)

    def success(self, now: float) -> None:
        """Closes a half-open breaker; while closed, starts the failure count over. While
        open it means nothing: a connection from before the trip finishing its work."""
        state = self.state(now)
        if state == OPEN:
            return
        self._recent.clear()
        if state == HALF_OPEN:
            self.reopen_at = None
            self._probe_at = None
            self.trips = 0

    def probe(self, now: float) -> None:
        """Half-open now, whatever the cooldown left: an operator's flush or unsuspend.
        One probe connection goes and its answer decides (a success closes, a failure opens
        for the next cooldown). A closed breaker turns half-open too, so that hosts just
        lifted get one connection, not a storm, until one of them answers."""
        self.reopen_at = now
        self._probe_at = None
        self._recent.clear()

    def _trip(self, now: float) -> None:
        self.trips += 1
        self.reopen_at = now + self._current_cooldown()
        self._probe_at = None
        self._recent.clear()

    def _current_cooldown(self) -> float:
        # No trip yet: a closed breaker an operator made half-open (probe).
        doublings = min(max(self.trips - 1, 0), _MAX_DOUBLINGS)
        return min(self.cooldown_max, self.cooldown * 2.0**doublings)
