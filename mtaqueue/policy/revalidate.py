"""Revalidation before a late send (pure): whether a message must be checked with the
application before this attempt, and what its answer means.

Seed 004: when what a message says may no longer hold (the booking was cancelled, the
invoice paid), a late send must ask first. A class's `revalidate_after` says when mail is
late; `revalidate.url` is asked, and its answer decides: 2xx sends, 410 Gone cancels the
message, anything else (another status, no answer in time, a refused connection) follows
`revalidate.on_error`.

An answer that lets the message go ("send", also after an error under on_error "send")
holds for the attempt it came before, not for the message's life: for `PASS_VALID`. That
covers the dispatch that follows, the message's other recipients and destinations (each
recipient's retry has its own jitter, so those deferred by one attempt come due a little
apart: asking for each would ask for every recipient) and our short waits before an
attempt (every host suspended, an unexpected error: a minute). A retry comes at the
soonest after retry.schedule's first step (5 minutes by default) and hours later at the
end of it, and the application's state may change meanwhile: it asks again.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model import Message

SEND = "send"
CANCEL = "cancel"
HOLD = "hold"

# Seconds a "send" holds: longer than the jitter between recipients deferred together and
# than our own waits (RECOVER_AFTER), shorter than the default retry schedule's first step.
PASS_VALID = 60.0


def needs_check(
    message: Message, now: float, revalidate_after: float, passed_at: float | None
) -> bool:
    """Whether `message` must be checked before being attempted at `now`. `passed_at`: when
    the last answer that let it go came, if any.

    Our own notices (DSNs, from the null sender) are never checked: the application did
    not send them and has nothing to say about them.
    """
    if revalidate_after <= 0 or message.sender == "":
        return False
    if now - message.created < revalidate_after:
        return False
    return passed_at is None or pass_stale(passed_at, now)


def pass_stale(passed_at: float, now: float) -> bool:
    """Whether a go-ahead given at `passed_at` no longer holds."""
    return now - passed_at >= PASS_VALID


def request_body(message: Message, now: float) -> dict:
    """What the application is asked about (JSON): enough to find the message in its own
    state, nothing of the mail itself."""
    return {
        "message_id": message.id,
        "idempotency_key": message.idempotency_key,
        "class": message.klass,
        "tenant": message.tenant,
        "age": round(now - message.created, 3),
    }


@dataclass(frozen=True, slots=True)
class Answer:
    """What the endpoint said: an HTTP status, or why there was none."""

    status: int | None = None
    error: str = ""  # "timeout after 5s", "connection refused", ...

    @property
    def failed(self) -> bool:
        """Neither a go-ahead nor a cancel: on_error decides."""
        return not _ok(self.status) and self.status != 410


def decide(answer: Answer, on_error: str) -> str:
    """SEND, CANCEL or HOLD. Only 410 Gone cancels: a 404 is as likely a wrong URL as a
    message the application forgot, and cancelling mail for a typo is not recoverable;
    it follows on_error with the other failures."""
    if _ok(answer.status):
        return SEND
    if answer.status == 410:
        return CANCEL
    return HOLD if on_error == HOLD else SEND


def _ok(status: int | None) -> bool:
    return status is not None and 200 <= status < 300
