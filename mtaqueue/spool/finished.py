"""Messages that left the queue, remembered for a while by id: how each ended, and whose.

    finished = Finished(limit=KEEP)
    finished.add(queue_id, state, tenant); finished.get(queue_id) -> Ended | None
    end_state(reason, recipients) -> str   # cancelled, deleted, delivered, ...

The API tells a cancel of finished mail (409, with its state) from one of mail that
never was (404) by it. It is held in memory, the newest `limit` ends only: a restart,
or `limit` newer ends, forget a message, which is then a 404 like one never seen.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

from ..model import FINAL_STATES, Recipient

KEEP = 20_000  # ends remembered: about 5 MB at most (memory follows live state)
CANCELLED = "cancelled"  # by the application (API, revalidation)
DELETED = "deleted"  # by the operator, or its file lost or unreadable
FINISHED = "finished"  # recipients ended differently (one delivered, one bounced)
END_STATES = (CANCELLED, DELETED, "delivered", "bounced", "expired", FINISHED)
_DONE = "done"  # events.derive.DONE: every recipient final (not imported: no cycle)


class Ended(NamedTuple):
    """How a message that left the queue ended, and whose it was."""

    state: str
    tenant: str | None


class Finished:
    def __init__(self, limit: int = KEEP) -> None:
        self._limit = limit
        self._ended: OrderedDict[str, Ended] = OrderedDict()

    def add(self, queue_id: str, state: str, tenant: str | None) -> None:
        self._ended[queue_id] = Ended(state, tenant)
        self._ended.move_to_end(queue_id)
        while len(self._ended) > self._limit:
            self._ended.popitem(last=False)

    def get(self, queue_id: str) -> Ended | None:
        return self._ended.get(queue_id)

    def __len__(self) -> int:
        return len(self._ended)


def end_state(reason: str, recipients: Iterable[Recipient]) -> str:
    """A message's state at its end, from its Remove reason and its last recipients."""
    if reason != _DONE:
        # The application's cancels are journaled as "cancelled[ by ...]"; the rest
        # (the operator's delete, a lost or unreadable file) are deletions.
        return CANCELLED if reason.startswith(CANCELLED) else DELETED
    return recipients_state(recipients)


def recipients_state(recipients: Iterable[Recipient]) -> str:
    """The one final state every recipient is in, or FINISHED if they differ."""
    states = {r.state for r in recipients}
    if len(states) == 1 and states <= FINAL_STATES:
        return states.pop()
    return FINISHED
