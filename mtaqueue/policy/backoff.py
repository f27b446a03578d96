"""When to try a deferred recipient again, and when to give up.

The shape is hybrid: a fixed schedule (default 5, 15, 30, 60 minutes), then a random
interval within `then` (4-6 h), every step jittered so that mail deferred together does
not come back together. Greylisted mail waits at least the greylist window (or the
server's own hint); any server hint is a floor.

Only failed attempts call these functions. Internal waits (every MX host suspended, a
destination at its cap, a paused queue) are not failures: reschedule such mail without
touching its attempt count, or a five-minute suspension climbs the ladder to hours
(KumoMTA issue 322).
"""

from __future__ import annotations

import random

import msgspec

from .. import config


class RetryPolicy(msgspec.Struct, frozen=True):
    """The retry settings in seconds. The steps are taken as configured: RFC 5321 4.5.4.1
    wants them configurable, and a first step longer than the rest is a choice too."""

    schedule: tuple[float, ...]  # seconds after the 1st, 2nd, ... failure
    then: tuple[float, float]  # after the schedule: uniform in [min, max]
    jitter: float  # each delay is scaled by uniform(1 - jitter, 1 + jitter)
    greylist_min: float

    def __post_init__(self) -> None:
        if min((*self.schedule, *self.then, self.greylist_min)) < 0:
            raise ValueError("retry durations must not be negative")
        if self.then[0] > self.then[1]:
            raise ValueError("retry.then must be [min, max]")
        if not 0 <= self.jitter < 1:  # below 1, so that no delay is negative
            raise ValueError("retry.jitter must be at least 0 and below 1")

    @classmethod
    def from_config(cls, retry: config.RetryConfig, *, first_class: bool = False) -> RetryPolicy:
        """The first class (p0) gets a tenth of the jitter: it is a small share whose point
        is latency (a password reset greylisted for 5 min should not wait 30 s more), and
        pacing still spreads it when it comes due. A sliver remains, so that a greylisted
        p0 wave does not come back in the very second its window ends."""
        jitter = float(retry.jitter)
        return cls(
            schedule=tuple(float(step) for step in retry.schedule),
            then=(float(retry.then[0]), float(retry.then[1])),
            jitter=jitter / 10 if first_class else jitter,
            greylist_min=float(retry.greylist_min),
        )


def retry_delay(policy: RetryPolicy, failures: int, rng: random.Random) -> float:
    """Seconds to wait after `failures` (>= 1) failed attempts."""
    if failures < 1:
        raise ValueError("failures must be at least 1")
    if failures <= len(policy.schedule):
        nominal = policy.schedule[failures - 1]
    else:
        nominal = rng.uniform(*policy.then)
    return nominal * rng.uniform(1 - policy.jitter, 1 + policy.jitter)


def next_attempt(
    policy: RetryPolicy,
    failures: int,
    now: float,
    rng: random.Random,
    *,
    kind: str = "",
    retry_after: float | None = None,
) -> float:
    """When to try again after `failures` failed attempts, the last one at `now`.

    A server hint (`retry_after`, "try again in 10 minutes") and, for greylisting, the
    greylist window are floors. Mail that would fall under a floor is spread just above
    it (by the jitter) rather than piled onto it, or all mail greylisted in one burst
    would come back in the same second.
    """
    floor = retry_after or 0.0
    if kind == "greylisting":
        floor = max(floor, policy.greylist_min)
    delay = retry_delay(policy, failures, rng)
    if delay < floor:
        delay = floor * rng.uniform(1, 1 + policy.jitter)
    return now + delay


def expiry(created: float, lifetime: float, expires: float | None) -> float:
    """When a message expires: its X-Mtaqueue-Expires if it had one, else created +
    its class's lifetime."""
    return expires if expires is not None else created + lifetime


def expires_before(next_at: float, expiry_at: float) -> bool:
    """Look-ahead: a retry due after the expiry would only be a later bounce, so the
    message expires now instead."""
    return next_at > expiry_at


def restart_due(due: float | None, now: float, spread: float, rng: random.Random) -> float:
    """A due time after a restart: future ones are kept; overdue ones (and None, never
    tried) are spread over [now, now + spread] so a restart is not a retry storm."""
    if due is not None and due > now:
        return due
    return now + rng.uniform(0, spread)
