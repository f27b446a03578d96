"""Alert rules over the queue's measurements (pure): which conditions hold, and when they
start and stop holding.

The daemon measures the queue every so often (a `Snapshot`, see `metrics.Metrics.snapshot`)
and passes it with the time. `Alerts.evaluate` answers with one `alert` event for each
condition that started holding ("firing") or stopped ("cleared") since the previous call,
never in between, so a log shows each incident exactly twice. `active()` lists the firing
ones for the mtaqueue_alert_active gauge. A reload (`reconfigure`) keeps the alerts of the
rules that stay and clears those of the rules that go.

Rules are config tables ([[alerts.rules]], picked by `type`); a rule names one subject or
"*" for each subject the snapshot has:
- oldest_age: the oldest waiting message of a class is older than `over`.
- deferral_rate: over the last `window`, more than `over` (a fraction) of a destination's
  attempts were answered 4xx or not at all, out of at least `min_attempts` attempts. The
  snapshot carries cumulative counters and the rate is their increase over the window, as
  Prometheus' increase() does, so the rate needs no per-attempt history here.
- depth_growing: a destination's pending recipients have not gone down for `for`, and are
  now more than at the start of that time and more than `over`. Sampled at each
  evaluation, so arrivals and deliveries within one interval net out.
- spool_free: the spool's free space is under `under`.
- review_size: more than `over` messages wait in the review queue (mail held for someone's
  decision: at expiry, or when the application could not be asked; `mtaqueue-ctl review`).
- review_oldest_age: the message longest in review has waited there more than `over`:
  seed 004's "no review queue without an owner", the owner being paged when nobody acts.
Both have the one subject "review".
- sender_blocked: a destination is paused because it refused our address (a block list,
  our reputation: policy/shaper.py's blocked_by), until its probe gets another answer.
- webhook_backlog: the oldest event a webhook endpoint has not taken is older than `over`
  (the endpoint is down or too slow; at its `max_age` events start being dropped). The
  subject is the webhook's name.
- memory_growing: a process's resident memory (the subject: "daemon", "writer") kept
  rising over the last `for` while the queue stayed level: a leak, not load. The window
  is cut in thirds; each third's median RSS must be above the one before, the last above
  the first by more than `over`, and the queue's median in the last third no more than
  10% (and 100 messages) above the first's. A step up after a burst (memory the
  allocator keeps) is flat after it, so it does not fire; a straight climb does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median

from .config.alert_rules import (
    AlertRule,
    DeferralRate,
    DepthGrowing,
    MemoryGrowing,
    OldestAge,
    ReviewOldestAge,
    ReviewSize,
    SenderBlocked,
    SpoolFree,
    WebhookBacklog,
)

FIRING = "firing"
CLEARED = "cleared"
REVIEW = "review"  # the subject of the review rules


@dataclass(frozen=True, slots=True)
class DestinationStats:
    depth: int  # pending recipients: queued or deferred, not held
    attempts: int  # attempts counted so far; may start over from 0 (then it is a new count)
    deferrals: int  # of those, answered 4xx or not at all
    blocked: bool = False  # paused: the site refused our address (shaper's blocked_by)


@dataclass(frozen=True, slots=True)
class Snapshot:
    oldest: Mapping[str, float]  # class -> age in seconds of its oldest waiting message
    destinations: Mapping[str, DestinationStats]
    spool_free: int  # bytes
    review_size: int = 0  # messages in the review queue
    review_oldest_age: float = 0.0  # seconds the longest waiting there has waited; 0 = none
    webhooks: Mapping[str, float] = field(default_factory=dict)  # name -> oldest event's age
    resident: Mapping[str, int] = field(default_factory=dict)  # process -> RSS bytes
    queued: int = 0  # messages in the queue


@dataclass(slots=True)
class _Growth:
    since: float  # when the depth last went down (or was first seen)
    base: int  # the depth then
    last: int  # the depth at the latest evaluation


# (time, attempts, deferrals) samples of one destination's counters.
_History = deque[tuple[float, int, int]]
# (time, process -> RSS bytes, messages queued) samples, for memory_growing.
_Memory = deque[tuple[float, Mapping[str, int], int]]
QUEUE_LEVEL = (1.1, 100)  # "level": at most 10% and 100 messages more than before
# subject -> (value, whether the condition holds)
_Measured = dict[str, tuple[float, bool]]


def rule_name(rule: AlertRule) -> str:
    return rule.name or type(rule).__struct_config__.tag


class Alerts:
    def __init__(self, rules: Sequence[AlertRule]) -> None:
        self._firing: set[tuple[AlertRule, str]] = set()  # (rule, subject)
        self._counts: dict[str, _History] = {}
        self._growth: dict[str, _Growth] = {}
        self._memory: _Memory = deque()
        self.reconfigure(rules)

    def reconfigure(self, rules: Sequence[AlertRule]) -> list[dict]:
        """Take new rules (a reload). A rule that stays keeps its alerts firing, without a
        new event; the alerts of a rule that is gone clear now: their events."""
        self.rules = tuple(dict.fromkeys(rules))  # a rule given twice is one rule
        # Counter samples are kept as far back as the longest window needs.
        windows = [r.window for r in self.rules if isinstance(r, DeferralRate)]
        self._horizon = max(windows, default=0.0)
        self._tracks_depth = any(isinstance(r, DepthGrowing) for r in self.rules)
        periods = [r.period for r in self.rules if isinstance(r, MemoryGrowing)]
        self._memory_horizon = max(periods, default=0.0)
        if not self._memory_horizon:
            self._memory.clear()
        if not self._horizon:
            self._counts.clear()
        if not self._tracks_depth:
            self._growth.clear()
        gone = sorted(
            ((rule, subject) for rule, subject in self._firing if rule not in self.rules),
            key=lambda key: (rule_name(key[0]), key[1]),
        )
        self._firing.difference_update(gone)
        return [_event(rule, subject, CLEARED, 0) for rule, subject in gone]

    def size(self) -> int:
        """Samples and histories held (mtaqueue_memory_entries)."""
        return len(self._counts) + len(self._growth) + len(self._memory)

    def active(self) -> list[tuple[str, str]]:
        """(alert name, subject) of every firing alert."""
        return sorted({(rule_name(rule), subject) for rule, subject in self._firing})

    def evaluate(self, now: float, snapshot: Snapshot) -> list[dict]:
        """The `alert` events of the conditions that started or stopped holding."""
        self._record(now, snapshot)
        events = []
        for rule in self.rules:
            measured = self._measure(rule, now, snapshot)
            # A subject gone from the snapshot (a destination with nothing left) clears.
            was_firing = {subject for r, subject in self._firing if r == rule}
            for subject in sorted(measured.keys() | was_firing):
                value, holds = measured.get(subject, (0, False))
                if holds == (subject in was_firing):
                    continue
                if holds:
                    self._firing.add((rule, subject))
                else:
                    self._firing.discard((rule, subject))
                events.append(_event(rule, subject, FIRING if holds else CLEARED, value))
        return events

    def _record(self, now: float, snapshot: Snapshot) -> None:
        destinations = snapshot.destinations
        if self._horizon:
            for name, stats in destinations.items():
                history = self._counts.get(name)
                if history is None or stats.attempts < history[-1][1]:
                    # New or started over: everything counted so far is recent.
                    history = self._counts[name] = deque([(now, 0, 0)])
                history.append((now, stats.attempts, stats.deferrals))
                # Keep one sample at or before the longest window's start, as its base.
                while len(history) > 1 and history[1][0] <= now - self._horizon:
                    history.popleft()
            for name in self._counts.keys() - destinations.keys():
                del self._counts[name]
        if self._tracks_depth:
            for name, stats in destinations.items():
                growth = self._growth.get(name)
                if growth is None or stats.depth < growth.last:
                    self._growth[name] = _Growth(now, stats.depth, stats.depth)
                else:
                    growth.last = stats.depth
            for name in self._growth.keys() - destinations.keys():
                del self._growth[name]
        if self._memory_horizon:
            memory = self._memory
            memory.append((now, snapshot.resident, snapshot.queued))
            while len(memory) > 1 and memory[1][0] <= now - self._memory_horizon:
                memory.popleft()

    def _measure(self, rule: AlertRule, now: float, snapshot: Snapshot) -> _Measured:
        """Each subject's value, and whether the rule holds for it."""
        measured: _Measured = {}
        match rule:
            case OldestAge():
                classes = snapshot.oldest if rule.klass == "*" else (rule.klass,)
                for klass in classes:
                    age = snapshot.oldest.get(klass, 0.0)
                    measured[klass] = (round(age, 1), age > rule.over)
            case DeferralRate():
                for name in _subjects(rule.destination, self._counts):
                    attempts, deferrals = _increase(self._counts[name], now - rule.window)
                    rate = deferrals / attempts if attempts else 0.0
                    holds = attempts >= rule.min_attempts and rate > rule.over
                    measured[name] = (round(rate, 3), holds)
            case DepthGrowing():
                for name in _subjects(rule.destination, self._growth):
                    growth = self._growth[name]
                    grew = growth.last > growth.base
                    seconds = now - growth.since if grew else 0.0
                    holds = grew and growth.last > rule.over and seconds >= rule.period
                    measured[name] = (round(seconds, 1), holds)
            case SpoolFree():
                measured["spool"] = (snapshot.spool_free, snapshot.spool_free < rule.under)
            case ReviewSize():
                size = snapshot.review_size
                measured[REVIEW] = (size, size > rule.over)
            case ReviewOldestAge():
                age = snapshot.review_oldest_age
                measured[REVIEW] = (round(age, 1), age > rule.over)
            case SenderBlocked():
                for name in _subjects(rule.destination, snapshot.destinations):
                    blocked = snapshot.destinations[name].blocked
                    measured[name] = (int(blocked), blocked)
            case MemoryGrowing():
                for name in _subjects(rule.process, snapshot.resident):
                    grown = _memory_growth(self._memory, name, now - rule.period)
                    measured[name] = (grown or 0, grown is not None and grown > rule.over)
            case WebhookBacklog():
                for name in _subjects(rule.webhook, snapshot.webhooks):
                    age = snapshot.webhooks[name]
                    measured[name] = (round(age, 1), age > rule.over)
        return measured


