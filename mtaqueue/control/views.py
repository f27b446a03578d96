"""What the control socket shows of the queue: plain data for JSON, no I/O.

The contract (`list --json`) fixes the field names; a held message shows its
pending recipients as ``held`` so that every view agrees with the list.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from mtaqueue.model import (
    FINAL_STATES,
    HELD,
    RECIPIENT_STATES,
    REVIEW_REASONS,
    Message,
    Recipient,
)


class Filters(msgspec.Struct, forbid_unknown_fields=True, rename={"klass": "class"}):
    """`list` filters; None means "any". All given filters must match."""

    klass: str | None = None
    state: str | None = None  # some recipient is in this state
    domain: str | None = None  # some recipient's domain, case-insensitive
    sender: str | None = None  # case-insensitive; "" or "<>" is the null sender
    held: bool | None = None
    review: bool | None = None  # held by mtaqueue for someone's decision (`in_review`)
    tenant: str | None = None
    ids: list[str] | None = None  # any of these queue ids
    older_than: float | None = None  # created more than this many seconds before `now`
    now: float = 0.0  # the time older_than counts from (set by the daemon)


def recipient_state(msg: Message, rcpt: Recipient) -> str:
    return HELD if msg.held and rcpt.state not in FINAL_STATES else rcpt.state


def message_json(msg: Message, waiting: dict[str, Any] | None = None) -> dict[str, Any]:
    """`waiting`: what the delivery side holds it back for while its record looks ready
    (DeliveryManager.waiting_for)."""
    return {
        "id": msg.id,
        "class": msg.klass,
        "sender": msg.sender,
        "created": msg.created,
        "size": msg.size,
        "held": msg.held,
        "held_reason": msg.held_reason if msg.held else None,
        "held_at": msg.held_at if msg.held else None,
        "expires": msg.expires,
        "tenant": msg.tenant,
        "envid": msg.envid,
        "ret": msg.ret,
        "idempotency_key": msg.idempotency_key,
        "client": msg.client,
        "helo": msg.helo,
        "body": msg.body,
        "smtputf8": msg.smtputf8,
        "recipients": [
            {
                "address": r.address,
                "state": recipient_state(msg, r),
                "attempts": r.attempts,
                "next_attempt": r.next_attempt,
                "last_reply": r.last_reply,
                "orcpt": r.orcpt,
                "notify": r.notify,
                "history": [
                    {"time": a.time, "reply": a.reply, "mx": a.mx, "outcome": a.outcome}
                    for a in r.history
                ],
            }
            for r in msg.recipients
        ],
        "waiting": waiting,
    }


def in_review(msg: Message) -> bool:
    """Held by mtaqueue itself, for someone to decide (model.REVIEW_REASONS): at expiry,
    when the application could not be asked, after an error of ours. An operator's hold
    is not: its owner is the operator who made it."""
    return msg.held and msg.held_reason in REVIEW_REASONS


def review_order(msg: Message) -> tuple[float, float, str]:
    """`mtaqueue-ctl review` lists what has waited longest first."""
    return (msg.held_at or msg.created, msg.created, msg.id)


def review_json(msg: Message, now: float) -> dict[str, Any]:
    """One entry of `mtaqueue-ctl review`: what a reviewer needs to decide, without
    `show`: why it is held, for how long, and per recipient its last reply and the
    cause (the kind of its last attempt, policy/classify.py: greylisting, mailbox...)."""
    since = msg.held_at or msg.created
    return {
        "id": msg.id,
        "class": msg.klass,
        "sender": msg.sender,
        "tenant": msg.tenant,
        "idempotency_key": msg.idempotency_key,
        "created": msg.created,
        "age": round(now - msg.created, 1),
        "reason": msg.held_reason,
        "held_at": msg.held_at,
        "waiting": round(now - since, 1),  # in review
        "recipients": [
            {
                "address": r.address,
                "state": recipient_state(msg, r),
                "attempts": r.attempts,
                "last_attempt": r.last_attempt,
                "last_reply": r.last_reply,
                "cause": r.history[-1].kind if r.history else None,
            }
            for r in msg.recipients
        ],
    }


class StatusTally:
    """`status`: messages and recipients counted one message at a time (a walk over a
    large queue yields to the event loop between messages)."""

    def __init__(self) -> None:
        self.count = 0
        # Every state, so scripts can rely on the keys.
        self.by_state = dict.fromkeys(RECIPIENT_STATES, 0)
        self.by_class: Counter[str] = Counter()

    def add(self, msg: Message) -> None:
        self.count += 1
        self.by_class[msg.klass] += 1
        for rcpt in msg.recipients:
            self.by_state[recipient_state(msg, rcpt)] += 1

    def json(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "messages": self.count,
            "recipients": sum(self.by_state.values()),
            "by_state": self.by_state,
            "by_class": dict(sorted(self.by_class.items())),
            **extra,
        }


def matches(msg: Message, filters: Filters) -> bool:
    if filters.ids is not None and msg.id not in filters.ids:
        return False
    if filters.klass is not None and msg.klass != filters.klass:
        return False
    if filters.older_than is not None and msg.created > filters.now - filters.older_than:
        return False
    if filters.tenant is not None and msg.tenant != filters.tenant:
        return False
    if filters.held is not None and msg.held != filters.held:
        return False
    if filters.review is not None and in_review(msg) != filters.review:
        return False
    if filters.sender is not None:
        sender = "" if filters.sender == "<>" else filters.sender
        if msg.sender.lower() != sender.lower():
            return False
    states = (recipient_state(msg, r) for r in msg.recipients)
    if filters.state is not None and filters.state not in states:
        return False
    if filters.domain is not None:
        domain = filters.domain.lower()
        return any(r.address.rpartition("@")[2].lower() == domain for r in msg.recipients)
    return True
