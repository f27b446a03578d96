"""Settle a delivery attempt onto a message record (pure).

Input: the message as it is now, what the attempt got for some of its recipients
(a `Reply` and its `Verdict` each), the time, a random source and the settings.
Output: the new record, and what must follow from it — notices (DSNs) to send,
addresses to suppress, one log event per recipient. The caller does the I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import msgspec

from ..dsn import RecipientReport, wants_notice
from ..model import (
    BOUNCED,
    DEFERRED,
    DELIVERED,
    EXPIRED,
    FINAL_STATES,
    HELD_AT_EXPIRY,
    HELD_BY_SENDER_BLOCK,
    MAX_HISTORY,
    Attempt,
    Message,
    Recipient,
    with_hold,
)
from .backoff import RetryPolicy, expires_before, expiry, next_attempt
from .replies import Reply
from .verdict import (
    ABOUT_US,
    GREYLISTING,
    PERMANENT,
    RECIPIENT,
    THROTTLING,
    TRANSIENT,
    Verdict,
)

# Times in a row a message refused by its destination's throttle goes back to the ready
# queue uncharged; the next refusal is an attempt (the retry schedule, expiry), so that a
# site that refuses one message for ever cannot hold it without a trace.
THROTTLE_REQUEUES = 5


@dataclass(frozen=True, slots=True)
class SettleSettings:
    retry: RetryPolicy
    lifetime: float  # of the message's class
    expire_action: str  # bounce, discard, hold or notify
    delay_after: float
    delay_without_notify: bool
    on_sender_block: str = "defer"  # a reply about our sending: defer, hold or bounce


@dataclass(frozen=True, slots=True)
class Result:
    """What one recipient got in an attempt."""

    index: int  # into message.recipients
    reply: Reply
    verdict: Verdict
    remote_mta: str | None  # the MX host that answered, if any
    ip: str | None = None
    dsn_relayed: bool = False  # delivered to a server that does not pass DSNs on


@dataclass(slots=True)
class Settlement:
    message: Message
    failed: list[RecipientReport] = field(default_factory=list)  # for a failure DSN
    delayed: list[RecipientReport] = field(default_factory=list)
    succeeded: list[RecipientReport] = field(default_factory=list)  # "relayed" notices
    suppress: list[tuple[str, str]] = field(default_factory=list)  # (address, reason)
    events: list[dict] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        """Every recipient is final: the message can leave the queue."""
        return all(r.state in FINAL_STATES for r in self.message.recipients)


def settle(
    message: Message,
    results: list[Result],
    now: float,
    rng: random.Random,
    settings: SettleSettings,
    *,
    retry_factor: float = 1.0,
) -> Settlement:
    """`retry_factor` stretches retry intervals (a destination in backoff mode)."""
    recipients = list(message.recipients)
    out = Settlement(message)
    expires_at = expiry(message.created, settings.lifetime, message.expires)
    for result in results:
        old = recipients[result.index]
        verdict, reply = _about_us(result, settings, out, now), result.reply
        attempts = old.attempts + 1
        attempt = Attempt(now, reply.line(), result.remote_mta, verdict.outcome, verdict.kind)
        common = {
            "attempts": attempts,
            "last_reply": reply.line(),
            "last_attempt": now,
            "remote_mta": result.remote_mta or old.remote_mta,
            "next_attempt": None,
            "history": (*old.history, attempt)[-MAX_HISTORY:],
        }
        if verdict.outcome == "delivered":
            new = msgspec.structs.replace(old, state=DELIVERED, **common)
            if result.dsn_relayed and wants_notice(message, new, "relayed"):
                out.succeeded.append(_report(new, "relayed", verdict.status or "2.0.0", now))
        elif verdict.outcome == "permanent":
            new = msgspec.structs.replace(old, state=BOUNCED, **common)
            if verdict.suppress:
                out.suppress.append((old.address, reply.line()))
            if wants_notice(message, new, "failed"):
                out.failed.append(_report(new, "failed", verdict.status or "5.0.0", now))
        else:  # transient, or ambiguous under the "retry" policy
            due = next_attempt(
                settings.retry,
                _failures(old, verdict, attempts),
                now,
                rng,
                kind=verdict.kind,
                retry_after=verdict.retry_after,
            )
            due = now + (due - now) * retry_factor
            new = msgspec.structs.replace(old, state=DEFERRED, **(common | {"next_attempt": due}))
            if expires_before(due, expires_at):
                new = _expire(message, new, verdict.status, now, settings, out)
        recipients[result.index] = new
        out.events.append(_event(message, new, result, attempts, now))

    out.message = msgspec.structs.replace(out.message, recipients=tuple(recipients))
    statuses = {r.index: r.verdict.status for r in results if r.verdict.status}
    _delay_notices(out, now, settings, statuses)
    return out


def _failures(old: Recipient, verdict: Verdict, attempts: int) -> int:
    """The failures that place the next retry on the schedule. Greylisting counts only
    its own run: a greylisted first contact after an outage (attempts spent on a host that
    was down) comes back when the window ends, not at the outage's next step; a site that
    greylists again and again still climbs the schedule."""
    if verdict.kind != GREYLISTING:
        return attempts
    run = 1
    for attempt in reversed(old.history):
        if attempt.kind != GREYLISTING:
            break
        run += 1
    return run


def _about_us(result: Result, settings: SettleSettings, out: Settlement, now: float) -> Verdict:
    """A reply about our sending (ABOUT_US) is transient: the class's on_sender_block says
    whether it stays so ("defer"), holds the message for an operator ("hold") or becomes
    a bounce ("bounce": never suppressed, the recipient did nothing wrong)."""
    verdict = result.verdict
    if verdict.kind not in ABOUT_US or verdict.outcome != TRANSIENT:
        return verdict
    if settings.on_sender_block == "bounce":
        status = "5" + verdict.status[1:] if verdict.status else "5.7.1"
        return msgspec.structs.replace(verdict, outcome=PERMANENT, suppress=False, status=status)
    if settings.on_sender_block == "hold" and not out.message.held:
        out.message = with_hold(out.message, HELD_BY_SENDER_BLOCK, now)
        event = {"event": "sender_block_held", "id": out.message.id, "kind": verdict.kind}
        out.events.append(event | {"reply": result.reply.line()})
    return verdict


def throttle_refused(results: list[Result], refusals: int) -> tuple[list[Result], list[Result]]:
    """Split an attempt's results into (those of recipients to put back in the
    destination's ready queue, uncharged; those to settle). A site's throttle reply
    (421 4.7.28, "too much mail", a 421 greeting "too many connections": classify's
    throttling of the site, not a mailbox's) refused our pace, not the message: it goes
    again when the cool-down ends and the learned rate allows (KumoMTA's re-insert to the
    ready queue), unless it was refused `refusals` >= THROTTLE_REQUEUES times in a row
    already. Greylisting is not throttling: it keeps its retry (the greylist window)."""
    if refusals >= THROTTLE_REQUEUES:
        return [], results
    back = [r for r in results if _site_throttle(r.verdict)]
    return back, [r for r in results if not _site_throttle(r.verdict)]


def _site_throttle(verdict: Verdict) -> bool:
    return (
        verdict.outcome == TRANSIENT and verdict.kind == THROTTLING and verdict.scope != RECIPIENT
    )


def flushed(rcpt: Recipient, now: float, greylist_min: float) -> Recipient:
    """A deferred recipient made due by an operator (mtaqueue-ctl flush): now, but not
    before the greylist window of a greylisted last attempt, which would only be
    greylisted again."""
    if rcpt.state != DEFERRED:
        return rcpt
    due = now
    if rcpt.history and rcpt.history[-1].kind == "greylisting":
        due = max(now, rcpt.history[-1].time + greylist_min)
    return msgspec.structs.replace(rcpt, next_attempt=due)


def expire_due(message: Message, now: float, settings: SettleSettings) -> Settlement | None:
    """Expire the pending recipients of a message whose lifetime has passed.

    Checked periodically for every message, whatever its state: mail that waits on a
    suspended destination or a long retry still expires on time.
    """
    if message.held or now < expiry(message.created, settings.lifetime, message.expires):
        return None
    out = Settlement(message)
    recipients = list(message.recipients)
    for i, rcpt in enumerate(recipients):
        if rcpt.state not in FINAL_STATES:
            recipients[i] = _expire(message, rcpt, "", now, settings, out)
    out.message = msgspec.structs.replace(out.message, recipients=tuple(recipients))
    return out


def bounce_now(message: Message, now: float, reason: str) -> Settlement:
    """Fail every pending recipient at once (mtaqueue-ctl bounce): a failure DSN that
    carries the last real reply when there was one, else the operator's reason."""
    out = Settlement(message)
    recipients = list(message.recipients)
    for i, rcpt in enumerate(recipients):
        if rcpt.state in FINAL_STATES:
            continue
        failed = msgspec.structs.replace(
            rcpt, state=BOUNCED, next_attempt=None, last_reply=rcpt.last_reply or reason
        )
        recipients[i] = failed
        if wants_notice(message, failed, "failed"):
            out.failed.append(
                _report(failed, "failed", _status_of(rcpt.last_reply) or "5.0.0", now)
            )
        out.events.append({"event": "bounced_by_operator", "id": message.id, "rcpt": rcpt.address})
    out.message = msgspec.structs.replace(message, recipients=tuple(recipients))
    return out


def _expire(
    message: Message,
    rcpt: Recipient,
    status: str,
    now: float,
    settings: SettleSettings,
    out: Settlement,
) -> Recipient:
    if settings.expire_action == "hold":  # for review (mtaqueue-ctl review)
        out.message = with_hold(out.message, HELD_AT_EXPIRY, now)
        out.events.append(
            {
                "event": "expired_held",
                "id": message.id,
                "rcpt": rcpt.address,
                "action": "hold",
                "last_reply": rcpt.last_reply,
            }
        )
        return msgspec.structs.replace(rcpt, next_attempt=None)
    expired = msgspec.structs.replace(rcpt, state=EXPIRED, next_attempt=None)
    # Only "bounce" tells the sender. "discard" and "notify" send nothing: the "expired"
    # event (its action says which) is the record, and for "notify" the application's
    # cue to compensate (the events' webhook carries it).
    if settings.expire_action == "bounce" and wants_notice(message, expired, "failed"):
        # The DSN carries the last real reply; 4.4.7 only when there was none.
        status = status or _status_of(rcpt.last_reply) or "4.4.7"
        out.failed.append(_report(expired, "failed", status, now))
    out.events.append(
        {
            "event": "expired",
            "id": message.id,
            "rcpt": rcpt.address,
            "action": settings.expire_action,
            "last_reply": rcpt.last_reply,
        }
    )
    return expired


def _delay_notices(
    out: Settlement, now: float, settings: SettleSettings, statuses: dict[int, str]
) -> None:
    """One "delayed" notice per recipient still deferred after dsn.delay_after.

    `statuses`: the classified status of this attempt's replies (a transient 552 5.2.2
    reports 4.2.2), preferred over the code in the stored reply line.
    """
    message = out.message
    if now - message.created < settings.delay_after:
        return
    expires_at = expiry(message.created, settings.lifetime, message.expires)
    recipients = list(message.recipients)
    for i, rcpt in enumerate(recipients):
        if rcpt.state != DEFERRED or rcpt.delay_notified:
            continue
        # The moment passes once, notice or not: the application's "delayed" event.
        recipients[i] = msgspec.structs.replace(rcpt, delay_notified=True)
        if not wants_notice(
            message, rcpt, "delayed", delay_without_notify=settings.delay_without_notify
        ):
            continue
        status = statuses.get(i) or _transient(_status_of(rcpt.last_reply)) or "4.0.0"
        out.delayed.append(_report(rcpt, "delayed", status, now, retry_until=expires_at))
    out.message = msgspec.structs.replace(out.message, recipients=tuple(recipients))


def _report(
    rcpt: Recipient, action: str, status: str, now: float, retry_until: float | None = None
) -> RecipientReport:
    return RecipientReport(
        recipient=rcpt,
        action=action,
        status=status,
        # A server's reply, or our own words for what happened (connection refused, no
        # SMTPUTF8 at the hop, bounced by the operator): a DSN always says why.
        diagnostic=rcpt.last_reply,
        remote_mta=rcpt.remote_mta,
        last_attempt=rcpt.last_attempt,
        will_retry_until=retry_until,
    )


def _status_of(reply: str | None) -> str:
    """The enhanced status code in a reply line ("550 5.1.1 ..." -> "5.1.1"; a network
    event's "4.4.1 connection refused ..." -> "4.4.1"), or ""."""
    parts = (reply or "").split(" ", 2)
    for part in parts[:2]:
        if part[:1] in "245" and part.count(".") == 2:
            return part
    return ""


def _transient(status: str) -> str:
    """The status as a delay reports it: class 4 (a 5.2.2 that is being retried is 4.2.2)."""
    return "4" + status[1:] if status else ""


def _event(message: Message, rcpt: Recipient, result: Result, attempt: int, now: float) -> dict:
    reply, verdict = result.reply, result.verdict
    return {
        "event": "delivery",
        "id": message.id,
        "rcpt": rcpt.address,
        "domain": rcpt.address.rpartition("@")[2].lower(),
        "mx": result.remote_mta,
        "ip": result.ip,
        "phase": reply.phase,
        "code": reply.code,
        "enhanced": reply.enhanced,
        "text": reply.text,
        "network": reply.network or None,
        "outcome": verdict.outcome,
        "kind": verdict.kind,
        "state": rcpt.state,
        "attempt": attempt,
        "age": round(now - message.created, 3),
        "next_attempt": rcpt.next_attempt,
    }
