"""Warm-up of a new source address (sans-IO): a daily volume per destination, one step a day.

A source with a schedule (`warmup = [50, 100, 200, ...]`) may send a destination at most
the step's number of messages per UTC day (a message = one transaction the destination
accepted, whatever its recipients). The first step starts with the first mail to that
destination. At the day's end the ramp moves one step on, unless the destination deferred
us more: a deferral rate (deferred / (accepted + deferred) messages) of HOLD_RATE or more,
or more than RISE above the last day's, holds the step ("a provider that defers you more as
you ramp is telling you to slow the ramp"). A day without mail neither advances nor holds.
Past the schedule's end the source is warm: no limit. Only daily: within the day, the
destination's shaper (rates, concurrency, what it learned) paces as for any source.

An operator may move a ramp (`mtaqueue-ctl warmup`): `restart` puts it back on the
schedule's first step (a moved address, a damaged reputation: providers judge the address
anew), `finish` past its end (an address known to be warm there). Either keeps the day's
counts: the mail sent today was seen, and counts against today's allowance.

A ramp not used for IDLE_DAYS is forgotten (`Warmups.prune`): providers forget an
address's reputation after a month without its mail (warm it again, their guides say),
and a pool that met many destinations must not keep them all; at most KEPT ramps, the
longest unused going first.
"""

from __future__ import annotations

import random

import msgspec

from ..routing.pools import Source

DAY = 86400.0
HOLD_RATE = 0.10  # a day's deferral rate that holds the ramp whatever came before
RISE = 0.05  # ... as does one this much above the last day's (a rising rate)
IDLE_DAYS = 30  # a ramp unused this long is forgotten
KEPT = 50_000  # ramps at most


class Ramp(msgspec.Struct):
    """One (source, destination)'s warm-up: the step and the day's counts."""

    step: int = 0  # index into the schedule; past its end: warm
    day: int = 0  # the UTC day (days since the epoch) that `sent` and `deferred` count
    sent: int = 0
    deferred: int = 0
    rate: float = 0.0  # the deferral rate of the last day with mail
    held: bool = False  # that day held the step


class Step(msgspec.Struct, frozen=True):
    """A day's end that had mail: for the log (warmup_advanced / warmup_held)."""

    base: str
    source: str
    held: bool
    step: int  # the step from now on, 1 = the schedule's first (as `snapshot` shows it)
    allowance: int | None  # its daily volume; None: warm
    sent: int
    deferred: int
    rate: float
    previous_rate: float


