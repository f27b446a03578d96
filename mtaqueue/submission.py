"""Turn a received transaction into a queue record (pure; no I/O).

Reads and removes our X-Mtaqueue-* submission headers, adds the trace header
(Received) and the Message-ID/Date an application forgot, and refuses with a
clear 5xx what cannot be queued (unknown class, bad expiry). Signing (DKIM) follows:
`dkim.service`.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from datetime import datetime
from email.utils import formatdate

from .header_fields import header_end, split_fields
from .model import Message
from .transaction import Stream, Submit

CLASS_HEADER = b"x-mtaqueue-class"
EXPIRES_HEADER = b"x-mtaqueue-expires"
KEY_HEADER = b"x-mtaqueue-idempotency-key"
_OURS = (CLASS_HEADER, EXPIRES_HEADER, KEY_HEADER)
MAX_KEY_LENGTH = 256
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\Z")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
# An expiry at most this many seconds ahead (about 3,000 years): further, a DSN's
# Will-Retry-Until or an event's time would be past the year 9999, which no datetime writes.
MAX_EXPIRY = 10**11


@dataclass(frozen=True, slots=True)
class SubmissionSettings:
    hostname: str
    classes: tuple[str, ...]
    default_class: str
    tenant_header: bytes = b""  # lower-case header name, or b"" for none


@dataclass(frozen=True, slots=True)
class Received:
    """Who handed us the message, for the trace header and the record."""

    queue_id: str
    now: float
    client: str
    tls: bool
    protocol: str = ""  # "" = SMTP, named from the session; else e.g. "HTTP"


class Refused(Exception):
    """The message cannot be queued; the message is the SMTP reply."""


def prepare(
    submit: Submit, received: Received, settings: SubmissionSettings
) -> tuple[Message, bytes]:
    """Return the queue record and the content to store, or raise Refused."""
    end = header_end(submit.content)
    body = submit.content[end:]  # from the empty line on
    message, header = prepare_header(submit, submit.content[:end], len(body), received, settings)
    return message, header + body


def prepare_header(
    submit: Submit | Stream,
    header: bytes,
    body_size: int,
    received: Received,
    settings: SubmissionSettings,
) -> tuple[Message, bytes]:
    """The queue record and the header to store, from the header as received (its lines
    up to the empty line), for a body of `body_size` octets; or raise Refused."""
    fields = split_fields(header)
    ours: dict[bytes, str] = {}
    kept: list[bytes] = []
    has_message_id = has_date = False
    ours_names = (*_OURS, settings.tenant_header) if settings.tenant_header else _OURS
    for name, raw in fields:
        if name in ours_names:
            value = raw.partition(b":")[2].replace(b"\r\n", b"")  # unfold
            try:
                ours[name] = value.decode("utf-8").strip()
            except UnicodeDecodeError:
                # Not "replace": two different keys (or tenants) must not become one.
                field = raw.partition(b":")[0].strip().decode("ascii", "replace")
                raise Refused(f"554 5.6.0 {field} is not valid UTF-8") from None
            continue
        has_message_id = has_message_id or name == b"message-id"
        has_date = has_date or name == b"date"
        kept.append(raw)

    klass = ours.get(CLASS_HEADER) or settings.default_class
    if klass not in settings.classes:
        known = ", ".join(settings.classes)
        raise Refused(f"554 5.6.0 Unknown class {klass!r} in X-Mtaqueue-Class (known: {known})")
    expires = None
    if EXPIRES_HEADER in ours:
        try:
            expires = parse_expiry(ours[EXPIRES_HEADER], received.now)
        except ValueError as exc:
            raise Refused(f"554 5.6.0 X-Mtaqueue-Expires {exc}") from None
    key = ours.get(KEY_HEADER) or None
    if key is not None and len(key) > MAX_KEY_LENGTH:
        raise Refused(f"554 5.6.0 X-Mtaqueue-Idempotency-Key longer than {MAX_KEY_LENGTH}")

    envelope = submit.envelope
    recipients = tuple(_unique(envelope.recipients))
    added = [_received(submit, received, settings.hostname, recipients)]
    if not has_message_id:
        added.append(f"Message-ID: <{received.queue_id}@{settings.hostname}>".encode())
    if not has_date:
        added.append(f"Date: {_date(int(received.now))}".encode())
    header = b"\r\n".join(added + kept) + b"\r\n"

    message = Message(
        id=received.queue_id,
        sender=envelope.sender,
        recipients=recipients,
        created=received.now,
        size=len(header) + body_size,
        klass=klass,
        expires=expires,
        idempotency_key=key,
        envid=envelope.envid,
        ret=envelope.ret,
        body=envelope.body,
        smtputf8=envelope.smtputf8,
        tenant=submit.user or ours.get(settings.tenant_header) or None,
        client=received.client,
        helo=submit.helo,
    )
    return message, header


def accepted_fields(message: Message, client: str) -> dict[str, object]:
    """The fields of the `accepted` log event (docs/logging.md), whichever way it came."""
    return {
        "id": message.id,
        "sender": message.sender,
        "recipients": len(message.recipients),
        "size": message.size,
        "cls": message.klass,
        "client": client,
        "tenant": message.tenant,
    }


def suppression_refusal(address: str, until: float, reason: str) -> str:
    """The RCPT TO refusal for a suppressed address, whichever way it came."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(until))
    reason = " ".join(reason.split())[:200]
    return f"550 5.1.1 <{address}>: suppressed until {when} ({reason})"


