"""Journal records, and the queue state that replaying them rebuilds.

Every record carries whole values, never deltas: a Put is the complete current
`Message`. Applying a record twice, or re-applying a half-written snapshot of the
state it came from, therefore changes nothing, which is what makes replay after
a crash (even one in the middle of a compaction) simple.
"""

from __future__ import annotations

import msgspec

from mtaqueue.model import Message


class Put(msgspec.Struct, tag=0, array_like=True, frozen=True, gc=False):
    """The full current record of a message: written at acceptance and on every change."""

    message: Message


class Delete(msgspec.Struct, tag=1, array_like=True, frozen=True, gc=False):
    id: str
    reason: str


class KeyKept(msgspec.Struct, tag=2, array_like=True, frozen=True, gc=False):
    """An idempotency key whose message is gone but whose dedupe window may still be open.

    Only snapshots write it: outside them the key is carried by the message's Puts.
    """

    key: str
    id: str
    created: float


class SnapshotDone(msgspec.Struct, tag=3, array_like=True, frozen=True, gc=False):
    """The records before this one in its segment are a complete snapshot of the state."""


class Suppress(msgspec.Struct, tag=4, array_like=True, frozen=True, gc=False):
    """An address on the suppression list until `until` (epoch seconds)."""

    address: str
    until: float
    reason: str


class Unsuppress(msgspec.Struct, tag=5, array_like=True, frozen=True, gc=False):
    address: str


Record = Put | Delete | KeyKept | SnapshotDone | Suppress | Unsuppress


class JournalState:
    """Live messages by queue id, and idempotency keys (key -> (queue id, created)).

    Keys outlive their messages until `forget_keys_before` drops them, so whoever
    checks a key must still compare its `created` with the dedupe window.

    `deleted` holds the tombstones: messages whose Delete was read, by id (-> reason).
    Recovery re-adopts a message file the journal does not know, so a Delete may be
    forgotten only once its file is gone for good; until the writer has made sure of
    that (`SpoolWriter._bury`), snapshots carry the Delete.
    """

    def __init__(self) -> None:
        self.messages: dict[str, Message] = {}
        self.keys: dict[str, tuple[str, float]] = {}
        self.suppressed: dict[str, Suppress] = {}  # address (lower case) -> entry
        self.deleted: dict[str, str] = {}

    def apply(self, rec: Record) -> None:
        if type(rec) is Put:
            message = rec.message
            self.messages[message.id] = message
            self.deleted.pop(message.id, None)
            if message.idempotency_key is not None:
                self._keep(message.idempotency_key, message.id, message.created)
        elif type(rec) is Delete:
            self.messages.pop(rec.id, None)
            self.deleted[rec.id] = rec.reason
        elif type(rec) is KeyKept:
            self._keep(rec.key, rec.id, rec.created)
        elif type(rec) is Suppress:
            self.suppressed[rec.address] = rec
        elif type(rec) is Unsuppress:
            self.suppressed.pop(rec.address, None)

    def _keep(self, key: str, queue_id: str, created: float) -> None:
        # Once a window has passed, the same key may be accepted again as a new
        # message. A later update of the older message must not take the key back,
        # so the newest message holding a key keeps it, whatever the record order.
        held = self.keys.get(key)
        if held is None or (created, queue_id) >= (held[1], held[0]):
            self.keys[key] = (queue_id, created)

    def forget_keys_before(self, t: float) -> None:
        """Drop keys created before t (their dedupe window has closed).

        Not journaled by itself: until the next compaction a replay brings such keys
        back, and the key of a still-live message always comes back with its Put.
        """
        self.keys = {k: v for k, v in self.keys.items() if v[1] >= t}

    def forget_suppressions_before(self, t: float) -> None:
        """Drop suppressions that ended before t (replay may bring them back, as above)."""
        self.suppressed = {a: e for a, e in self.suppressed.items() if e.until >= t}

    def snapshot(self) -> list[Record]:
        records: list[Record] = [Put(m) for m in self.messages.values()]
        for key, (queue_id, created) in self.keys.items():
            live = self.messages.get(queue_id)
            # A live message's Put brings its key back; any other key needs a record.
            if live is None or live.idempotency_key != key or live.created != created:
                records.append(KeyKept(key, queue_id, created))
        records.extend(self.suppressed.values())
        records.extend(Delete(queue_id, reason) for queue_id, reason in self.deleted.items())
        records.append(SnapshotDone())
        return records
