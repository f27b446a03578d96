"""One event for the application, as it is stored in the event log and POSTed.

The fields every event has are always in the JSON (null when not known: `tenant` of mail
submitted without one); the others only where known. `id` is unique for the receiver's
dedupe: an event POSTed again after a restart has the same id. `seq` orders the events
of one spool (the order a receiver gets them in).
"""

from __future__ import annotations

import msgspec

ACCEPTED = "accepted"
DELIVERED = "delivered"
DEFERRED = "deferred"
DELAYED = "delayed"
BOUNCED = "bounced"
EXPIRED = "expired"
SUPPRESSED = "suppressed"
CANCELLED = "cancelled"
HELD = "held"


class Event(msgspec.Struct, frozen=True, omit_defaults=True, rename={"klass": "class"}):
    id: str
    seq: int
    type: str
    time: float  # epoch seconds
    message_id: str | None  # the queue id
    idempotency_key: str | None
    klass: str | None
    tenant: str | None
    recipient: str | None
    code: int | None = None  # of the reply that made the event
    enhanced: str | None = None
    text: str | None = None
    kind: str | None = None  # the reply's kind: mailbox, throttling, greylisting, ...
    cause: str | None = None  # bounced: why, in the application's terms (the kind, or operator)
    remote_host: str | None = None
    attempt: int | None = None  # attempts so far
    next_attempt: float | None = None
    action: str | None = None  # expired: the class's expiry action
    reason: str | None = None  # cancelled, held, suppressed: why


msgpack_encoder = msgspec.msgpack.Encoder()
msgpack_decoder = msgspec.msgpack.Decoder(Event)
