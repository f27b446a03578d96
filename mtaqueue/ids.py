"""Queue ids: unique, and sorting as text sorts them by arrival time.

An id is 16 upper-case hex digits: 13 of microseconds since the epoch, then 3 of
a sequence that makes ids taken in the same microsecond (or after the clock
stepped back) distinct. Two processes issue ids (the daemon, and the listener's process
for mail submitted over SMTP), each in a lane of its own: the sequence's lowest bit is
the lane, so the two can never issue the same id, and a counter is enough in each.
"""

from __future__ import annotations

import time

ID_LENGTH = 16
_SEQ_BITS = 12


LANES = 2  # DAEMON_LANE, LISTENER_LANE
DAEMON_LANE = 0
LISTENER_LANE = 1


class IdGenerator:
    def __init__(self, lane: int = DAEMON_LANE) -> None:
        self.lane = lane
        self._last = 0  # last issued value, microseconds << _SEQ_BITS | seq

    def next(self, now: float | None = None) -> str:
        usec = int((time.time() if now is None else now) * 1_000_000)
        value = max(usec << _SEQ_BITS, self._last + 1)
        value += (self.lane - value) % LANES  # up to the next value in our lane
        self._last = value
        return f"{value:016X}"

    def advance_past(self, queue_id: str) -> None:
        """Never issue an id at or below one already in the spool (clock stepped back)."""
        self._last = max(self._last, int(queue_id, 16))


def id_time(queue_id: str) -> float:
    """Arrival time (epoch seconds) encoded in a queue id."""
    return (int(queue_id, 16) >> _SEQ_BITS) / 1_000_000


def is_queue_id(text: str) -> bool:
    return len(text) == ID_LENGTH and all(c in "0123456789ABCDEF" for c in text)