def _event(rule: AlertRule, subject: str, state: str, value: float) -> dict:
    return {
        "event": "alert",
        "name": rule_name(rule),
        "state": state,
        "subject": subject,
        "value": value,
        "threshold": rule.threshold,
    }


def _subjects(pattern: str, known: Mapping[str, object]) -> list[str]:
    if pattern == "*":
        return list(known)
    return [pattern] if pattern in known else []


def _increase(history: _History, start: float) -> tuple[int, int]:
    """Attempts and deferrals counted since `start`: from the latest sample at or before it
    (or the oldest there is) to the newest."""
    base = history[0]
    for sample in history:
        if sample[0] > start:
            break
        base = sample
    newest = history[-1]
    return newest[1] - base[1], newest[2] - base[2]


def _memory_growth(memory: _Memory, process: str, start: float) -> int | None:
    """How much `process`'s RSS rose over the samples since `start`, if it kept rising
    while the queue stayed level (else None); None too before the samples span the time."""
    if not memory or memory[0][0] > start:
        return None
    samples = [(at, rss[process], queued) for at, rss, queued in memory if process in rss]
    span = (samples[-1][0] - start) / 3 if samples else 0.0
    if span <= 0:
        return None
    thirds = [
        [s for s in samples if start + i * span <= s[0] <= start + (i + 1) * span] for i in range(3)
    ]
    if not all(thirds):
        return None
    rss = [median(s[1] for s in third) for third in thirds]
    first_queue, last_queue = (median(s[2] for s in thirds[i]) for i in (0, 2))
    factor, slack = QUEUE_LEVEL
    if not rss[0] < rss[1] < rss[2] or last_queue > first_queue * factor + slack:
        return None
    return int(rss[2] - rss[0])
