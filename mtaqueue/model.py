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
PENDING = (QUEUED, DEFERRED)  # still to be delivered

# Why a message is held (Message.held_reason). The operator's holds are the operator's to
# end; the others are mtaqueue's own, waiting for someone to decide: the review queue
# (mtaqueue-ctl review), which alerts watch so that it never waits without an owner.
HELD_BY_OPERATOR = "operator"  # mtaqueue-ctl hold (and "" in records older than the field)
HELD_AT_EXPIRY = "expired"  # its class's expire_action is "hold"
HELD_BY_REVALIDATION = "revalidation"  # the application could not be asked (on_error "hold")
HELD_BY_ERROR = "error"  # its record could not be settled (a bug): kept for an operator
HELD_BY_SENDER_BLOCK = "sender_block"  # a site refused our sending; on_sender_block "hold"
REVIEW_REASONS = frozenset(
    {HELD_AT_EXPIRY, HELD_BY_REVALIDATION, HELD_BY_ERROR, HELD_BY_SENDER_BLOCK}
)


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
    held_reason: str = ""  # while held: one of the HELD_* above ("" = an older record's hold)
    held_at: float | None = None  # while held: since when (epoch seconds)
    # A TLS-RPT report of ours (RFC 8460 3): delivered despite TLS failures (no MTA-STS
    # requirement), and its sessions are not counted in the next report.
    tls_report: bool = False


def with_hold(message: Message, reason: str, now: float) -> Message:
    """The message held for `reason` from `now`; one already held keeps its reason and time
    (an operator's hold of mail in review leaves it in review)."""
    if message.held:
        return message
    return msgspec.structs.replace(message, held=True, held_reason=reason, held_at=now)


def without_hold(message: Message) -> Message:
    return msgspec.structs.replace(message, held=False, held_reason="", held_at=None)
