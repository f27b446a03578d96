"""One destination's pacing: a learned rate (rate_learner.py), rate buckets, adaptive
concurrency, backoff mode and a circuit breaker, composed. The scheduler core
(scheduler/core.py) asks before it opens a connection or sends a message and reports what
happened; waiting here is pacing, not a failed attempt (the caller does not climb the retry
ladder for it). The global rate cap (delivery.max_rate) is the core's own `TokenBucket`,
not this.

Admission rules:
- A new connection needs the breaker's leave (closed, or the one half-open probe), a free
  slot, a token of the connections_per_minute bucket, and no throttle cool-down.
- Slots: every connection counts against the adaptive limit L. Ordinary connections take
  any class (the queue pops first-class mail first) and may number max(1, L - reserved_p0);
  the rest of L is for connections that take first-class work only, opened when such work
  waits and the ordinary ones are all busy. The floor of 1 keeps bulk moving when L is 1.
  An open connection keeps working while it would be admitted again: when L drops, the
  connections over it close as they finish their message.
- A message needs a token of the message bucket and no throttle cool-down (which holds
  every connection of the destination at once). An open breaker stops new connections
  only: one already open may finish its work.

Ceilings and rates: the concurrency ceiling is max_connections capped by a learned
"too many connections" (an operator's concurrency replaces both); the message bucket runs
at the learned rate under messages_per_minute (or an operator's rate; 0: no ceiling, the
learned rate still paces). In backoff stage s the ceiling, both rates and the retry
intervals are scaled by the backoff factors to the power s (ceiling floor 1).

Feedback rules (`result`):
- Delivered (a real 2xx, not a lost reply taken as delivered): a success for
  concurrency, backoff mode, breaker and the learned rate. A greylisting reply is one for
  the learned rate too: the site took the transaction at our pace (its rate limiter,
  Postfix's anvil, counts it), so a backlog's greylisted first wave (p0 first) grows the
  rate instead of going out at the slow start's 2/s.
- Throttling: a reply classified as throttling for the site (recipient-scoped throttling,
  such as Gmail's per-mailbox 4.2.1, is that mailbox's business), or a throttle rule's
  threshold reached: a throttle signal for the learned rate (a cool-down and a cut; "too
  many connections" caps the concurrency instead of cutting the rate), and a concurrency
  cut once per episode. After the cool-down, messages resume one at a time at the new
  rate: the bucket keeps nothing of the pause (a burst then is what the site refuses,
  and what opens connections past its cap). Only a rule's hit puts the
  destination in backoff mode (longer retries); a throttling reply is pacing, never a
  breaker failure, except from the half-open probe.
- Connection failure: a transient failure before MAIL FROM that is not throttling
  (refused, timeout, a 4xx greeting, EHLO, STARTTLS; not a DNS failure), or a timeout in
  any phase: breaker failure and concurrency cut.
- Hung (`hung`, the core's call: a connect or greeting timeout with no host left and
  no connection of the destination up): the breaker opens at once. A site that accepts
  TCP and never greets costs a slot for the whole banner timeout; at one connect at a
  time, five such failures never fall within breaker_window, and each queued message
  would burn a timeout of its own. Open, the queue waits for one probe, as one outage.
- AUTH refused (kind "auth": bad credentials, AUTH or STARTTLS demanded): the breaker
  opens at once. Every connection would be refused alike until the configuration is
  fixed, and an ESP may lock an account that keeps failing to log in; the probe after the
  cooldown tries again, and a reload with new credentials starts the destination afresh.
- Our address refused (kind "blocklist" or "reputation": listed, bad reputation, "not
  accepted from your IP"): the breaker opens at once for at least sender_block_pause
  (`blocked_by` keeps the reply); nothing more goes from this source until its probe is
  answered by something else; the connections open close after their transaction. Its
  mail waits uncharged; a pool's other sources take it.
- Reply latency (`timed`, then `react` with the core's word on our own load): silent
  throttling cuts the concurrency and the rate (policy/slowdown.py).
- Any other reply shows the site answering: it closes a half-open breaker, unless it is a
  throttle reply (the site is still unhappy: the breaker opens again). When a breaker
  closes, concurrency starts over at 1 and grows with successes.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from .. import config
from .breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from .buckets import TokenBucket
from .concurrency import AdaptiveConcurrency
from .latency import Round
from .pace_cap import PaceCap
from .rate_learner import PROBING, SLOW_STARTING, Change, Learned, RateLearner
from .replies import PHASES, Reply
from .slowdown import Slowdown, Slowed
from .throttle import BackoffMode, ThrottleRules
from .verdict import (
    AUTH,
    DELIVERED,
    GREYLISTING,
    PERMANENT,
    RECIPIENT,
    REFUSES_SOURCE,
    THROTTLING,
    Verdict,
)

_MAIL = PHASES.index("mail")

# 4xx replies on one connection since it last delivered before it is closed rather than
# used again: a strict receiver tarpits a session past a few (Postfix sleeps a second per
# reply after smtpd_soft_error_limit, 10, and hangs up at the hard limit, 20).
REFUSALS_PER_CONNECTION = 3
# Writing a transaction behind a final dot saves a round trip but puts a MAIL more on the
# wire per connection, all met by a throttle that starts (a blocklisting on loopback, where
# nothing is saved): only where a command's reply takes this long (the least baseline of
# them, policy/latency.py `rtt`), as on a path across a city (bench/RESULTS.md).
FOLLOW_LATENCY = 0.01
# A connection cap ("421 4.7.0 Error: too many connections from 192.0.2.1", "Too many
# concurrent SMTP connections", Exchange's "maximum number of concurrent connections",
# Comcast's "Too many sessions opened", Haraka's "connection concurrency limit"): the
# concurrency is learned, besides the rate. A connection *rate* limit is no cap.
_CONNECTIONS = re.compile(
    r"too many (?:\w+ ){0,2}(?:connections|sessions)|connection (?:limit|count|concurrency)"
    r"|concurrent (?:\w+ ){0,2}connections|simultaneous connections",
    re.I,
)


@dataclass(frozen=True, slots=True)
class ShaperState:
    """What an operator is told about when it changes."""

    circuit: str  # closed, open, half-open
    mode: str  # normal, backoff
    stage: int  # of backoff mode; 0 in normal mode


@dataclass(frozen=True, slots=True)
class _Override:
    rate_per_minute: float | None  # None: the configured rate; 0: no limit
    concurrency: int | None  # None: the configured max_connections
    until: float | None  # None: until replaced


class DestinationShaper:
    def __init__(
        self,
        pacing: config.Pacing,
        shaping: config.ShapingConfig,
        now: float,
        learned: Learned | None = None,
        *,
        stated_rate: float = 0.0,
    ) -> None:
        self.pacing = pacing
        self.release_spread = float(shaping.release_spread)
        self.concurrency = AdaptiveConcurrency(
            pacing.initial_connections,
            pacing.max_connections,
            learned.sessions if learned is not None else 0,
            now,
        )
        self.slowdown = Slowdown(shaping.latency_factor, learned, now)
        self.pace = PaceCap(learned.paced if learned is not None else 0.0, now)
        self.breaker = CircuitBreaker(
            shaping.breaker_failures,
            shaping.breaker_window,
            shaping.breaker_cooldown,
            shaping.breaker_cooldown_max,
        )
        self.backoff = BackoffMode(
            shaping.backoff_duration,
            shaping.backoff_rate_factor,
            shaping.backoff_retry_factor,
            shaping.backoff_successes,
        )
        self.rules = ThrottleRules(shaping.throttle_rules)
        self.sender_block_pause = float(shaping.sender_block_pause)
        self.blocked_by: str | None = None  # the reply that paused it for our address
        self._connections = TokenBucket(pacing.connections_per_minute / 60, pacing.burst, now)
        self._messages = TokenBucket(pacing.messages_per_minute / 60, pacing.burst, now)
        self._override: _Override | None = None
        self._start = stated_rate / 60  # where the learner begins without history
        self.learner = RateLearner(now, learned, start=self._start)

    # -- admission ---------------------------------------------------------------------

    def connect_wait(self, now: float, active: int, reserved: int, first_class: bool) -> float:
        """0.0: a connection may be opened now; `active` are open already, `reserved` of
        them for first-class work only, and `first_class` says whether this one would be.
        math.inf: not until something happens (a slot frees, the breaker's probe reports).
        Else the seconds to wait (the breaker's cooldown, the connection rate)."""
        self._apply(now)
        breaker = self.breaker.wait(now)
        if breaker == math.inf or not self._room(active, reserved, first_class):
            return math.inf
        return max(breaker, self._connections.wait(now), self.learner.wait(now))

    def pipelines(self, now: float) -> bool:
        """Whether a transaction may ride behind another's final dot (FOLLOW_LATENCY)."""
        rtt = self.slowdown.latency.rtt(now)
        return rtt is not None and rtt >= FOLLOW_LATENCY

    def keeps(self, now: float, active: int, reserved: int, first_class: bool) -> bool:
        """Whether an open connection (counted in `active`, and in `reserved` if it is a
        `first_class` one) may take more work: while it would be admitted again, rates
        and the breaker aside. False after the limit dropped under the connections open
        (a throttle cut, backoff, an operator's limit): the caller closes this one."""
        self._cap(now)  # (the rates do not matter here: the pump asks this per idle slot)
        if self.blocked_by is not None and self.breaker.state(now) == OPEN:
            return False  # our address refused: the connections open say nothing more
        return self._room(active - 1, reserved - first_class, first_class)

    def connected(self, now: float) -> None:
        """A connection is being opened (after `connect_wait` said 0)."""
        self.breaker.allow(now)  # half-open: this one is the probe
        self._connections.take(now)

    def send_wait(self, now: float) -> float:
        """Seconds until a message may be sent (0.0: now): the rate, and the cool-down
        after a throttle signal, which holds every connection of the destination."""
        self._apply(now)
        return max(self._messages.wait(now), self.learner.wait(now))

    def sent(self, now: float) -> None:
        self._messages.take(now)
        self.learner.sent(now)

    # -- feedback ----------------------------------------------------------------------

    def connect_failed(self, now: float) -> None:
        """No connection (refused, unreachable, timed out) and no `result` for it."""
        self.breaker.failure(now)
        self.concurrency.throttled()

    def hung(self, now: float) -> None:
        """The destination does not answer at all (after `result` for the timeout): one
        outage, the breaker open now; its queue waits for the probe."""
        self.breaker.trip(now)

    def result(self, now: float, reply: Reply, verdict: Verdict, active: int = 1) -> None:
        """What a connection or transaction got (one call per reply that settled mail);
        `active` counts the connections open to the destination, this one included: if
        it was refused as one too many, the others are what worked."""
        if verdict.outcome == DELIVERED and reply.code:  # not a lost reply taken as delivered
            before = self.concurrency.limit
            if self.concurrency.success(now):
                self.slowdown.stepped_up(now, before, self.pace.rate)
            self.backoff.success(now)
            self.learner.delivered(now, self._rate_ceiling())
            self._answered(now)
        else:
            self._failed(now, reply, verdict, active)
        self._apply(now)

    def timed(self, now: float, samples: Iterable[tuple[str, float]], lag: float) -> Round | None:
        """Replies timed (policy/slowdown.py): the round they closed, if any."""
        return self.slowdown.timed(now, samples, lag)

    def react(self, now: float, closed: Round, ours: bool) -> None:
        """A latency round closed; `ours`: slowness of our own, nothing is cut for it."""
        self._apply(now)
        if self.slowdown.react(now, closed, ours, self.concurrency, self.pace):
            self._apply(now)

    def latency_changes(self) -> list[Slowed]:
        """Latency cuts, and steps back up after one, since the last call (for the log)."""
        return self.slowdown.changes()

    def probe(self, now: float) -> None:
        """An operator lifted what held the destination back (flush, unsuspend): one probe
        connection may go now, whatever the breaker's cooldown; pacing still applies."""
        self.breaker.probe(now)

    def retry_factor(self, now: float) -> float:
        """Stretch for the retry intervals of this destination's transient failures."""
        return self.backoff.retry_factor(now)

    def released(self, now: float, count: int, rng: random.Random) -> list[float]:
        """Start times for `count` waiting items after the breaker closed (or the
        destination came back): one in each of `count` equal slices of release_spread,
        at a random point of it, in order. The caller gives the first to its most urgent
        mail; pacing still applies when each comes due."""
        step = self.release_spread / max(count, 1)
        return [now + step * (i + rng.random()) for i in range(count)]

    # -- operator overrides --------------------------------------------------------------

    def override(
        self,
        now: float,
        *,
        rate_per_minute: float | None,
        concurrency: int | None,
        until: float | None,
    ) -> None:
        """Replace the runtime limits (mtaqueue-ctl limit): None keeps the configured value,
        a rate of 0 is no limit, `until` None lasts until replaced. Both None clears it.
        The concurrency is a ceiling (it may exceed max_connections); backoff still scales
        both."""
        if concurrency is not None and concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if rate_per_minute is not None and rate_per_minute < 0:
            raise ValueError("rate must not be negative")
        limited = rate_per_minute is not None or concurrency is not None
        self._override = _Override(rate_per_minute, concurrency, until) if limited else None
        self._apply(now)

    def force_backoff(self, now: float, until: float) -> None:
        """Backoff at the deepest stage until `until` (mtaqueue-ctl backoff); a time not
        after `now` ends any backoff, forced or signalled (back to normal)."""
        if until > now:
            self.backoff.force(until)
        else:
            self.backoff.clear()
        self._apply(now)

    def forget(self, now: float) -> None:
        """Learn the destination anew from the slow start (mtaqueue-ctl forget): its rate,
        the limit it taught, its connection cap, and the knee and rate ceiling its reply
        latency taught. Operator limits and backoff stay."""
        self.learner = RateLearner(now, start=self._start)
        self._messages = TokenBucket(self.pacing.messages_per_minute / 60, self.pacing.burst, now)
        self.concurrency.knee = 0
        self.pace.reset()
        self._apply(now)

    def state(self, now: float) -> ShaperState:
        self._apply(now)
        return ShaperState(self.breaker.state(now), self.backoff.mode(now), self.backoff.stage(now))

    def at_rest(self, now: float) -> bool:
        """Nothing to remember: normal mode, a closed circuit, no operator's limit. (The
        adaptive concurrency and the buckets start afresh harmlessly; the registry keeps
        what was learned, `learned()`.)"""
        state = self.state(now)
        return state.mode == "normal" and state.circuit == CLOSED and self._override is None

    def snapshot(self, now: float) -> dict:
        """The state for `mtaqueue-ctl domains`, JSON-ready."""
        self._apply(now)
        override = self._override
        return {
            "limit": self.concurrency.limit,
            "max": self.concurrency.maximum,
            "mode": self.backoff.mode(now),
            "stage": self.backoff.stage(now),
            "backoff_until": self.backoff.forced_until(now),
            "circuit": self.breaker.state(now),
            "reopen_at": self.breaker.reopen_at,
            "trips": self.breaker.trips,
            "blocked_by": self.blocked_by,
            "messages_per_minute": self._messages.rate * 60,
            "connections_per_minute": self._connections.rate * 60,
            "latency": self.slowdown.view(now, self.concurrency, self.pace),
            "learned": self._learned_view(now),
            "override": None
            if override is None
            else {
                "rate_per_minute": override.rate_per_minute,
                "concurrency": override.concurrency,
                "until": override.until,
            },
        }

    def learned(self, now: float) -> Learned:
        """What to remember across a restart."""
        return msgspec.structs.replace(
            self.learner.learned(),
            sessions=self.concurrency.knee,
            latency=self.slowdown.saved(now),
            paced=self.pace.rate,
        )

    def changes(self) -> list[Change]:
        """Learned limits that moved since the last call (`limit_learned`)."""
        return self.learner.changes()

    def probing(self, now: float) -> bool:
        """Whether the rate is being raised to find the destination's limit."""
        return self.learner.phase(now, self._rate_ceiling()) in (SLOW_STARTING, PROBING)

    def _learned_view(self, now: float) -> dict:
        learner = self.learner
        return {
            "rate_per_minute": learner.rate * 60,
            "good_per_minute": learner.good * 60 or None,
            "rate_reply": learner.rate_reply,
            "concurrency": learner.concurrency or None,
            "concurrency_reply": learner.concurrency_reply,
            "phase": learner.phase(now, self._rate_ceiling()),
            "probing": self.probing(now),
            "paused_until": learner.paused_until if learner.wait(now) else None,
        }

    # -- internals -----------------------------------------------------------------------

    def _room(self, active: int, reserved: int, first_class: bool) -> bool:
        """A slot for one more connection: under the limit, and for other than first-class
        work also under the share outside the reserve."""
        limit = self.concurrency.limit
        if first_class:
            return active < limit
        return active < limit and active - reserved < max(1, limit - self.pacing.reserved_p0)

    def _failed(self, now: float, reply: Reply, verdict: Verdict, active: int) -> None:
        rule_hit = self.rules.hit(reply.line(), now)
        if rule_hit:
            self.backoff.signal(now)  # the site's own rule asks for backoff mode
        if verdict.kind == AUTH:
            self.breaker.trip(now)
        elif verdict.kind in REFUSES_SOURCE:
            self.breaker.trip(now, self.sender_block_pause)
            self.blocked_by = reply.line()
        elif rule_hit or (verdict.kind == THROTTLING and verdict.scope != RECIPIENT):
            self._throttled(now, reply, active)
        elif _connection_failure(reply, verdict):
            self.connect_failed(now)
        elif reply.code:
            if verdict.kind == GREYLISTING:  # the site took our pace (anvil counts it too)
                self.learner.delivered(now, self._rate_ceiling())
            self._answered(now)

    def _throttled(self, now: float, reply: Reply, active: int) -> None:
        """Pacing, not a failure of the host: the breaker only hears of it from its probe.
        A refused connection teaches the concurrency, not the rate; it pauses all the
        same, since a strict site lists a client that goes on after any 421."""
        line = reply.line()
        too_many = _CONNECTIONS.search(reply.text) is not None and active > 1
        if too_many:
            self.learner.too_many_connections(active - 1, line)
        if self.learner.throttled(now, line, rate=not too_many):  # once an episode
            self.concurrency.throttled()
            # The site refilled its own allowance meanwhile, not for a burst at a rate it
            # just refused: sending resumes one message at a time (a burst also opened
            # connections past a cap nobody had learned yet).
            self._messages.resume_at(self.learner.paused_until)
        if self.breaker.state(now) == HALF_OPEN:
            self.breaker.failure(now)

    def _answered(self, now: float) -> None:
        """The site answered: a half-open breaker closes, and the ramp starts from 1."""
        probing = self.breaker.state(now) == HALF_OPEN
        self.breaker.success(now)
        if probing:
            self.concurrency.reset(1)
            self.blocked_by = None

    def _apply(self, now: float) -> None:
        """Bring the ceiling and the rates in line with the override and the backoff stage
        at `now` (both change with time alone)."""
        factor = self._cap(now)
        rate = self.learner.limit(self._rate_ceiling())
        if self.pace.rate:
            rate = min(rate, self.pace.rate)
        self._messages.set_rate(rate * factor, now)
        self._connections.set_rate(self.pacing.connections_per_minute / 60 * factor, now)

    def _cap(self, now: float) -> float:
        """The concurrency ceiling brought in line (as `_apply`); the backoff's rate factor."""
        override = self._override
        if override is not None and override.until is not None and now >= override.until:
            self._override = override = None
        ceiling = self.pacing.max_connections
        if self.learner.concurrency:
            ceiling = min(ceiling, self.learner.concurrency)
        if override is not None and override.concurrency is not None:
            ceiling = override.concurrency  # the operator knows better than what was learned
        factor = self.backoff.rate_factor(now)
        self.concurrency.cap(max(1, math.floor(ceiling * factor)))
        return factor

    def _rate_ceiling(self) -> float:
        """Messages a second the learned rate may not pass: an operator's, else the
        configured one; 0: none."""
        override = self._override
        if override is not None and override.rate_per_minute is not None:
            return override.rate_per_minute / 60
        return self.pacing.messages_per_minute / 60


def _connection_failure(reply: Reply, verdict: Verdict) -> bool:
    """A connection that could not be used, or a timeout: what trips the breaker."""
    if verdict.outcome == PERMANENT or reply.phase == "dns":
        return False
    return reply.network == "timeout" or PHASES.index(reply.phase) < _MAIL
