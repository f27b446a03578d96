"""Reply latency of one destination, and whether it is slowing us down (sans-IO).

    ReplyLatency(factor, saved=None, at=0.0)
    .sample(now, kind, seconds, lag=0.0) -> Round | None   a timed reply; a round once judged
    .restart(now)                 the sender changed its pace: rounds count from here
    .baseline(kind, now) -> float | None   .rtt(now) -> float | None   .saved(now)
    .last  .calm    KINDS  ROUND_TRIPS
    Round(start, kind, samples, slow, ratio, rose, near, rate, median, previous)
        .verdict: SLOW, ROSE, CALM or HIGH
    OwnLoad(): .lag(now, seconds)  .lagging(now)  .reported(now, key, verdict)  .ours(now)
        len(own_load): destinations that closed a round in the last CROWD_WINDOW

Seed 003's silent throttling: a receiver that never refuses but answers more slowly the
harder it is pushed. Every reply we time is a sample of its kind (KINDS): the TCP connect,
the banner, EHLO, the first reply to a group of MAIL..DATA (a round trip; in lock-step,
MAIL's), lock-step RCPT and DATA, and the reply after the final dot, timed from the dot so
that the size of the message does not count. Each kind has its own baseline: its minimum
over the last WINDOW (as BBR keeps its minimum round trip). Slowing cannot raise a minimum,
and a host that is slow at every load (a steady 1 s after the dot) has a 1 s baseline: it
is slow, not throttling. A sample is slow when it is over `factor` times its baseline and
FLOOR over it (on loopback a loaded machine's jitter triples a 0.3 ms reply).

Each kind is judged in rounds of ROUND samples of it, counting only those that started
after the pace last changed (`restart`): a reply in flight then says nothing of the new
pace. A round is SLOW when SLOW_SHARE of its samples or more are slow, CALM when none is and
its median is near the baseline, else HIGH (over the baseline, not slow: hold); per kind, so
that a site which stretches only the reply after the dot is heard however many RCPTs or
connections come between (and one slow reply in a round is not a slowdown). A round whose
median rose by RISE, and FLOOR, over the last round of its kind (at the pace before) ROSE:
gentler than slow, it says whether one step more of load was one too many (how TCP Vegas and
BBR read a round trip that grows with what is in flight). A round also tells its rate: the
replies of its kind that arrived over its span, those in flight at a restart included (the
dot's: the messages accepted).

Near the baseline is within NEAR times it, NEAR_FLOOR over it, or NEAR_DEV times the kind's
usual excess over it, whichever is most: the excess of a round's median is averaged as TCP
averages its round trip's variation (DEV_GAIN a near round; DEV_CREEP one that is not, so that a
host whose replies wander is learned, and a site that stretches them all at once is heard
first), from the spread of the first round (the pace may be too much already). A reply that
always comes within 0.25 s is near when it takes 0.27 s; one that takes 80 to 140 ms at random
is near all the while. The latency is `calm` while every kind's last round since the pace
changed was, the dot's included.

Our own load is not the destination's (`OwnLoad`): the driver reports how late its event
loop runs (its timer, or the CPU its thread waited for), and a sample is judged without the
loop's lag of the last LAG_WINDOW (a reply read late was not sent late). A round over its
baseline is ours, not the destination's, while the loop lags FLOOR or more, or when most of
the destinations that closed a round in the last CROWD_WINDOW (at least CROWD of them) were
over theirs alike: this machine, its network or its DNS.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass

KINDS = ("connect", "banner", "ehlo", "mail", "rcpt", "data", "dot")
# A command's reply is a round trip and little work; a connect says nothing of a path
# behind a proxy, a banner may wait for the server's DNS, the dot for its filters.
ROUND_TRIPS = ("ehlo", "mail", "rcpt", "data")
WINDOW = 600.0  # seconds a minimum is kept: longer than a cut takes to show
_BUCKETS = 5  # the window's minimum is kept in this many slices (constant memory)
FLOOR = 0.1  # seconds over the baseline before a sample can be slow
NEAR = 1.1  # a round's median up to this times the baseline is near it, or
NEAR_FLOOR = 0.01  # seconds over it (a fast reply's jitter), or
NEAR_DEV = 3.0  # times the kind's usual excess over it
DEV_GAIN = 0.25  # of a near round's excess, into the usual one
DEV_CREEP = 1 / 64  # of a high round's (a persistent stretch is heard long before)
ROUND = 4  # samples of one kind judged together
SLOW_SHARE = 0.5  # of a round's samples slow: the round is slow
RISE = 0.5  # a round's median this much over the last round's of its kind: it rose
LAG_WINDOW = 2.0  # seconds of the loop's lag a sample is judged without
CROWD = 3  # destinations that closed a round, at least, before the crowd says anything
CROWD_SHARE = 2 / 3  # of them slow at once: it is us
CROWD_WINDOW = 60.0

SLOW = "slow"
ROSE = "rose"
CALM = "calm"
HIGH = "high"


@dataclass(frozen=True, slots=True)
class Round:
    """ROUND samples of one kind judged together."""

    start: float  # rounds count samples that started from here
    kind: str
    samples: int
    slow: int
    ratio: float  # the median of sample / baseline
    rose: bool = False  # its median rose over the last round's of its kind
    near: bool = True  # its median is near the baseline
    rate: float = 0.0  # samples a second over the round (the dot's: messages accepted)
    median: float = 0.0  # seconds
    previous: float = 0.0  # the median of the last round of its kind before that was not
    # slow (a pace it took); 0.0: none

    @property
    def verdict(self) -> str:
        if self.slow >= SLOW_SHARE * self.samples:
            return SLOW
        if self.rose:
            return ROSE
        return CALM if self.slow == 0 and self.near else HIGH


class _WindowedMin:
    """The minimum of the values added over the last WINDOW: one per slice of it."""

    __slots__ = ("_slices",)

    def __init__(self) -> None:
        self._slices: deque[list[float]] = deque()  # [start, minimum], oldest first

    def add(self, now: float, value: float) -> None:
        if self._slices and now - self._slices[-1][0] < WINDOW / _BUCKETS:
            last = self._slices[-1]
            last[1] = min(last[1], value)
        else:
            self._slices.append([now, value])
        self._expire(now)

    @property
    def seen(self) -> bool:
        """Whether any value is kept (expired slices go at the next add or value)."""
        return bool(self._slices)

    def value(self, now: float) -> float | None:
        self._expire(now)
        return min(value for _, value in self._slices) if self._slices else None

    def _expire(self, now: float) -> None:
        while self._slices and self._slices[0][0] <= now - WINDOW:
            self._slices.popleft()


class ReplyLatency:
    def __init__(self, factor: float, saved: dict[str, float] | None = None, at: float = 0.0):
        """`saved`: baselines by kind, as `saved()` gave them at `at` (a restart)."""
        self.factor = factor
        self._minimum = {kind: _WindowedMin() for kind in KINDS}
        for kind, seconds in (saved or {}).items():
            if kind in self._minimum:
                self._minimum[kind].add(at, seconds)
        self.last: Round | None = None  # the last round judged
        self._round_trips = 0  # samples of ROUND_TRIPS kinds, up to 2
        self._start = -math.inf  # rounds count samples that started from here
        self._ratios: dict[str, list[float]] = {}  # by kind, of its round so far
        self._seconds: dict[str, list[float]] = {}
        self._medians: dict[str, float] = {}  # each kind's last round's median, seconds
        self._unslowed: dict[str, float] = {}  # the same, of its last round that was not slow
        self._slow: Counter[str] = Counter()
        self._verdicts: dict[str, str] = {}  # each kind's last round since the start
        self._arrived: dict[str, list] = {}  # since its last round: [first one's time, count]
        self._dev: dict[str, float] = {}  # a round median's usual excess over the baseline

    def sample(self, now: float, kind: str, seconds: float, lag: float = 0.0) -> Round | None:
        """A reply of `kind` that took `seconds` (read at `now`, while the loop lagged up to
        `lag`); the round, when this sample closes one."""
        window = self._minimum[kind]
        base = window.value(now)
        if kind in ROUND_TRIPS:
            self._round_trips = min(self._round_trips + 1, 2)
        window.add(now, seconds)  # (as measured: the fastest is one the loop did not delay)
        self._arrived.setdefault(kind, [now, 0])[1] += 1  # (in flight at a restart too)
        if base is None or now - seconds < self._start:
            return None  # the first of its kind, or sent before the pace changed
        judged = max(0.0, seconds - lag)
        ratios = self._ratios.setdefault(kind, [])
        ratios.append(judged / max(base, 1e-4))
        self._seconds.setdefault(kind, []).append(judged)
        if judged > self.factor * base and judged > base + FLOOR:
            self._slow[kind] += 1
        if len(ratios) < ROUND:
            return None
        del self._ratios[kind]
        timed = sorted(self._seconds.pop(kind))
        median, spread = timed[ROUND // 2], timed[-1] - timed[0]
        before, self._medians[kind] = self._medians.get(kind), median
        rose = before is not None and median >= max((1 + RISE) * before, before + FLOOR)
        ratios.sort()
        near = self._near(kind, median, spread, base, slow=self._slow[kind])
        first, count = self._arrived.pop(kind)
        rate = (count - 1) / (now - first) if now > first else 0.0
        slow = self._slow.pop(kind, 0)
        ratio, previous = ratios[ROUND // 2], self._unslowed.get(kind, 0.0)
        closed = Round(self._start, kind, ROUND, slow, ratio, rose, near, rate, median, previous)
        self._verdicts[kind] = closed.verdict
        if closed.verdict != SLOW:
            self._unslowed[kind] = median
        self.last = closed
        return closed

    def _near(self, kind: str, median: float, spread: float, base: float, slow: int) -> bool:
        """Whether a round's `median` is near `base`; learns the kind's usual excess (at
        first, the `spread` of the round: a site may be stretching them all already)."""
        excess, dev = median - base, self._dev.get(kind)
        if dev is None:
            dev = self._dev[kind] = spread
        near = excess <= max(NEAR_FLOOR, (NEAR - 1) * base, NEAR_DEV * dev)
        if not slow:
            self._dev[kind] = dev + (excess - dev) * (DEV_GAIN if near else DEV_CREEP)
        return near

    @property
    def calm(self) -> bool:
        """Every kind's last round since the pace changed was calm, the dot's among them
        once it has a baseline (every delivery times one, and it is the reply a site slows
        most; the others come sooner and would speak for a pace not judged yet)."""
        if "dot" not in self._verdicts and self._minimum["dot"].seen:
            return False
        return all(verdict == CALM for verdict in self._verdicts.values())

    def restart(self, now: float) -> None:
        """The pace changed at `now`: the next round counts only what started since."""
        self._start = now
        self._ratios.clear()
        self._seconds.clear()
        self._slow.clear()
        self._verdicts.clear()
        self._arrived.clear()

    def baseline(self, kind: str, now: float) -> float | None:
        return self._minimum[kind].value(now)

    def rtt(self, now: float) -> float | None:
        """The path's round trip: the least baseline of the commands' replies, once two
        were timed (one sample, from a loaded moment, decides nothing)."""
        known = [self.baseline(kind, now) for kind in ROUND_TRIPS]
        trips = [b for b in known if b is not None]
        return min(trips) if trips and self._round_trips >= 2 else None

    def saved(self, now: float) -> dict[str, float]:
        """The baselines, to carry across a restart."""
        baselines = {kind: self.baseline(kind, now) for kind in KINDS}
        return {kind: round(b, 6) for kind, b in baselines.items() if b is not None}


class OwnLoad:
    """What slows every destination at once: our event loop, or all of them together."""

    def __init__(self) -> None:
        self._lags: deque[tuple[float, float]] = deque()  # (at, seconds late)
        self._rounds: dict[str, tuple[float, bool]] = {}  # destination -> (at, slow)

    def __len__(self) -> int:
        return len(self._rounds)

    def lag(self, now: float, seconds: float) -> None:
        """The event loop ran `seconds` late at `now` (the driver's watch)."""
        while self._lags and self._lags[-1][1] <= seconds:
            self._lags.pop()  # (a later, larger lag outlives them: a max queue)
        self._lags.append((now, seconds))

    def lagging(self, now: float) -> float:
        """The loop's largest lag over the last LAG_WINDOW."""
        while self._lags and self._lags[0][0] < now - LAG_WINDOW:
            self._lags.popleft()
        return self._lags[0][1] if self._lags else 0.0

    def reported(self, now: float, key: str, verdict: str) -> None:
        """Destination `key` closed a round at `now`."""
        self._rounds.pop(key, None)  # (kept in time order: the oldest first)
        self._rounds[key] = (now, verdict != CALM)  # (over its baseline, a little or more)
        while self._rounds:
            oldest = next(iter(self._rounds))
            if self._rounds[oldest][0] >= now - CROWD_WINDOW:
                break
            del self._rounds[oldest]

    def ours(self, now: float) -> bool:
        """Whether slowness now is ours: the loop lags, or the crowd slowed."""
        if self.lagging(now) >= FLOOR:
            return True
        recent = [slow for at, slow in self._rounds.values() if at >= now - CROWD_WINDOW]
        return len(recent) >= CROWD and sum(recent) >= CROWD_SHARE * len(recent)
