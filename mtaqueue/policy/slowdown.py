"""Silent throttling of one destination: what its reply latency does to the pace.

    Slowdown(factor, learned, now)
    .timed(now, samples, lag) -> Round | None      replies timed; a round once one closes
    .react(now, closed, ours, concurrency, pace) -> bool   whether it cut
    .stepped_up(now, old, rate) the concurrency grew a step (news while it recovers)
    .changes() -> [Slowed]      cuts and steps back up since the last call (the log)
    .view(now, concurrency, pace) -> dict    .saved(now)    .latency    .slowed

A round of one kind of reply (policy/latency.py) over its baseline, and not ours (`ours`: our
event loop lags, or every destination slowed at once), is the destination saying "slower"
without an error. What it minds is read from what the last step did (Little's law):

- SLOW at a steady pace: the concurrency halves (at one connection, the rate is cut), not
  again within SETTLE (a site that counts a rate over a window of its own stays slow for a
  while after a cut, and halving on would end at one connection); a site still over its
  baseline then gets the concurrency or the rate cut again.
- Over the baseline (SLOW, ROSE or HIGH) right after a step up of the concurrency (and a
  round of its kind before it that was not slow, to compare with): if the
  extra session still brought RATE_GAIN of its share of mail more (by Little's law, the
  sessions over the reply after the dot: from N to N+1 sessions, that reply stretched less
  than (N+1)/(N+RATE_GAIN) times), the site takes sessions and minds the rate: the rate
  is cut, the sessions kept; else the step back goes to the knee (policy/concurrency.py).
- Over it right after a step up of the rate ceiling: back to the level before, held
  (policy/pace_cap.py).
- Dot rounds HIGH at a steady pace (their median stretched, none slow), PERSIST in a row: the
  rate is cut, a margin under what the site took; if they are still stretched SETTLE later,
  the rate was not it: the concurrency steps back; if neither brought a calm round, the
  stretch is not one the pace can hold (a loaded machine, a path): nothing more is cut for
  it until a calm round. Other replies over their baseline, or one dot round, only hold
  growth.

Both grow back only while every kind's last round was calm (near its baseline), one step a
round: the rate ceiling while it is what binds (the dot round accepted most of it), else the
concurrency. Each step up until back where the cut found it is news, as the cut is. `slowed`
keeps the last cut for people: when, how slow (the round's median over the baseline), which
reply, the limits before and after.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from .concurrency import AdaptiveConcurrency
from .latency import CALM, HIGH, SLOW, ReplyLatency, Round
from .pace_cap import SETTLE, PaceCap  # (a site's own window: one cut an episode, either lever)
from .rate_learner import Learned

RATE_GAIN = 0.3  # of one more session's share of mail: what a site minding sessions loses
PERSIST = 3  # dot rounds HIGH in a row at a steady pace: the rate is what it minds
TAKEN = 3.0  # seconds of dot replies behind what the site takes (a round's few are a burst)


@dataclass(frozen=True, slots=True)
class Slowed:
    """A cut for latency (`kind` says which reply slowed), or a step back up after one (no
    `kind`): connections before and after, the rate ceiling (messages a second, 0.0: none)
    before and after."""

    at: float
    ratio: float  # the round's median over the baseline
    kind: str  # the reply kind slow most often ("" for a step up)
    old: int
    new: int
    rate_old: float = 0.0
    rate_new: float = 0.0


class Slowdown:
    def __init__(self, factor: float, learned: Learned | None, now: float) -> None:
        self.latency = ReplyLatency(
            factor,
            learned.latency if learned is not None else None,
            learned.at if learned is not None else now,
        )
        self.slowed: Slowed | None = None
        self._changes: list[Slowed] = []
        self._dots: deque[float] = deque()  # when the dot replies of the last TAKEN came
        self._high = 0  # dot rounds HIGH in a row since the pace last changed
        self._halved = -SETTLE  # when the concurrency was last halved
        self._steady = -SETTLE  # when stretched replies at a steady pace last cut
        self._tried = 0  # levers pulled for them since a calm round: the rate, the sessions

    def timed(self, now: float, samples: Iterable[tuple[str, float]], lag: float) -> Round | None:
        """Replies timed, as (kind, seconds), read while the event loop lagged up to `lag`:
        the last round they closed, if any."""
        closed = None
        for kind, seconds in samples:
            closed = self.latency.sample(now, kind, seconds, lag) or closed
            if kind == "dot":
                self._dots.append(now)
        while self._dots and self._dots[0] < now - TAKEN:
            self._dots.popleft()
        return closed

    def taken(self) -> float:
        """Messages a second the site took over the last TAKEN (0.0: too few to say)."""
        dots = self._dots
        span = dots[-1] - dots[0] if len(dots) > 2 else 0.0
        return (len(dots) - 1) / span if span > 0 else 0.0

    def react(
        self,
        now: float,
        closed: Round,
        ours: bool,
        concurrency: AdaptiveConcurrency,
        pace: PaceCap,
    ) -> bool:
        """A round closed: growth follows a calm one; one over the baseline that is not
        `ours` cuts the concurrency or the rate. Whether it cut."""
        dot = closed.kind == "dot"
        if dot:
            self._high = self._high + 1 if closed.verdict == HIGH else 0
        taken = self.taken()
        calm, binds = self.latency.calm, pace.binds(taken)
        concurrency.steady(calm and not binds)  # (more sessions prove nothing under the cap)
        if ours:
            return False
        old, old_rate = concurrency.limit, pace.rate
        if closed.verdict == CALM:
            if dot:
                self._tried = 0  # (what was cut last worked)
            if calm and dot and binds and pace.grow(now):
                self.latency.restart(now)
                ratio = closed.ratio
                self._changes.append(Slowed(now, ratio, "", old, old, old_rate, pace.rate))
            return False
        raised = concurrency.raised_at
        if raised is not None and closed.start <= raised and closed.previous:  # (restarted)
            if dot and _kept_up(closed, old):
                if not pace.cut(now, closed.rate):  # one more session, more mail: the rate
                    return False
            else:
                concurrency.step_back(now)
        elif pace.raised_at is not None and closed.start <= pace.raised_at:
            pace.step_back(now, taken or closed.rate)
        elif closed.verdict == SLOW and old > 1:
            if now < self._halved + SETTLE:
                return False  # the last cut's episode
            concurrency.throttled()
            self._halved = now
        elif closed.verdict == SLOW or (dot and self._high >= PERSIST):
            if now < self._steady + SETTLE:
                return False  # the replies of the last cut's episode
            if closed.verdict != SLOW and self._tried >= 2:
                return False  # neither lever brought them back: not ours to hold
            if self._tried % 2 and old > 1:  # the rate was not it: the sessions
                concurrency.step_back(now)
            elif not pace.cut(now, taken or closed.rate):
                return False
            self._tried += 1
            self._steady = now
        else:
            return False  # a handshake over its baseline, or one round rising: growth waits
        self.slowed = Slowed(
            now, closed.ratio, closed.kind, old, concurrency.limit, old_rate, pace.rate
        )
        self._changes.append(self.slowed)
        self.latency.restart(now)  # replies in flight were sent at the old pace
        self._high = 0
        return True

    def stepped_up(self, now: float, old: int, rate: float) -> None:
        """The concurrency grew from `old` (under a rate ceiling `rate`): the next round
        judges the new level."""
        self.latency.restart(now)
        slowed, last = self.slowed, self.latency.last
        if slowed is not None and old < slowed.old:
            ratio = last.ratio if last is not None else 1.0
            self._changes.append(Slowed(now, ratio, "", old, old + 1, rate, rate))

    def changes(self) -> list[Slowed]:
        changes, self._changes = self._changes, []
        return changes

    def saved(self, now: float) -> dict[str, float]:
        return self.latency.saved(now)

    def view(self, now: float, concurrency: AdaptiveConcurrency, pace: PaceCap) -> dict:
        """For `mtaqueue-ctl domains`: baselines by kind (seconds), the last round (its
        kind, median over the baseline and verdict), the knee, the rate ceiling (a minute),
        the last cut."""
        last, slowed = self.latency.last, self.slowed
        return {
            "baseline": self.latency.saved(now),
            "last": None
            if last is None
            else {"kind": last.kind, "ratio": last.ratio, "verdict": last.verdict},
            "knee": concurrency.knee or None,
            "rate_per_minute": round(pace.rate * 60, 2) or None,
            "slowed": None
            if slowed is None
            else {
                "at": slowed.at,
                "ratio": slowed.ratio,
                "kind": slowed.kind,
                "from": slowed.old,
                "to": slowed.new,
                "rate_from": round(slowed.rate_old * 60, 2) or None,
                "rate_to": round(slowed.rate_new * 60, 2) or None,
            },
        }


def _kept_up(closed: Round, sessions: int) -> bool:
    """Whether the step up to `sessions` still brought RATE_GAIN of a session's share of mail
    more, by Little's law (messages a second = sessions / seconds a message): the dot's
    median stretched less than the sessions grew, with that gain."""
    if closed.previous <= 0 or sessions < 2:
        return False
    before = sessions - 1
    return closed.median / closed.previous <= sessions / (before + RATE_GAIN)
