"""Stress mode of the submission listener: who gives way when the slots run out (sans-IO).

    Stress(max_connections, enter=ENTER, leave=LEAVE)
    .update(open_sessions) -> "entered" | "left" | None   the mode, with hysteresis
    .active: bool
    SessionView(key, client, quiet, in_data)
    shed(sessions, newcomer) -> key | None      the session to close for a newcomer

Below ENTER of `max_connections` nothing changes. At or above it the listener is under
stress (Postfix's `stress` parameter; it leaves under LEAVE, so that one session coming
and going does not flap): command deadlines shrink to `listen.stress_command_timeout`,
and sessions that make no progress give way. A newcomer that finds every slot taken gets
one whatever its address (a leaking connection pool in `mynetworks` must not lock out
every other client): the session closed for it is the quietest of the address that holds
the most slots. For a newcomer from that address itself (or one holding as many), only a
session quiet for at least QUIET_MIN qualifies (no completed command, no message data, for
that long; a slowloris client trickling a line a byte at a time is quiet), so that a
client does not push out its own working sessions. A session in the middle of DATA is
never chosen: DATA has its own rate floor
(`listen.min_data_rate`), and a message on its way at a normal rate is what the listener
is for. When no session qualifies, the newcomer is refused as before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

ENTER = 0.8  # of max_connections: stress begins
LEAVE = 0.7  # and ends under this
QUIET_MIN = 1.0  # seconds without progress before a session may be shed for a newcomer


@dataclass(frozen=True, slots=True)
class SessionView:
    key: Hashable  # the listener's handle on the session
    client: str  # its address
    quiet: float  # seconds since its last progress (a completed command, DATA bytes)
    in_data: bool


class Stress:
    def __init__(self, max_connections: int, enter: float = ENTER, leave: float = LEAVE) -> None:
        self.max_connections = max_connections
        self.enter, self.leave = enter, leave
        self.active = False

    def update(self, open_sessions: int) -> str | None:
        """The mode for `open_sessions`; "entered" or "left" when it changed."""
        if not self.active and open_sessions >= self.enter * self.max_connections:
            self.active = True
            return "entered"
        if self.active and open_sessions < self.leave * self.max_connections:
            self.active = False
            return "left"
        return None


def shed(
    sessions: Sequence[SessionView], newcomer: str, quiet_min: float = QUIET_MIN
) -> Hashable | None:
    """The session to close so that a newcomer from `newcomer` gets a slot; None: nobody
    may give way. The address holding the most slots gives way, its quietest session
    first. To an address that holds fewer slots than that, any of its sessions not in DATA
    gives way (a flood that reconnects keeps its sessions young); to its own newcomers, or
    one holding as many, only a session quiet for `quiet_min`."""
    slots = Counter(s.client for s in sessions)
    if not slots:
        return None
    busiest = max(slots.values())
    least = 0.0 if slots[newcomer] < busiest else quiet_min
    quiet = [s for s in sessions if not s.in_data and s.quiet >= least]
    return min(quiet, key=lambda s: (-slots[s.client], -s.quiet)).key if quiet else None
