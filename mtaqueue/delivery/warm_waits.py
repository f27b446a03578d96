"""Mail waiting for a warming source's next day, by destination (pure: `now` passed in).

    WarmWaits()
    .wait(base, message_id, now, rng, spread, back) -> until   when it comes back
    .waiting_for(message_id, now) -> dict | None   why it waits, for ctl list/show
    .release(base, now) -> [message_id]            an operator finished the ramp there
    .prune(now)                                    forget the waits that are over
    len(warm_waits)                                messages waiting

One wake a destination (spread over destinations, not over its messages): its waiting
mail comes back together, in one batch that placement orders by class, then oldest first,
for the day's allowance; a wake drawn for a day that has begun is drawn again for the next.
"""

from __future__ import annotations

import random
from typing import Any

from ..policy import warmup


class WarmWaits:
    def __init__(self) -> None:
        self._waits: dict[str, dict[str, float]] = {}  # base -> {message id: until}
        self._wake: dict[str, float] = {}  # base -> when its waiting mail comes back

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._waits.values())

    def wait(
        self,
        base: str,
        message_id: str,
        now: float,
        rng: random.Random,
        spread: float,
        back: float | None,
    ) -> float:
        """`message_id` waits at `base` for the next day (or for `back`, when the source
        is usable again, if sooner): until when."""
        wake = self._wake.get(base, 0.0)
        if warmup.day_of(wake) <= warmup.day_of(now):  # not drawn for the next day
            wake = self._wake[base] = warmup.wake(now, rng, spread)
        until = min(wake, back or float("inf"))
        self._waits.setdefault(base, {})[message_id] = until
        return until

    def waiting_for(self, message_id: str, now: float) -> dict[str, Any] | None:
        for base, ids in self._waits.items():
            until = ids.get(message_id)
            if until is not None and until > now:
                return {"reason": "warmup", "destination": base, "until": until}
        return None

    def release(self, base: str, now: float) -> list[str]:
        return [i for i, until in self._waits.pop(base, {}).items() if until > now]

    def prune(self, now: float) -> None:
        waits = ((b, {i: t for i, t in w.items() if t > now}) for b, w in self._waits.items())
        self._waits = {base: ids for base, ids in waits if ids}  # not woken yet
        self._wake = {base: t for base, t in self._wake.items() if t > now}
