"""A token bucket: a rate limit that allows a burst of at most its size.

The bucket holds up to `burst` tokens and refills at `rate` tokens per second; each event
(a message, a connection) takes one. Over any interval of T seconds at most
``burst + rate * T`` events get a token, which is what a destination's "100/min" means
(KumoMTA's GCRA throttles are the same limit in another form).

A `take` without a token (two senders that checked the same token) is kept as debt: the
bucket goes below zero and the next waits pay it back, so the rate still holds over time
rather than the extra event being forgotten.

A full bucket is as good as a new one (`full`): a caller may drop it and make it anew.
"""

from __future__ import annotations

# A token that is due within this many seconds counts as there: `now` values at epoch
# scale are only precise to ~0.2 us, so a caller that waits exactly `wait()` seconds may
# land a hair short of the token and would otherwise be told to wait ~0 seconds again.
_SLACK = 1e-6


class TokenBucket:
    def __init__(self, rate: float, burst: int, now: float) -> None:
        """`rate` in tokens per second, 0 = unlimited; the bucket starts full."""
        if rate < 0 or burst < 1:
            raise ValueError("a token bucket needs rate >= 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._at = now

    def wait(self, now: float) -> float:
        """0.0 if a token is available at `now`, else the seconds until one is."""
        if self.rate == 0:
            return 0.0
        self._refill(now)
        seconds = max(0.0, self._at - now) + (1.0 - self._tokens) / self.rate  # (resume_at)
        return seconds if seconds > _SLACK else 0.0

    def take(self, now: float) -> None:
        """Take one token (the caller checked `wait(now) == 0`)."""
        if self.rate == 0:
            return
        self._refill(now)
        self._tokens -= 1.0

    def full(self, now: float) -> bool:
        """Whether it holds its whole burst at `now` (no debt, nothing taken)."""
        if self.rate == 0:
            return True
        self._refill(now)
        return self._tokens >= self.burst

    def give_back(self, now: float) -> None:
        """Return a token taken for an event that did not happen (up to the burst)."""
        if self.rate == 0:
            return
        self._refill(now)
        self._tokens = min(float(self.burst), self._tokens + 1.0)

    def resume_at(self, at: float) -> None:
        """No token before `at`, and at most one then: after a pause, events go at the
        rate, not as a burst of what the pause earned."""
        if self.rate == 0 or at <= self._at:
            return
        self._refill(at)  # what it holds by then, of which one token at most
        self._tokens = min(1.0, self._tokens)

    def set_rate(self, rate: float, now: float) -> None:
        """Change the rate from `now` on; what was earned at the old rate is kept."""
        if rate < 0:
            raise ValueError("a token bucket needs rate >= 0")
        if rate == self.rate:
            return  # (the shaper sets it at every look; a refill is made when it is read)
        self._refill(now)
        if self.rate == 0:
            # An unlimited bucket is always full: lifting the limit and setting it again
            # must not leave behind the debt of a rate that no longer applies.
            self._tokens = float(self.burst)
        self.rate = rate

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
            self._at = now
