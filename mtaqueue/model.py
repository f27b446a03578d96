"""The queue's records: what we know about one message and its recipients.

Records are immutable (frozen) so that a snapshot of the queue is a shallow copy:
a state change replaces the whole `Message` (``msgspec.structs.replace``). The
spool journals them, the scheduler reads them, the control socket prints them.
"""

from __future__ import annotations

import msgspec

# Recipient states, as the contract names them.
QUEUED = "queued"
DEFERRED = "deferred"
DELIVERED = "delivered"
BOUNCED = "bounced"
EXPIRED = "expired"
HELD = "held"
RECIPIENT_STATES = (QUEUED, DEFERRED, DELIVERED, BOUNCED, EXPIRED, HELD)
FINAL_STATES = frozenset({DELIVERED, BOUNCED, EXPIRED})


MAX_HISTORY = 20  # attempts kept per recipient (the oldest are dropped)


class Attempt(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One delivery attempt of one recipient, for `mtaqueue-ctl show`."""

    time: float
    reply: str  # the reply line, or the network event
    mx: str | None = None
    outcome: str = ""  # delivered, transient, permanent, ambiguous
    kind: str = ""  # the reply's kind: greylisting, throttling, mailbox, ... (policy.classify)


class Recipient(msgspec.Struct, frozen=True, array_like=True, gc=False):
    address: str
    # RFC 3461 parameters as received: ORCPT is "addr-type;address" with the
    # xtext decoded, NOTIFY is "NEVER" or a comma list of SUCCESS/FAILURE/DELAY.
    orcpt: str | None = None
    notify: str | None = None
    state: str = QUEUED
    attempts: int = 0
    next_attempt: float | None = None
    last_reply: str | None = None  # "550 5.1.1 <a@b>: no such user", or a network error
    last_attempt: float | None = None
    remote_mta: str | None = None  # host that gave last_reply, for DSNs' Remote-MTA
    delay_notified: bool = False  # past dsn.delay_after: the one delay DSN (if wanted) and event
    history: tuple[Attempt, ...] = ()  # the last MAX_HISTORY attempts, oldest first


class Message(msgspec.Struct, frozen=True, array_like=True, gc=False):
    id: str
    sender: str  # "" is the null sender <>
    recipients: tuple[Recipient, ...]
    created: float  # epoch seconds, arrival time
    size: int  # bytes of the stored content
    klass: str  # delivery class (p0, p1, p2, ...); "class" in JSON
    expires: float | None = None  # absolute epoch seconds from X-Mtaqueue-Expires
    idempotency_key: str | None = None
    envid: str | None = None  # RFC 3461 ENVID, case kept
    ret: str | None = None  # RFC 3461 RET: FULL or HDRS
    body: str = "7BIT"  # 7BIT or 8BITMIME
    smtputf8: bool = False
    tenant: str | None = None  # authenticated user, if any
    client: str = ""  # submitting client's IP address
    helo: str = ""
    held: bool = False
