"""Journal records, and the queue state that replaying them rebuilds.

Every record carries whole values, never deltas: a Put is the complete current
`Message`. Applying a record twice, or re-applying a half-written snapshot of the
state it came from, therefore changes nothing, which is what makes replay after
a crash (even one in the middle of a compaction) simple.

The queue is held as the messages' msgpack encodings (`MessageMap`): a decoded
one-recipient `Message` costs about 860 bytes of memory, its encoding about 160, and
with a million queued messages both the daemon and the writer hold the queue. Replay
decodes of a Put only the few fields the state indexes (`Stored`), and a snapshot
writes the encodings back as they are.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import msgspec

from mtaqueue.model import Message
from mtaqueue.spool.expiring import Expiring
from mtaqueue.spool.key_index import KeyIndex


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


class Noted(msgspec.Struct, tag=6, array_like=True, frozen=True, gc=False):
    """A change and the events it made, in one frame: a crash keeps both or neither.

    `record` is the change's own payload (a Put, a Delete...: as it would be framed
    alone), or empty for events that change no state (an address refused at RCPT).
    The events, msgpack `Event`s numbered first_seq, first_seq + 1, ..., are also
    appended to the event log (event_log.py), from which they are sent; the journal's
    copy is what rebuilds the log's tail after a crash. Snapshots drop the wrapper.
    """

    first_seq: int
    events: list[bytes]
    record: bytes


class Buried(msgspec.Struct, tag=7, array_like=True, frozen=True, gc=False):
    """Deleted messages whose files are gone for good (`SpoolWriter._bury`): their
    tombstones may go. A replay then holds only the tombstones not yet buried, not one
    for every message deleted since the last snapshot."""

    ids: list[str]


class Continues(msgspec.Struct, tag=8, array_like=True, frozen=True, gc=False):
    """First in the segment a writer opens as it starts (when it does not compact): the
    messages live in the older segments all have ids up to `last_id`, so a Buried of
    a newer id needs no tombstone to drop it from them at replay (queue ids grow)."""

    last_id: str


class Unfiled(msgspec.Struct, tag=9, array_like=True, frozen=True, gc=False):
    """A message accepted without its file yet (writer.py: small mail that may leave
    before it needs one): its record as accepted and its content. Replayed as a Put
    that also holds the content, until a `Filed` names it or a Delete ends it."""

    message: msgspec.Raw  # the msgpack encoding of the Message
    content: bytes


class Filed(msgspec.Struct, tag=10, array_like=True, frozen=True, gc=False):
    """These messages' files are written and durable: the journal no longer holds the
    only copy of their content."""

    ids: list[str]


Record = (
    Put
    | Delete
    | KeyKept
    | SnapshotDone
    | Suppress
    | Unsuppress
    | Noted
    | Buried
    | Continues
    | Unfiled
    | Filed
)

# A Put's payload is [0, Message]: a fixarray of two, then tag 0, then the Message.
PUT_PREFIX = b"\x92\x00"


class Head(msgspec.Struct, array_like=True, gc=False):
    """The leading fields of an encoded Message, checked for their types; the
    recipients stay undecoded and the fields after the tenant are ignored (msgspec
    ignores an array's trailing elements)."""

    id: str
    sender: str
    recipients: msgspec.Raw
    created: float
    size: int
    klass: str
    expires: float | None = None
    idempotency_key: str | None = None
    envid: str | None = None
    ret: str | None = None
    body: str = "7BIT"
    smtputf8: bool = False
    tenant: str | None = None

    @property
    def dedupe_key(self) -> str | None:
        return dedupe_key(self.idempotency_key, self.tenant)


def dedupe_key(key: str | None, tenant: str | None) -> str | None:
    """What the idempotency index holds for a message's key: a key is its tenant's own, so
    two tenants' "order-42" are two messages (and neither learns the other's id)."""
    if key is None or tenant is None:
        return key
    # Only a submitter who may name any tenant (a header) can put a NUL in one and collide.
    return f"{tenant}\x00{key}"


class Stored(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A Put as replay reads it: the Message still encoded, and what the state indexes."""

    id: str
    key: str | None
    created: float
    data: bytes  # the msgpack encoding of the Message


_message_encoder = msgspec.msgpack.Encoder()
_message_decoder = msgspec.msgpack.Decoder(Message)
_head_decoder = msgspec.msgpack.Decoder(Head)
_record_decoder = msgspec.msgpack.Decoder(Record)


def stored(data: bytes) -> Stored:
    """A Stored of an encoded Message (raises msgspec.DecodeError if it is not one)."""
    head = _head_decoder.decode(data)
    return Stored(head.id, head.dedupe_key, head.created, data)


class MessageMap(Mapping[str, Message]):
    """Queued messages by id, held encoded and decoded on each read.

    Reads return a fresh `Message` (they are immutable, so nothing is shared); `in`,
    `len` and iterating the ids decode nothing. A whole walk (`values()`) decodes
    every message: a few microseconds each (seconds at a million: see spool/walk.py).
    """

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}

    def __getitem__(self, queue_id: str) -> Message:
        return _message_decoder.decode(self._data[queue_id])

    def get(self, queue_id: str, default: Message | None = None) -> Message | None:  # type: ignore[override]
        data = self._data.get(queue_id)
        return default if data is None else _message_decoder.decode(data)

    def head(self, queue_id: str) -> Head | None:
        """The leading fields (class, sender...) without the recipients decoded."""
        data = self._data.get(queue_id)
        return None if data is None else _head_decoder.decode(data)

    def __contains__(self, queue_id: object) -> bool:
        return queue_id in self._data

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def put(self, message: Message) -> None:
        self._data[message.id] = _message_encoder.encode(message)

    def put_encoded(self, queue_id: str, data: bytes) -> None:
        self._data[queue_id] = data

    def update(self, other: MessageMap) -> None:
        self._data.update(other._data)

    def pop(self, queue_id: str) -> None:
        self._data.pop(queue_id, None)

    def encoding(self, queue_id: str) -> bytes:
        return self._data[queue_id]

    def encoded(self) -> Iterator[bytes]:
        """The encoding of every message (the map must not change meanwhile)."""
        return iter(self._data.values())


def _until(entry: Suppress) -> float:
    return entry.until


def suppressions() -> Expiring[str, Suppress]:
    """Suppressions by address (lower case), forgotten once ended."""
    return Expiring(_until)


class JournalState:
    """Live messages by queue id, and idempotency keys (`dedupe_key` -> (queue id, created)).

    Keys outlive their messages until `forget_before` drops them, so whoever
    checks a key must still compare its `created` with the dedupe window.

    `deleted` holds the tombstones: messages whose Delete was read, by id (-> reason).
    Recovery re-adopts a message file the journal does not know, so a Delete may be
    forgotten only once its file is gone for good; until the writer has made sure of
    that (`SpoolWriter._bury`, which then journals a `Buried`), snapshots carry the Delete.

    `keys_after`: a replay keeps only the keys created since then (the dedupe window's
    start), so that it never holds the keys of every message since the last snapshot.

    `unfiled` holds, by id, the record as accepted and the content of each live message
    whose file is not written yet (an `Unfiled` not followed by its `Filed`): the journal
    is its only copy. Such a message needs no tombstone when it goes (it has no file).
    `filed` holds the ids a `Filed` named whose content this state does not hold: the
    older segments' (merged under it by `update`).
    """

    def __init__(self, noted_after: int | None = None, keys_after: float = 0.0) -> None:
        self.messages = MessageMap()
        # Events: the newest seq read, and (for the writer, rebuilding the event log's
        # tail) the encoded events numbered above `noted_after`, in order.
        self.last_event_seq = 0
        self.noted_after = noted_after
        self.noted: list[bytes] = []
        self.keys = KeyIndex()
        self.keys_after = keys_after
        # Ids up to which a message may be live in older segments, merged under this
        # state later (`update`): "" for none (it holds a snapshot, or the replay says
        # it is the oldest), None for any. A Buried drops the tombstones above it.
        self.older_ids: str | None = None
        self.suppressed = suppressions()  # address (lower case) -> entry
        self.deleted: dict[str, str] = {}
        self.unfiled: dict[str, tuple[bytes, bytes]] = {}  # id -> (accepted record, content)
        self.filed: set[str] = set()
        self._unsuppressed: set[str] = set()  # whose last record read is an Unsuppress

    def apply(self, rec: Record | Stored) -> None:
        if type(rec) is Stored:
            self._put(rec.id, rec.data, rec.key, rec.created)
        elif type(rec) is Put:
            message = rec.message
            data = _message_encoder.encode(message)
            key = dedupe_key(message.idempotency_key, message.tenant)
            self._put(message.id, data, key, message.created)
        elif type(rec) is Delete:
            self.messages.pop(rec.id)
            if self.unfiled.pop(rec.id, None) is None:
                self.deleted[rec.id] = rec.reason
        elif type(rec) is Unfiled:
            data = bytes(rec.message)
            head = _head_decoder.decode(data)
            self._put(head.id, data, head.dedupe_key, head.created)
            self.unfiled[head.id] = (data, rec.content)
        elif type(rec) is Filed:
            for queue_id in rec.ids:
                if self.unfiled.pop(queue_id, None) is None and self.older_ids != "":
                    self.filed.add(queue_id)
        elif type(rec) is KeyKept:
            if rec.created >= self.keys_after:
                self.keys.keep(rec.key, rec.id, rec.created)
        elif type(rec) is Suppress:
            self.suppressed[rec.address] = rec
            self._unsuppressed.discard(rec.address)
        elif type(rec) is Unsuppress:
            self.suppressed.pop(rec.address, None)
            self._unsuppressed.add(rec.address)
        elif type(rec) is Noted:
            self._noted(rec)
        elif type(rec) is Buried:
            self._buried(rec.ids)
        elif type(rec) is SnapshotDone:
            self.older_ids = ""
        elif type(rec) is Continues and self.older_ids != "":
            self.older_ids = rec.last_id

    def _noted(self, rec: Noted) -> None:
        if rec.record:
            self.apply_payload(memoryview(rec.record))
        last = rec.first_seq + len(rec.events) - 1
        self.last_event_seq = max(self.last_event_seq, last)
        if self.noted_after is not None and last > self.noted_after:
            self.noted.extend(rec.events[max(0, self.noted_after + 1 - rec.first_seq) :])

    def _buried(self, ids: list[str]) -> None:
        deleted, limit = self.deleted, self.older_ids
        for queue_id in ids:
            if limit is not None and queue_id > limit:
                deleted.pop(queue_id, None)
            else:  # the tombstone drops the message from the older segments when merged
                deleted[queue_id] = deleted.get(queue_id, "buried")

    def update(self, newer: JournalState) -> None:
        """Apply what the records of `newer` (a state replayed from records that came
        after this state's) left: as if they had been applied here one by one."""
        # In `newer` an id is in messages (last record a Put) or deleted, never both.
        self.messages.update(newer.messages)
        for queue_id in newer.messages:
            self.deleted.pop(queue_id, None)
        for queue_id, reason in newer.deleted.items():
            self.messages.pop(queue_id)
            self.deleted[queue_id] = reason
            self.unfiled.pop(queue_id, None)
        for queue_id in newer.filed:
            self.unfiled.pop(queue_id, None)
        self.unfiled.update(newer.unfiled)
        for key, (queue_id, created) in newer.keys.items():
            self.keys.keep(key, queue_id, created)
        self.suppressed.update(newer.suppressed)
        self._unsuppressed.difference_update(newer.suppressed)
        for address in newer._unsuppressed:
            self.suppressed.pop(address, None)
        self._unsuppressed |= newer._unsuppressed
        self.last_event_seq = max(self.last_event_seq, newer.last_event_seq)
        self.noted.extend(newer.noted)

    def apply_payload(self, payload: memoryview) -> bool:
        """Apply the record of a journal payload (raises msgspec.DecodeError); True if
        it is a SnapshotDone. A Put is kept as its Message's bytes, of which only the
        head is decoded (replay's hot path: a million of them at a large queue)."""
        if payload[:2] != PUT_PREFIX:
            rec = _record_decoder.decode(payload)
            self.apply(rec)
            return type(rec) is SnapshotDone
        data = bytes(payload[2:])
        head = _head_decoder.decode(data)
        self.messages.put_encoded(head.id, data)
        if self.deleted:
            self.deleted.pop(head.id, None)
        key = head.dedupe_key
        if key is not None and head.created >= self.keys_after:
            self.keys.keep(key, head.id, head.created)
        return False

    def _put(self, queue_id: str, data: bytes, key: str | None, created: float) -> None:
        self.messages.put_encoded(queue_id, data)
        self.deleted.pop(queue_id, None)
        if key is not None and created >= self.keys_after:
            self.keys.keep(key, queue_id, created)

    def forget_before(self, t: float, keys_before: float) -> None:
        """Drop suppressions that ended before t and keys created before `keys_before`
        (their dedupe window has closed).

        Not journaled by itself: until the next compaction a replay brings them back
        (and drops them again), and the key of a still-live message always comes back
        with its Put.
        """
        self.keys.forget_before(keys_before)
        self.suppressed.forget_before(t)

    def snapshot(self) -> Iterator[Record | Stored]:
        """The records of a snapshot of the state, one at a time (the state must not
        change meanwhile): the messages as they are held (only their heads decoded),
        then keys, suppressions, tombstones, SnapshotDone. The content of a message
        without its file yet goes with it, as its `Unfiled` (the Put after it brings
        its current record)."""
        messages = self.messages
        for accepted, content in self.unfiled.values():
            yield Unfiled(msgspec.Raw(accepted), content)
        yield from map(stored, messages.encoded())
        for key, (queue_id, created) in self.keys.items():
            # A live message's Put brings its key back; any other key needs a record.
            if queue_id in messages:
                head = _head_decoder.decode(messages.encoding(queue_id))
                if head.dedupe_key == key and head.created == created:
                    continue
            yield KeyKept(key, queue_id, created)
        yield from self.suppressed.values()
        yield from (Delete(queue_id, reason) for queue_id, reason in self.deleted.items())
        yield SnapshotDone()
