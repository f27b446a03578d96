"""The message rate one destination's reply latency allows (sans-IO): a ceiling found as TCP
Vegas finds its window.

    PaceCap(rate=0.0, now=0.0)
    .rate                      messages a second it may be sent at; 0.0: no ceiling
    .binds(accepted) -> bool   the ceiling, not the sessions, is what holds `accepted` back
    .cut(now, accepted) -> bool    replies over the baseline at a steady pace: under what it
                                   took (not again within SETTLE); whether it cut
    .grow(now) -> bool         a calm round at the ceiling: one step up, unless held
    .step_back(now, accepted)  that step made the site slower: back, and held there
    .reset()   .raised_at

A site that minds the message rate, not the sessions, answers more slowly past a rate it does
not announce; more sessions bring it more mail and slower replies, fewer sessions the same mail
(Little's law: what it takes is its rate). The learned rate (policy/rate_learner.py) is for
sites that refuse: it probes up to the refusal and lives just under it, where this site is
already slowed. Latency speaks earlier, so this ceiling is held with a margin under where the
replies began to stretch: a cut takes BETA of what the site accepted, a calm round at the
ceiling steps it up by GROW, and a step that makes the replies stretch again goes back (to
BETA of what the site accepted then, if less) and is held for HOLD (doubled up to HOLD_MAX
each time the same level is found, within SAME). A site counts the rate over a window of its
own: what a change did shows only seconds later, so a step up waits STEP after the last
change, and a cut is not repeated within SETTLE (the replies stay stretched for a while).
"""

from __future__ import annotations

BETA = 0.85  # of what was accepted while the replies stretched
GROW = 1.1  # a step up, per calm round at the ceiling
USED = 0.8  # of the ceiling accepted: the ceiling is what binds
STEP = 5.0  # seconds between changes before a step up
SETTLE = 5.0  # seconds after a cut before another one
HOLD = 120.0  # seconds at a level before the next step up
HOLD_MAX = 1800.0
SAME = 0.05  # a level found again within this share is the same one
MIN_RATE = 1 / 60  # one a minute: a ceiling never stops a destination


class PaceCap:
    def __init__(self, rate: float = 0.0, now: float = 0.0) -> None:
        """`rate`: a ceiling learned before (0.0: none), held for HOLD from `now`."""
        self.rate = rate
        self.raised_at: float | None = None  # when the last step up was taken
        self._from = 0.0  # the level before it
        self._knee = 0.0  # the level the last step back went to
        self._held_until = now + HOLD if rate else 0.0
        self._changed = now if rate else -STEP  # the last cut or step
        self._hold = HOLD

    def binds(self, accepted: float) -> bool:
        return bool(self.rate) and accepted >= USED * self.rate

    def cut(self, now: float, accepted: float) -> bool:
        """The replies stretched at a steady pace of `accepted` messages a second: whether
        it cut (not within SETTLE of the last cut or step)."""
        if self.rate and now < self._changed + SETTLE:
            return False
        top = min(accepted, self.rate) if self.rate else accepted
        self.rate = max(MIN_RATE, BETA * top)
        self.raised_at, self._changed = None, now
        return True

    def grow(self, now: float) -> bool:
        """A calm round while the ceiling binds: one step up, if not held; whether it grew."""
        if not self.rate or now < max(self._held_until, self._changed + STEP):
            return False
        self._from, self.rate = self.rate, self.rate * GROW
        self.raised_at = self._changed = now
        return True

    def step_back(self, now: float, accepted: float) -> None:
        """The last step up stretched the replies, at `accepted` messages a second: back to
        where they were calm (BETA of `accepted`, if less), held."""
        if self.raised_at is None:
            return
        back = min(self._from, max(MIN_RATE, BETA * accepted))
        same = abs(back - self._knee) <= SAME * self._knee
        self._hold = min(2 * self._hold, HOLD_MAX) if same else HOLD
        self.rate = self._knee = back
        self.raised_at, self._changed = None, now
        self._held_until = now + self._hold

    def reset(self) -> None:
        """Forget the ceiling (an operator's `forget`)."""
        self.rate, self.raised_at, self._knee = 0.0, None, 0.0
        self._hold, self._held_until = HOLD, 0.0
