"""The active window: which messages are in play, and the mail waiting for room in it.

    ActiveWindow(chunk, limit=ACTIVE_LIMIT)   `chunk`: messages let through at once
    .busy[message_id]                 recipients routed, queued or in transit
    .occupy(id) -> set / .free(id, indexes) / .end(id)
    .room() -> int                    how many more messages may become active
    .admit(id) / .admitted            overdue at start, let in, not yet dispatched
    .line_up(ids, first) / .take()    due mail waiting for room, the first class apart
    .uncharged_wait(id) -> bool       an internal wait (once per attempt) goes uncharged
    .refusals(id) / .refused(id, n)   throttle refusals in a row, since the last attempt
    .attempted(id)                    an attempt: waits and refusals count from here
    .prune(live)                      forget the waits and refusals of mail gone
    .sizes() -> {name: entries}

Postfix's qmgr_message_active_limit: a flush of a million, or a million retries due at
once, must not all be routed and queued at destinations at once. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container

# Messages active at once (routed, queued at a destination or in transit) up to which the
# overdue mail found at start is let into the scheduler (Postfix: 20,000 as well).
ACTIVE_LIMIT = 20_000
UNCHARGED_WAITS = 1  # internal waits a message may have uncharged; a repeat is an attempt


class ActiveWindow:
    def __init__(self, chunk: int, limit: int = ACTIVE_LIMIT) -> None:
        self.limit, self.chunk = limit, chunk
        self.busy: dict[str, set[int]] = {}
        self.admitted: set[str] = set()
        # Due, waiting for room: the first class in its own line ahead of the rest.
        self._first: deque[str] = deque()
        self._rest: deque[str] = deque()
        self._waits: dict[str, int] = {}
        self._refusals: dict[str, int] = {}

    def room(self) -> int:
        return self.limit - len(self.busy) - len(self.admitted)

    def occupy(self, message_id: str) -> set[int]:
        """The message's busy recipients, to add to."""
        return self.busy.setdefault(message_id, set())

    def free(self, message_id: str, indexes: list[int]) -> None:
        busy = self.busy.get(message_id)
        if busy is not None:
            busy.difference_update(indexes)
            if not busy:  # not active: a deferred message must not hold a set (nor room)
                del self.busy[message_id]

    def end(self, message_id: str) -> None:
        """The message is done, deleted or bounced: nothing of it stays."""
        self.busy.pop(message_id, None)
        self.attempted(message_id)

    def admit(self, message_id: str) -> None:
        self.admitted.add(message_id)  # until dispatched

    def line_up(self, message_ids: list[str], first: set[str]) -> None:
        """Due mail that waits for room; `first`: those of the first class."""
        for message_id in message_ids:
            (self._first if message_id in first else self._rest).append(message_id)

    def waiting(self) -> bool:
        return bool(self._first or self._rest)

    def take(self) -> list[str]:
        """The next chunk of the line that fits in the room, the first class first."""
        room = min(self.chunk, self.room())
        line = self._first or self._rest
        return [line.popleft() for _ in range(min(max(room, 0), len(line)))]

    def uncharged_wait(self, message_id: str) -> bool:
        """Count an internal wait (every host suspended, an unexpected error): whether it
        may go uncharged. A repeat may not: a wait that can come back for ever would hold a
        message with no attempt and no reason until it expires."""
        waits = self._waits.get(message_id, 0) + 1
        self._waits[message_id] = waits
        return waits <= UNCHARGED_WAITS

    def refusals(self, message_id: str) -> int:
        return self._refusals.get(message_id, 0)

    def refused(self, message_id: str, count: int) -> None:
        self._refusals[message_id] = count

    def attempted(self, message_id: str) -> None:
        self._waits.pop(message_id, None)
        self._refusals.pop(message_id, None)

    def prune(self, live: Container[str]) -> None:
        """Forget the counts of messages not in `live` (the spool's): mail deleted or
        expired between an internal wait or a refusal and its next attempt."""
        self._waits = {i: n for i, n in self._waits.items() if i in live}
        self._refusals = {i: n for i, n in self._refusals.items() if i in live}

    def sizes(self) -> dict[str, int]:
        return {
            "active_messages": len(self.busy) + len(self.admitted),
            "active_waits": len(self._waits) + len(self._refusals),
        }
