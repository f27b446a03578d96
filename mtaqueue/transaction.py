"""A received mail transaction: `Envelope`, and `Submit` / `Stream`, which carry it on.

`Envelope` is what MAIL and RCPT (or an HTTP submission) said: the sender, the
recipients and the RFC 3461 / 6152 / 6531 options. `Submit` is a transaction with its
message held whole; `Stream` one whose message is too large to hold, begun with its
header. The SMTP server session asks the I/O layer with them to store the message
(`smtp.server_session`), and `submission.prepare` makes them into a queue record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .model import Recipient


@dataclass(slots=True)
class Envelope:
    sender: str = ""
    recipients: list[Recipient] = field(default_factory=list)
    body: str = "7BIT"
    smtputf8: bool = False
    envid: str | None = None
    ret: str | None = None


@dataclass(frozen=True, slots=True)
class Submit:
    """Commit this message; resume() with the reply line for the client."""

    envelope: Envelope
    content: bytes
    helo: str
    esmtp: bool
    user: str | None


@dataclass(frozen=True, slots=True)
class Stream:
    """The start of a message too large to hold: store its header and the content so far;
    the rest follows as `Write`s and a `Finish`. resume() with None to go on, or with the
    reply to give at the final dot if it cannot be stored (the rest is then read and
    dropped)."""

    envelope: Envelope
    header: bytes  # the header lines, up to the empty line that ends them
    data: bytes  # the content after them, so far
    helo: str
    esmtp: bool
    user: str | None
