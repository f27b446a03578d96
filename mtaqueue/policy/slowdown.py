"""Silent throttling of one destination: what its reply latency does to the pace.

    Slowdown(factor, learned, now)
    .timed(now, samples, lag) -> Round | None      replies timed; a round once one closes
    .react(now, closed, ours, concurrency, learner) -> bool   whether it cut
    .stepped_up(now, old)       the concurrency grew a step (news while it recovers)
    .changes() -> [Slowed]      cuts and steps back up since the last call (the log)
    .view(now, concurrency) -> dict    .saved(now)    .latency    .slowed

A round of one kind of reply (policy/latency.py) that is slow, and not ours (`ours`: our event
loop lags, or every destination slowed at once), is the destination saying "slower"
without an error. The concurrency halves, or steps back one if the step up since the
round before is what slowed the site (its knee, policy/concurrency.py); a round that only
ROSE over the one before steps back too, when a step up came between (else it cuts
nothing: a site's replies wander). Sessions first:
what a slowed site accepts is bound by its slow replies, and a rate learned from it would
hold the pace down long after the replies are fast again (bench/RESULTS.md). At one
connection still slowed, the site minds the rate: that takes a throttle signal as for a
421 (a cool-down, and BETA times what it took, which at one connection is what it allows;
the learned rate's own knee, policy/rate_learner.py). While replies stay slow, each new
round cuts again. Concurrency grows back only while every kind's last round was calm, one step a
round; each step
until it is back where the cut found it is news, as the cut is. `slowed` keeps the last
cut for people: when, how slow (the round's median over the baseline, of the kind slow
most often), and the limit before and after.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .concurrency import AdaptiveConcurrency
from .latency import ROSE, SLOW, ReplyLatency, Round
from .rate_learner import Learned, RateLearner


@dataclass(frozen=True, slots=True)
class Slowed:
    """A cut for latency (`kind` says which reply slowed; `new` = `old` = 1 when the cut
    was the rate's), or a step back up after one (no `kind`)."""

    at: float
    ratio: float  # the round's median over the baseline
    kind: str  # the reply kind slow most often ("" for a step up)
    old: int
    new: int


class Slowdown:
    def __init__(self, factor: float, learned: Learned | None, now: float) -> None:
        self.latency = ReplyLatency(
            factor,
            learned.latency if learned is not None else None,
            learned.at if learned is not None else now,
        )
        self.slowed: Slowed | None = None
        self._changes: list[Slowed] = []

    def timed(self, now: float, samples: Iterable[tuple[str, float]], lag: float) -> Round | None:
        """Replies timed, as (kind, seconds), read while the event loop lagged up to `lag`:
        the last round they closed, if any."""
        closed = None
        for kind, seconds in samples:
            closed = self.latency.sample(now, kind, seconds, lag) or closed
        return closed

    def react(
        self,
        now: float,
        closed: Round,
        ours: bool,
        concurrency: AdaptiveConcurrency,
        learner: RateLearner,
    ) -> bool:
        """A round closed: growth follows a calm one; a slow one that is not `ours` cuts
        the concurrency and the rate. Whether it cut."""
        concurrency.steady(self.latency.calm)
        if closed.verdict not in (SLOW, ROSE) or ours:
            return False
        old = concurrency.limit
        raised = concurrency.raised_at
        probed = raised is not None and closed.start <= raised  # (a step up restarts rounds)
        if closed.verdict == ROSE:  # gentler: only a step up that did it steps back
            if not probed:
                return False
            concurrency.step_back(now)
        elif old == 1:  # its sessions are not what it minds: the rate is
            learner.throttled(
                now, f"latency {closed.ratio:.1f}x the {closed.kind} reply's baseline"
            )
        elif probed:
            concurrency.step_back(now)
        else:
            concurrency.throttled()
        self.slowed = Slowed(now, closed.ratio, closed.kind, old, concurrency.limit)
        self._changes.append(self.slowed)
        self.latency.restart(now)  # replies in flight were sent at the old pace
        return True

    def stepped_up(self, now: float, old: int) -> None:
        """The concurrency grew from `old`: the next round judges the new level."""
        self.latency.restart(now)
        slowed, last = self.slowed, self.latency.last
        if slowed is not None and old < slowed.old:
            ratio = last.ratio if last is not None else 1.0
            self._changes.append(Slowed(now, ratio, "", old, old + 1))

    def changes(self) -> list[Slowed]:
        changes, self._changes = self._changes, []
        return changes

    def saved(self, now: float) -> dict[str, float]:
        return self.latency.saved(now)

    def view(self, now: float, concurrency: AdaptiveConcurrency) -> dict:
        """For `mtaqueue-ctl domains`: baselines by kind (seconds), the last round (its
        kind, median over the baseline and verdict), the knee, the last cut."""
        last, slowed = self.latency.last, self.slowed
        return {
            "baseline": self.latency.saved(now),
            "last": None
            if last is None
            else {"kind": last.kind, "ratio": last.ratio, "verdict": last.verdict},
            "knee": concurrency.knee or None,
            "slowed": None
            if slowed is None
            else {
                "at": slowed.at,
                "ratio": slowed.ratio,
                "kind": slowed.kind,
                "from": slowed.old,
                "to": slowed.new,
            },
        }
