"""Connects in flight, and which of them no longer hold a global connection slot.

    Connecting(patience=PATIENCE, parked_per_slot=PARKED_PER_SLOT)
    .start(conn, now)                  a Connect went out (or out again, to the next host)
    .answered(conn)                    it opened or failed, or its slot ended
    .in_use(slots, limit, now) -> int  global slots taken: `slots` less those parked
    .parks_at(limit) -> float | None   when the next connect in flight would be parked
    .lame(since, now) -> bool          a connect unanswered past the patience

A connect with no answer (TCP, greeting, EHLO) after `patience` seconds is *lame*: its
destination may be one that accepts and never speaks, which holds the socket until the
banner timeout (5 minutes). A lame connect is parked: it keeps its socket but stops
counting against delivery.max_connections, so 100 hung destinations cannot take every
slot from the ones that answer. File descriptors are finite: at most `parked_per_slot`
times the global limit are parked; past that, lame connects count again. (How many a
destination may have lame is the admission's rule: one, scheduler/slots.py.)

Parking costs a slow site nothing: it is not a failure, only a count; the connect goes on
until it answers or times out. Sans I/O: `now` is passed in, and must not go back.
"""

from __future__ import annotations

# Seconds a connect may go unanswered before it is lame. Short: a lame connect is only
# counted differently (and its destination opens no other until it answers), while each
# round of hung destinations admitted in turn costs the others this long. On a LAN a
# greeting takes milliseconds; across the world a TCP and banner round trip is ~0.3 s.
PATIENCE = 0.25
# Parked connects allowed per global slot: 100 slots (the default) park up to 500, so a
# daemon at the limit holds up to 600 outbound sockets (README: RLIMIT_NOFILE).
PARKED_PER_SLOT = 5


class Connecting:
    def __init__(self, patience: float = PATIENCE, parked_per_slot: int = PARKED_PER_SLOT) -> None:
        self.patience = patience
        self.parked_per_slot = parked_per_slot
        self._fresh: dict[int, float] = {}  # conn -> since, oldest first; not lame yet
        self._parked: set[int] = set()  # lame, still unanswered

    def start(self, conn: int, now: float) -> None:
        self.answered(conn)
        self._fresh[conn] = now

    def answered(self, conn: int) -> None:
        self._fresh.pop(conn, None)
        self._parked.discard(conn)

    def lame(self, since: float, now: float) -> bool:
        return now - since >= self.patience

    def in_use(self, slots: int, limit: int, now: float) -> int:
        """Of `slots` (every slot, parked ones too), those that count against `limit`."""
        fresh = self._fresh
        while fresh:
            conn, since = next(iter(fresh.items()))
            if not self.lame(since, now):
                break
            del fresh[conn]
            self._parked.add(conn)
        return slots - min(len(self._parked), limit * self.parked_per_slot)

    def parks_at(self, limit: int) -> float | None:
        """When the oldest connect still counted would be parked (None: none would)."""
        if not self._fresh or len(self._parked) >= limit * self.parked_per_slot:
            return None
        return next(iter(self._fresh.values())) + self.patience

    @property
    def parked(self) -> int:
        return len(self._parked)
