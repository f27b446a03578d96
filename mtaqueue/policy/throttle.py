"""Backoff mode of one destination, and the site rules that can put it there.

A throttle signal (a reply classified as throttling, or a `ThrottleRules` hit) puts the
destination in backoff, as PowerMTA's `mode=backoff` and KumoMTA's TSA do: its rates and
concurrency are scaled down and the retry intervals of its deferred mail stretched. It
comes back in stages rather than at once, so one quiet spell does not bring back the full
load that caused the throttling.

Stages: 0 is normal, `stages` the deepest. A signal goes to the deepest stage and restarts
the clock. From there each elapsed `duration` steps back one stage, and so does each run of
`successes` deliveries, whichever comes first; they add up, so successes only ever speed
the return. At stage s the rates are scaled by ``rate_factor ** s`` and retry intervals by
``retry_factor ** s``. An operator can force the deepest stage until a time, or clear
the mode back to normal (PowerMTA's `set queue --mode`).
"""

from __future__ import annotations

import math
import re
from collections import deque

from .. import config

NORMAL = "normal"
BACKOFF = "backoff"


class ThrottleRules:
    """Site rules like KumoMTA's `Threshold="2/hr"`: a rule fires when its pattern has
    matched `threshold` replies within `window` seconds; then its count starts over."""

    def __init__(self, rules: list[config.ThrottleRule]) -> None:
        self._rules = [(re.compile(rule.match), rule.window) for rule in rules]
        self._hits: list[deque[float]] = [deque(maxlen=rule.threshold) for rule in rules]

    def hit(self, line: str, now: float) -> bool:
        """Count a reply ("CODE ENHANCED TEXT"); True when some rule reached its threshold."""
        fired = False
        for (pattern, window), hits in zip(self._rules, self._hits, strict=True):
            if pattern.search(line) is None:
                continue
            hits.append(now)
            if len(hits) == hits.maxlen and now - hits[0] <= window:
                hits.clear()
                fired = True
        return fired


class BackoffMode:
    def __init__(
        self,
        duration: float,
        rate_factor: float,
        retry_factor: float,
        successes: int,
        stages: int = 2,
    ) -> None:
        if stages < 1 or successes < 1:
            raise ValueError("backoff mode needs stages >= 1 and successes >= 1")
        self.duration = duration
        self.rate_step = rate_factor  # per stage
        self.retry_step = retry_factor  # per stage
        self.successes = successes
        self.stages = stages
        self._since: float | None = None  # the last signal; None while normal
        self._stepped = 0  # stages stepped back by success runs since the signal
        self._run = 0  # successes towards the next step
        self._forced_until: float | None = None

    def signal(self, now: float) -> None:
        """A throttle signal: the deepest stage, its clock restarted."""
        self._since = now
        self._stepped = 0
        self._run = 0

    def success(self, now: float) -> None:
        if self._signalled(now) == 0:
            return
        self._run += 1
        if self._run >= self.successes:
            self._run = 0
            self._stepped += 1
            self._signalled(now)  # forgets the signal if that was the last stage

    def force(self, until: float) -> None:
        """The deepest stage until `until`, whatever the replies (an operator's `backoff`);
        after that the stages of any signals as usual."""
        self._forced_until = until

    def clear(self) -> None:
        """Back to normal now (an operator's `mode normal`), forced or not."""
        self._since = None
        self._forced_until = None

    def stage(self, now: float) -> int:
        forced = self._forced_until is not None and now < self._forced_until
        return self.stages if forced else self._signalled(now)

    def forced_until(self, now: float) -> float | None:
        """The end of an operator's backoff still in force, else None."""
        if self._forced_until is not None and now < self._forced_until:
            return self._forced_until
        return None

    def rate_factor(self, now: float) -> float:
        return self.rate_step ** self.stage(now)

    def retry_factor(self, now: float) -> float:
        return self.retry_step ** self.stage(now)

    def mode(self, now: float) -> str:
        return BACKOFF if self.stage(now) else NORMAL

    def _signalled(self, now: float) -> int:
        """The stage that throttle signals and success runs put it in."""
        if self._since is None:
            return 0
        elapsed = max(0.0, now - self._since)
        by_time = math.inf if self.duration <= 0 else elapsed // self.duration
        stage = int(max(0, self.stages - self._stepped - by_time))
        if stage == 0:
            self._since = None
        return stage
