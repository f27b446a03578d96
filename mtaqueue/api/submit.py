"""POST /v1/messages: a JSON submission made into what an SMTP transaction gives (an
envelope and the content), then into a queue record by the same code as SMTP's
(`submission.prepare`: X-Mtaqueue-* headers, Received, Message-ID, Date). The envelope
gets the listener's address checks, the content the listener's limits. Pure; no I/O.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from dataclasses import dataclass
from email.policy import SMTP, SMTPUTF8, Policy

import msgspec

from ..model import Message, Recipient
from ..smtp import content as content_
from ..smtp.addresses import AddressError, check_mailbox
from ..smtp.session_settings import SessionSettings, content_limits
from ..submission import MAX_KEY_LENGTH, Received, Refused, SubmissionSettings, prepare
from ..transaction import Envelope, Submit
from .compose import Part, compose
from .errors import ApiError, reply_text
from .rules import (
    ADDRESS_PATTERN,
    ADDRESS_RULE,
    COMPOSED,
    FIELD_NAME_PATTERN,
    KEY_PATTERN,
    MAX_ADDRESS_FIELD,
    MIME_TYPE_PATTERN,
    NOT_BLANK_PATTERN,
    OURS,
    TEXT_PATTERN,
    TEXT_RULE,
    WHITESPACE,
    base64_text,
    caseless,
    rfc3339,
    seconds,
)

_KEY = re.compile(KEY_PATTERN)
_ADDRESS = re.compile(ADDRESS_PATTERN)
_TEXT = re.compile(TEXT_PATTERN)
_NOT_BLANK = re.compile(NOT_BLANK_PATTERN)
_FIELD_NAME = re.compile(FIELD_NAME_PATTERN)
_MIME_TYPE = re.compile(MIME_TYPE_PATTERN)
_OURS, _COMPOSED = re.compile(caseless(OURS)), re.compile(caseless(COMPOSED))


class Attachment(msgspec.Struct, forbid_unknown_fields=True):
    filename: str
    content: str  # base64
    content_type: str = ""  # "" = guessed from the file name
    content_id: str = ""  # set: an inline part the HTML refers to as cid:...


class Submission(
    msgspec.Struct, forbid_unknown_fields=True, rename={"sender": "from", "klass": "class"}
):
    sender: str  # "addr" or "Name <addr>"
    to: list[str]
    raw: str | None = None
    subject: str | None = None
    text: str | None = None
    html: str | None = None
    attachments: list[Attachment] = []
    klass: str | None = None
    expires: str | int | float | None = None  # RFC 3339 time, duration, or seconds
    headers: dict[str, str] = {}


_decoder = msgspec.json.Decoder(Submission)


def decode(body: bytes) -> Submission:
    """The request body, or ApiError 400 naming the field (msgspec's `$.to[0]`)."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ApiError(400, str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None


@dataclass(frozen=True, slots=True)
class Checked:
    """A submission whose envelope and fields passed: ready to be built (`build`)."""

    submission: Submission
    sender: tuple[str, str]  # display name, mailbox
    to: list[tuple[str, str]]
    utf8: bool  # an address is not ASCII: the message needs SMTPUTF8
    key: str | None
    expires: float | None  # epoch seconds
    past: bool  # expires is a time already past


def check(
    sub: Submission,
    key: str | None,
    session: SessionSettings,
    settings: SubmissionSettings,
    now: float,
) -> Checked:
    """What the listener checks at MAIL and RCPT, and the fields that steer the message;
    ApiError 400 naming the field. Pure (a large submission is checked in a thread); what
    depends on the moment is `refuse_now`'s."""
    sender = parse_address("from", sub.sender)
    if not sub.to:
        raise ApiError(400, "to: at least one recipient")
    if len(sub.to) > session.max_recipients:
        raise ApiError(400, f"to: more than {session.max_recipients} recipients")
    to = [parse_address(f"to[{i}]", rcpt) for i, rcpt in enumerate(sub.to)]
    _check_content(sub)
    if sub.klass is not None and sub.klass not in settings.classes:
        known = ", ".join(settings.classes)
        raise ApiError(400, f"class: unknown class {sub.klass!r} (known: {known})")
    expires, past = (None, False) if sub.expires is None else expiry(sub.expires, now)
    if key is not None:
        check_key(key)
    utf8 = not all(mailbox.isascii() for _, mailbox in [sender, *to])
    return Checked(sub, sender, to, utf8, key, expires, past)


def refuse_now(checked: Checked, rcpt_check: Callable[[str], str | None]) -> None:
    """ApiError 422 for what the schema cannot say, as it depends on the moment: a
    suppressed recipient (`rcpt_check`: the listener's RCPT refusal), a time already past."""
    for i, (_, mailbox) in enumerate(checked.to):
        refusal = rcpt_check(mailbox)
        if refusal is not None:
            raise ApiError(422, f"to[{i}]: {reply_text(refusal)}")
    if checked.past:
        raise ApiError(422, f"expires: {checked.submission.expires!r} is already past")


def expiry(value: str | float, now: float) -> tuple[float, bool]:
    """Epoch seconds of "expires" (seconds or a duration from `now`, or an RFC 3339 time:
    rules.expires_schema), and whether it is a time already past; ApiError 400 if it is
    none of them."""
    delay = seconds(value)
    if delay is not None:
        return now + delay, False  # more than 0: to come, however little
    at = rfc3339(value) if isinstance(value, str) else None
    if at is None:
        raise ApiError(
            400,
            f"expires: {value!r} is no RFC 3339 time (2026-12-01T10:00:00Z), duration (2h)"
            " or number of seconds from now",
        )
    return at, at <= now


def check_key(key: str) -> None:
    """ApiError 400 unless `key` (an Idempotency-Key header, as HTTP gives it: without
    the spaces and tabs around it) is one the OpenAPI document allows."""
    if not key or key.isspace():  # given, so meant: not taken as no key at all
        raise ApiError(400, "Idempotency-Key: empty (give a key, or leave the header out)")
    if len(key) > MAX_KEY_LENGTH:
        raise ApiError(400, f"Idempotency-Key: longer than {MAX_KEY_LENGTH} characters")
    try:
        key.encode()
    except UnicodeEncodeError:  # the header's bytes were not UTF-8 (surrogate-escaped)
        raise ApiError(400, "Idempotency-Key: not valid UTF-8") from None
    if not _KEY.fullmatch(key):
        raise ApiError(400, "Idempotency-Key: a control character, or a space at either end")


def _check_content(sub: Submission) -> None:
    """raw, or the parts to compose, and the header fields to add."""
    composing = [f for f in ("subject", "text", "html") if getattr(sub, f) is not None]
    if sub.raw is not None and (composing or sub.attachments):
        raise ApiError(400, "raw: give either raw or subject with text/html, not both")
    if sub.raw is None:
        if sub.subject is None:
            raise ApiError(400, "subject: required (or give raw)")
        if sub.text is None and sub.html is None:
            raise ApiError(400, "text: give text, html or both (or raw)")
    elif not _NOT_BLANK.search(sub.raw):  # not strip(): a copy of a large message
        raise ApiError(400, "raw: empty")
    if sub.subject is not None:
        _check_text("subject", sub.subject)
    for i, attachment in enumerate(sub.attachments):
        _check_text(f"attachments[{i}].filename", attachment.filename)
        _check_text(f"attachments[{i}].content_id", attachment.content_id)
        if not _MIME_TYPE.fullmatch(attachment.content_type):
            raise ApiError(400, f"attachments[{i}].content_type: not a MIME type (type/subtype)")
        if base64_text(attachment.content) is None:
            raise ApiError(400, f"attachments[{i}].content: not base64")
    for name, value in sub.headers.items():
        if not _FIELD_NAME.fullmatch(name):
            raise ApiError(400, f"headers: {name!r} is not a header field name")
        if _OURS.fullmatch(name) or (sub.raw is None and _COMPOSED.fullmatch(name)):
            raise ApiError(400, f"headers.{name}: set by the request's own fields")
        _check_text(f"headers.{name}", value)


def _check_text(field: str, text: str) -> None:
    if not _TEXT.fullmatch(text):
        raise ApiError(400, f"{field}: a line break or control character ({TEXT_RULE})")


def _header_fields(headers: dict[str, str], policy: Policy) -> bytes:
    """The fields, folded: RFC 2047 encoded words for non-ASCII text, unless the message
    is SMTPUTF8's."""
    fields = []
    for name, value in headers.items():
        try:
            fields.append(policy.header_factory(name, value).fold(policy=policy).encode())
        except UnicodeEncodeError:
            raise
        except Exception as exc:  # a structured field's parser: IndexError on Reply-To: <
            raise ApiError(400, f"headers.{name}: not a {name} field the email package reads"
                           f" ({type(exc).__name__})") from None  # fmt: skip
    return b"".join(fields)


def build(
    checked: Checked,
    tenant: str | None,
    received: Received,
    session: SessionSettings,
    settings: SubmissionSettings,
) -> tuple[Message, bytes]:
    """The queue record and the content to store (CPU only: a large message is built in
    a thread); ApiError 400 or 413."""
    sub = checked.submission
    policy = SMTPUTF8 if checked.utf8 else SMTP
    field = "raw" if sub.raw is not None else "message"
    try:
        extra = _header_fields(sub.headers, policy)
        given = sub.raw.encode() if sub.raw is not None else _composed(checked)
    except UnicodeEncodeError:  # JSON may escape a lone surrogate, which UTF-8 cannot carry
        raise ApiError(400, f"{field}: a lone surrogate (\\ud800-\\udfff)") from None
    except ValueError as exc:  # what the email package refuses to compose
        raise ApiError(400, f"{field}: cannot be composed: {exc}") from None
    content, refusal = content_.whole(extra + given, content_limits(session))
    if refusal is not None:
        status = 413 if refusal == content_.TOO_BIG else 400
        raise ApiError(status, f"{field}: {reply_text(refusal)}")
    header = content[: content.find(b"\r\n\r\n") + 2] if b"\r\n\r\n" in content else content
    envelope = Envelope(
        sender=checked.sender[1],
        recipients=[Recipient(mailbox) for _, mailbox in checked.to],
        body="7BIT" if content.isascii() else "8BITMIME",
        smtputf8=checked.utf8 or not header.isascii(),  # RFC 6532 header fields
    )
    submit = Submit(envelope, content, helo="", esmtp=True, user=tenant)
    try:
        message, stored = prepare(submit, received, settings)
    except Refused as exc:
        raise ApiError(400, f"{field}: {reply_text(str(exc))}") from None
    steering = {}
    if sub.klass is not None:
        steering["klass"] = sub.klass
    if checked.expires is not None:
        steering["expires"] = checked.expires
    if checked.key is not None:
        steering["idempotency_key"] = checked.key
    return msgspec.structs.replace(message, **steering), stored


def _composed(checked: Checked) -> bytes:
    sub = checked.submission
    parts = []
    for attachment in sub.attachments:
        data = base64.b64decode(base64_text(attachment.content) or "")  # checked: not None
        kind, cid = attachment.content_type, attachment.content_id
        parts.append(Part(attachment.filename, data, kind, cid))
    assert sub.subject is not None  # check() saw to it
    return compose(checked.sender, checked.to, sub.subject, sub.text, sub.html, parts, checked.utf8)


def parse_address(field: str, text: str) -> tuple[str, str]:
    """(display name, mailbox) of "addr" or "Name <addr>" (rules.ADDRESS_PATTERN, and the
    octets of the address); ApiError 400 if not valid."""
    if len(text) > MAX_ADDRESS_FIELD:
        raise ApiError(400, f"{field}: longer than {MAX_ADDRESS_FIELD} characters")
    try:
        text.encode()
    except UnicodeEncodeError:  # JSON may escape a lone surrogate
        raise ApiError(400, f"{field}: not valid UTF-8 (a lone surrogate)") from None
    display, mailbox = "", text.strip(WHITESPACE)
    if mailbox.endswith(">") and "<" in mailbox:
        at = mailbox.rindex("<")
        name, mailbox = mailbox[:at].strip(WHITESPACE), mailbox[at + 1 : -1].strip(WHITESPACE)
        if not _TEXT.fullmatch(name):
            raise ApiError(400, f"{field}: a line break or control character in the name")
        display = name.strip('"').strip(WHITESPACE)
    try:
        check_mailbox(mailbox, utf8=True)
    except AddressError as exc:
        raise ApiError(400, f"{field}: {text!r} is not a valid address: {exc}") from None
    if not _ADDRESS.fullmatch(text):  # the characters of an address that is not ASCII
        raise ApiError(400, f"{field}: {text!r} is longer than the API takes: {ADDRESS_RULE}")
    return display, mailbox
