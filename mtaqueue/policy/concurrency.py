"""Adaptive concurrency of one destination: AIMD, with latency as a throttle signal.

The limit starts low and grows by one after `limit` successes at the current level
(Postfix's gentle 1/N positive feedback, which its published measurement against a
421-ing server found to defer the least mail). A throttle signal halves it, never below 1.

Some servers throttle silently: they accept, only slower. Each latency sample (connect,
greeting or reply time; the caller feeds one kind consistently) is compared with an EWMA
baseline of the destination's own recent samples; after a short warm-up, a sample above
`latency_factor` times the baseline, and at least `LATENCY_FLOOR` over it, is a throttle
signal (on a fast network a loaded machine's jitter triples a 6 ms baseline). All `limit`
connections in flight see the same slowdown, so at most one cut is made per `limit` samples.
"""

from __future__ import annotations

_WARMUP = 5  # samples averaged into the first baseline before any is judged
# The baseline moves slowly, and a slow sample counts as at most `latency_factor` times it,
# so a slowdown stays visible for dozens of samples but a lasting change of the destination
# becomes its new normal instead of pinning the limit at 1 for good.
_ALPHA = 0.02
LATENCY_FLOOR = 0.1  # seconds over the baseline before a slow sample counts


class AdaptiveConcurrency:
    def __init__(self, initial: int, maximum: int, *, latency_factor: float) -> None:
        if maximum < 1:
            raise ValueError("maximum concurrency must be at least 1")
        self.maximum = maximum
        self.limit = min(max(1, initial), maximum)
        self.latency_factor = latency_factor
        self.baseline: float | None = None  # seconds; None until the first sample
        self._successes = 0  # at the current limit
        self._samples = 0  # taken into the baseline, up to the warm-up
        self._quiet = 0  # samples left before latency may cut again

    def success(self) -> None:
        """A delivery went through: +1 after `limit` of them at this level."""
        self._successes += 1
        if self._successes >= self.limit:
            self._successes = 0
            self.limit = min(self.limit + 1, self.maximum)

    def throttled(self) -> None:
        """A throttle signal: halve the limit (floor 1)."""
        self.limit = max(1, self.limit // 2)
        self._successes = 0

    def latency(self, seconds: float) -> None:
        """A latency sample; far above the baseline it counts as a throttle signal."""
        if self.baseline is None or self._samples < _WARMUP:
            self._samples += 1
            previous = self.baseline or 0.0
            self.baseline = previous + (seconds - previous) / self._samples
            return
        ceiling = self.latency_factor * self.baseline
        self._quiet -= 1
        slow = seconds > ceiling and seconds > self.baseline + LATENCY_FLOOR
        if slow and self._quiet <= 0:
            self._quiet = self.limit  # the connections in flight now, all slowed alike
            self.throttled()
        self.baseline += _ALPHA * (min(seconds, ceiling) - self.baseline)

    def reset(self, limit: int = 1) -> None:
        """Start over at `limit` (after a circuit breaker closes: ramp up from 1)."""
        self.limit = min(max(1, limit), self.maximum)
        self._successes = 0

    def cap(self, maximum: int) -> None:
        """Move the ceiling (backoff mode, an operator's limit). Lowering it lowers the limit
        at once; raising it does not: the limit grows back by successes."""
        self.maximum = max(1, maximum)
        self.limit = min(self.limit, self.maximum)