def day_of(now: float) -> int:
    return int(now // DAY)


def wake(now: float, rng: random.Random, spread: float) -> float:
    """When mail that waits for the next day's allowance is due: spread over the first
    `spread` seconds of that day, not a herd."""
    return (day_of(now) + 1) * DAY + rng.uniform(0.0, spread)


def allowance(ramp: Ramp, schedule: tuple[int, ...]) -> int | None:
    """The step's daily volume; None past the schedule (warm)."""
    return schedule[ramp.step] if ramp.step < len(schedule) else None


def roll(ramp: Ramp, schedule: tuple[int, ...], now: float) -> tuple[Ramp, bool | None]:
    """`ramp` as of today's UTC day, and whether the day's end held the step (None: no day
    with mail ended; a clock gone back stays on the day it has)."""
    today = day_of(now)
    if today <= ramp.day:
        return ramp, None
    total = ramp.sent + ramp.deferred
    if total == 0:
        return msgspec.structs.replace(ramp, day=today), None
    rate = ramp.deferred / total
    held = rate >= HOLD_RATE or rate > ramp.rate + RISE
    step = ramp.step if held else min(ramp.step + 1, len(schedule))
    return Ramp(step, today, 0, 0, rate, held), held


def left(ramp: Ramp, schedule: tuple[int, ...]) -> int | None:
    """Messages the (rolled) ramp still allows today; None: no limit."""
    volume = allowance(ramp, schedule)
    return None if volume is None else max(volume - ramp.sent, 0)


def restart(ramp: Ramp, schedule: tuple[int, ...], now: float) -> Ramp:
    """The ramp back on the first step, with no deferral rate to beat."""
    rolled, _ = roll(ramp, schedule, now)
    return Ramp(0, rolled.day, rolled.sent, rolled.deferred)


def finish(ramp: Ramp, schedule: tuple[int, ...], now: float) -> Ramp:
    """The ramp past the schedule's end: warm, no limit."""
    rolled, _ = roll(ramp, schedule, now)
    return msgspec.structs.replace(rolled, step=len(schedule), held=False)


def count(ramp: Ramp, accepted: bool) -> Ramp:
    """A message's outcome at the destination, for the (rolled) ramp: accepted or deferred."""
    if accepted:
        return msgspec.structs.replace(ramp, sent=ramp.sent + 1)
    return msgspec.structs.replace(ramp, deferred=ramp.deferred + 1)


class Warmups:
    """The ramps of the sources with a schedule, by (destination base, source address).
    Day ends found on the way wait for the caller to log them (`drain`)."""

    def __init__(self) -> None:
        self.ramps: dict[tuple[str, str], Ramp] = {}
        self._steps: list[Step] = []

    def ramp(self, base: str, source: Source, now: float) -> Ramp | None:
        """`source`'s ramp for `base` as of today; None: no schedule (warm from the start)."""
        if not source.warmup:
            return None
        key = (base, source.address)
        before = self.ramps.get(key)
        ramp, held = roll(before or Ramp(day=day_of(now)), source.warmup, now)
        self.ramps[key] = ramp
        if held is not None and before is not None:
            self._steps.append(
                Step(
                    base=base,
                    source=source.address,
                    held=held,
                    step=ramp.step + 1,
                    allowance=allowance(ramp, source.warmup),
                    sent=before.sent,
                    deferred=before.deferred,
                    rate=ramp.rate,
                    previous_rate=before.rate,
                )
            )
        return ramp

    def left(self, base: str, source: Source, now: float) -> int | None:
        ramp = self.ramp(base, source, now)
        return None if ramp is None else left(ramp, source.warmup)

    def record(self, base: str, source: Source, now: float, accepted: bool) -> None:
        ramp = self.ramp(base, source, now)
        if ramp is not None:
            self.ramps[(base, source.address)] = count(ramp, accepted)

    def move(self, base: str, source: Source, now: float, to_first: bool) -> Ramp:
        """An operator's `restart` (`to_first`) or `finish` of `source`'s ramp at `base`;
        the day ends it came across first are drained as usual."""
        ramp = self.ramp(base, source, now)
        assert ramp is not None, "a source without a schedule has no ramp to move"
        moved = (restart if to_first else finish)(ramp, source.warmup, now)
        self.ramps[(base, source.address)] = moved
        return moved

    def bases(self, address: str) -> list[str]:
        """The destinations that `address` has a ramp at, sorted."""
        return sorted(base for base, a in self.ramps if a == address)

    def prune(self, now: float) -> None:
        """Forget the ramps unused for IDLE_DAYS (a ramp's day moves when it is used),
        and the longest unused past KEPT."""
        today = day_of(now)
        ramps = [(k, r) for k, r in self.ramps.items() if today - r.day < IDLE_DAYS]
        if len(ramps) > KEPT:
            ramps = sorted(ramps, key=lambda entry: entry[1].day)[-KEPT:]
        self.ramps = dict(ramps)

    def drain(self) -> list[Step]:
        steps, self._steps = self._steps, []
        return steps

    def snapshot(self, base: str, source: Source | None, now: float) -> dict:
        """What `mtaqueue-ctl domains` shows of a (source, destination)'s warm-up."""
        if source is None or not source.warmup:
            return {"warmup": None}
        saved = self.ramps.get((base, source.address))
        ramp, _ = roll(saved or Ramp(day=day_of(now)), source.warmup, now)  # a view: not kept
        return {"warmup": view(ramp, source.warmup)}


def view(ramp: Ramp, schedule: tuple[int, ...]) -> dict:
    """A (rolled) ramp as `mtaqueue-ctl domains` and `warmup` show it (a stable shape)."""
    return {
        "step": ramp.step + 1,  # day 1 of the schedule is its first step
        "steps": len(schedule),
        "allowance": allowance(ramp, schedule),
        "sent_today": ramp.sent,
        "deferred_today": ramp.deferred,
        "held": ramp.held,
        "last_rate": ramp.rate,
    }