def parse_expiry(value: str, now: float) -> float:
    """Epoch seconds of an expiry given as a duration from `now` or an RFC 3339 time;
    ValueError says what is wrong, as a predicate ("is already past")."""
    match = _DURATION.match(value.strip())
    if match:
        at = now + float(match.group(1)) * _UNITS[match.group(2)]
    else:
        try:
            when = datetime.fromisoformat(value.strip())
        except ValueError:
            raise ValueError("must be an RFC 3339 time or a duration like 2h") from None
        if when.tzinfo is None:
            raise ValueError("needs a time zone (e.g. Z or +01:00)")
        at = when.timestamp()
    if at <= now:
        raise ValueError("is already past")
    if at - now > MAX_EXPIRY:
        raise ValueError(f"is too far ahead (at most {MAX_EXPIRY:.0e} seconds from now)")
    return at


def _received(submit: Submit | Stream, received: Received, hostname: str, rcpt: tuple) -> bytes:
    target = f"\r\n\tfor <{rcpt[0].address}>" if len(rcpt) == 1 else ""
    if received.protocol:  # no HELO: the client is its address alone
        origin, by = f"[{received.client}]", f"(mtaqueue via {received.protocol})"
        proto = received.protocol
    else:
        # RFC 3848 / RFC 6531 protocol names: ESMTP, ESMTPS, ESMTPSA, UTF8SMTPS, ...
        proto = "UTF8SMTP" if submit.envelope.smtputf8 else "ESMTP" if submit.esmtp else "SMTP"
        proto += ("S" if received.tls else "") + ("A" if submit.user else "")
        helo = submit.helo.replace("(", "").replace(")", "")
        origin, by = f"{helo} ([{received.client}])", "(mtaqueue)"
    text = (
        f"Received: from {origin}\r\n\tby {hostname} {by} with {proto}"
        f" id {received.queue_id}{target}; {_date(int(received.now))}"
    )
    return text.encode()  # every part is valid UTF-8: the session refuses anything else


@functools.lru_cache(maxsize=2)
def _date(second: int) -> str:
    """RFC 5322 date of a second, local time: made once a second, not once a message."""
    return formatdate(second, localtime=True)


def _unique(recipients):
    seen: set[str] = set()
    for rcpt in recipients:
        if rcpt.address not in seen:
            seen.add(rcpt.address)
            yield rcpt
