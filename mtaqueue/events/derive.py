"""Which events a state change makes: pure, from the record before and after it.

The spool writer asks here for every change it journals, comparing the change with the
last record it journaled of the message: what the application hears is exactly what was
made durable, and a change shown in memory but not yet journaled (a bounce waiting for
its DSN) is told once it is.

`deferred` is told at a recipient's first deferral and again only when the reply's kind
changes (greylisting, then throttling): never once per retry.
"""

from __future__ import annotations

import re

from ..model import BOUNCED, DELIVERED, EXPIRED, FINAL_STATES, HELD_AT_EXPIRY, Message, Recipient
from . import event as ev
from .event import Event

DONE = "done"  # the Remove reason of a message whose recipients are all final
_REPLY = re.compile(r"([2-5][0-9][0-9])(?: ([245]\.[0-9]{1,3}\.[0-9]{1,3}))?(?: (.*))?", re.DOTALL)
OPERATOR_BOUNCE = "returned by the administrator"


def accepted(message: Message, now: float) -> list[Event]:
    return [_event(ev.ACCEPTED, message, r, now) for r in message.recipients]


def changed(
    before: Message, after: Message, now: float, expire_actions: dict[str, str]
) -> list[Event]:
    """The events of a new record of a queued message."""
    events = []
    olds = before.recipients
    for i, new in enumerate(after.recipients):
        old = olds[i] if i < len(olds) else new
        events.extend(_recipient(after, old, new, now, expire_actions))
    if after.held and not before.held:
        pending = [r for r in after.recipients if r.state not in FINAL_STATES]
        if after.held_reason == HELD_AT_EXPIRY:  # expiry with action hold: an expiry too
            events.extend(_replied(ev.EXPIRED, after, r, now, action="hold") for r in pending)
        # Why (model.HELD_*): "expired" and "revalidation" are the review queue's.
        reason = after.held_reason or "held"
        events.extend(_event(ev.HELD, after, r, now, reason=reason) for r in pending)
    return events


def removed(
    before: Message,
    final: Message | None,
    reason: str,
    now: float,
    expire_actions: dict[str, str],
) -> list[Event]:
    """The events of a message's end: what its last record shows (`final`, when it was
    not journaled itself), or a cancel of what was not final yet."""
    if reason == DONE:
        return changed(before, final, now, expire_actions) if final is not None else []
    return [
        _event(ev.CANCELLED, before, r, now, reason=reason)
        for r in before.recipients
        if r.state not in FINAL_STATES
    ]


def suppressed(address: str, reason: str, now: float, message: Message | None = None) -> Event:
    """An address added to the suppression list, or refused at RCPT (`message`: the
    transaction's sender, class and tenant as far as they are known)."""
    if message is None:
        return Event("", 0, ev.SUPPRESSED, now, None, None, None, None, address, reason=reason)
    rcpt = Recipient(address)
    return _event(ev.SUPPRESSED, message, rcpt, now, reason=reason, message_id=None)


def _recipient(
    message: Message, old: Recipient, new: Recipient, now: float, expire_actions: dict[str, str]
) -> list[Event]:
    if new.state != old.state and new.state in FINAL_STATES:
        if new.state == DELIVERED:
            return [_replied(ev.DELIVERED, message, new, now)]
        if new.state == BOUNCED:
            cause = "operator" if OPERATOR_BOUNCE in (new.last_reply or "") else _kind(new)
            return [_replied(ev.BOUNCED, message, new, now, cause=cause or "other")]
        if new.state == EXPIRED:
            action = expire_actions.get(message.klass, "bounce")
            return [_replied(ev.EXPIRED, message, new, now, action=action)]
    events = []
    if new.last_attempt != old.last_attempt and new.history and new.state not in FINAL_STATES:
        last = new.history[-1]
        earlier = [a.kind for a in old.history if a.outcome in ("transient", "ambiguous")]
        if last.outcome in ("transient", "ambiguous") and (not earlier or earlier[-1] != last.kind):
            events.append(_replied(ev.DEFERRED, message, new, now))
    if new.delay_notified and not old.delay_notified:
        events.append(_replied(ev.DELAYED, message, new, now))
    return events


def _kind(rcpt: Recipient) -> str:
    return rcpt.history[-1].kind if rcpt.history else ""


def _replied(type_: str, message: Message, rcpt: Recipient, now: float, **more) -> Event:
    """An event that reports the recipient's last reply."""
    code = enhanced = None
    text = rcpt.last_reply
    if text is not None and (m := _REPLY.fullmatch(text)):
        code, enhanced, text = int(m[1]), m[2], m[3]
    return _event(
        type_,
        message,
        rcpt,
        now,
        code=code,
        enhanced=enhanced,
        text=text,
        kind=_kind(rcpt) or None,
        remote_host=rcpt.remote_mta,
        attempt=rcpt.attempts,
        next_attempt=rcpt.next_attempt,
        **more,
    )


def _event(type_: str, message: Message, rcpt: Recipient, now: float, **more) -> Event:
    fields = {
        "message_id": message.id,
        "idempotency_key": message.idempotency_key,
        "klass": message.klass,
        "tenant": message.tenant,
        "recipient": rcpt.address,
    } | more
    return Event("", 0, type_, now, **fields)
