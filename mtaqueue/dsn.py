"""Delivery status notifications: whether the sender asked for one (RFC 3461) and the
notice itself, an RFC 3464 report in an RFC 6522 multipart/report.

Pure: `now` is passed in and nothing is read or written. `notice` gives the queue record of
a DSN with its content: the envelope is decided there, and only there.
"""

from __future__ import annotations

import ipaddress
import re
import textwrap
from datetime import UTC, datetime
from email.utils import format_datetime
from itertools import count

import msgspec

from .model import Message, Recipient

# Action -> the NOTIFY keyword that asks for it (RFC 3461 5.2).
_KEYWORD = {
    "failed": "FAILURE",
    "delayed": "DELAY",
    "delivered": "SUCCESS",
    "relayed": "SUCCESS",
    "expanded": "SUCCESS",
}
_STATUS = re.compile(r"[245]\.[0-9]{1,3}\.[0-9]{1,3}\Z")
_XTEXT_SPECIALS = "\\+="  # the printable ASCII that is not a QCHAR (RFC 6533 3)
_SMTP_REPLY = re.compile(r"[2-5][0-9][0-9](?:[ -]|\Z)")
_LINE = 78  # RFC 5322 2.1.1: lines SHOULD be at most 78 characters...
_MAX_LINE = 998  # ...and MUST be at most 998
_MAX_WORD = 900  # longer words are cut, so that even "Original-Envelope-Id: " + word fits


class RecipientReport(msgspec.Struct, frozen=True):
    """What one recipient's part of a DSN says."""

    recipient: Recipient
    action: str  # "failed", "delayed", "delivered", "relayed" or "expanded"
    status: str  # enhanced status code, e.g. "5.1.1" or "4.4.7"
    diagnostic: str | None = None  # the last real reply, e.g. "550 5.1.1 <a@b>: no such user"
    remote_mta: str | None = None  # the host that gave it
    last_attempt: float | None = None
    will_retry_until: float | None = None  # only reported for "delayed"


class DsnParams(msgspec.Struct, frozen=True):
    """What a DSN is made with, besides the message and the reports."""

    reporting_mta: str  # our name, in the report and its Message-ID
    now: float
    max_return: int  # the largest original returned whole (dsn.max_return)
    dsn_id: str  # the DSN's queue id


def wants_notice(
    message: Message, recipient: Recipient, action: str, *, delay_without_notify: bool = False
) -> bool:
    """Whether a DSN with `action` may be sent for `recipient` (RFC 3461 5.2)."""
    if action not in _KEYWORD:
        raise ValueError(f"unknown DSN action {action!r}")
    if not message.sender:
        return False  # never a bounce of a bounce (RFC 5321 4.5.5, 6.1)
    if recipient.notify is None:
        # No NOTIFY: failures always, delays at our option, successes never (5.2.2-5.2.6).
        return action == "failed" or (action == "delayed" and delay_without_notify)
    return _KEYWORD[action] in recipient.notify.upper().split(",")


def is_8bit(data: bytes) -> bool:
    """Whether `data` has octets above 127, so must be sent with BODY=8BITMIME (RFC 6152)."""
    return not data.isascii()


def notice(
    message: Message,
    reports: list[RecipientReport],
    original: bytes,
    params: DsnParams,
    *,
    klass: str,
    lifetime: float,
) -> tuple[Message, bytes]:
    """The DSN about `reports` as a message to queue, with its content (see `build_dsn`).

    Its envelope: from the null sender <>, so that no notice is ever sent about it (RFC 5321
    4.5.5); to the original sender alone; BODY=8BITMIME when the content is 8-bit and SMTPUTF8
    when the sender address is not ASCII (it appears in the To: field). Raises ValueError
    for a report that `wants_notice` forbids: any about a null-sender message, or for a
    recipient who did not ask for that action (NOTIFY=NEVER above all). Whether to send
    "delayed" without NOTIFY is the caller's option (dsn.delay_without_notify)."""
    for report in reports:
        rcpt = report.recipient
        if not wants_notice(message, rcpt, report.action, delay_without_notify=True):
            raise ValueError(f"no {report.action} notice may be sent about {rcpt.address}")
    content = build_dsn(message, reports, original, params)
    envelope = Message(
        id=params.dsn_id,
        sender="",
        recipients=(Recipient(message.sender),),
        created=params.now,
        size=len(content),
        klass=klass,
        expires=params.now + lifetime,
        body="8BITMIME" if is_8bit(content) else "7BIT",
        smtputf8=not message.sender.isascii(),
        client="",
        helo=params.reporting_mta,
    )
    return envelope, content


def build_dsn(
    message: Message,
    reports: list[RecipientReport],
    original: bytes,
    params: DsnParams,
) -> bytes:
    """The DSN about `reports` (recipients of `message`) as a complete message: CRLF lines of
    at most 998 octets. `original` is the stored content (CRLF lines), b"" if it is lost."""
    if not message.sender:
        raise ValueError("a DSN is never sent to the null sender")
    if not reports:
        raise ValueError("a DSN needs at least one recipient report")
    for report in reports:
        if report.action not in _KEYWORD:
            raise ValueError(f"unknown DSN action {report.action!r}")
        if not _STATUS.match(report.status):
            raise ValueError(f"invalid status code {report.status!r}")
    actions = {report.action for report in reports}
    returned_type, returned, note = _returned(
        message, original, "failed" in actions, params.max_return
    )
    text = _text(reports, params.reporting_mta, note)
    parts = [
        _part(
            ["Content-Type: text/plain; charset=utf-8", f"Content-Transfer-Encoding: {_cte(text)}"],
            text,
        ),
        _part(
            ["Content-Type: message/delivery-status", "Content-Transfer-Encoding: 7bit"],
            _crlf(_delivery_status(message, reports, params.reporting_mta)),
        ),
    ]
    if returned_type is not None:
        cte = f"Content-Transfer-Encoding: {_cte(returned)}"
        parts.append(_part([f"Content-Type: {returned_type}", cte], returned))
    boundary = _boundary(params.dsn_id, parts)
    body = b"".join(b"--%s\r\n%s\r\n" % (boundary, part) for part in parts)
    body += b"--%s--\r\n" % boundary

    header = [
        f"From: Mail Delivery System <MAILER-DAEMON@{params.reporting_mta}>",
        f"To: <{message.sender}>",
        f"Subject: {_subject(actions)}",
        f"Date: {_date(params.now)}",
        f"Message-ID: <{params.dsn_id}@{params.reporting_mta}>",
    ]
    if parent := _message_id(original):
        # RFC 3834 3.1.5: an automatic response names the message it answers.
        header += [f"In-Reply-To: {parent}", f"References: {parent}"]
    header += [
        "Auto-Submitted: auto-replied",  # RFC 3834: no auto-reply to this one
        "MIME-Version: 1.0",
        "Content-Type: multipart/report; report-type=delivery-status;",
        f'\tboundary="{boundary.decode()}"',
        f"Content-Transfer-Encoding: {_cte(body)}",
    ]
    # UTF-8 only with a UTF-8 sender (SMTPUTF8); octets that were not UTF-8 go back as received.
    return "\r\n".join(header).encode("utf-8", "surrogateescape") + b"\r\n\r\n" + body


def _returned(
    message: Message, original: bytes, failure: bool, max_return: int
) -> tuple[str | None, bytes, str]:
    """The third part: media type (None: no part), content, and a sentence about it.

    The full message only in a failure notice (RFC 3461 6.2), unless RET=HDRS, it is over
    max_return or 8BITMIME cannot carry it. A message with a UTF-8 header (RFC 6532) goes
    in the RFC 6533 types, message/global and message/global-headers.
    """
    header = _header(original)
    if not header or not _carriable(header):
        return None, b"", "The original message cannot be attached."
    utf8 = not header.isascii()
    if failure and message.ret != "HDRS":
        if len(original) > max_return:
            note = (
                f"The original message is {len(original)} bytes, more than the {max_return}"
                " we return; only its header is attached."
            )
        elif not _carriable(original):
            note = "The original message has lines that mail cannot carry as they are;"
            note += " only its header is attached."
        else:
            kind = "message/global" if utf8 else "message/rfc822"
            return kind, original, "The original message is attached."
    else:
        note = "The header of the original message is attached."
    return ("message/global-headers" if utf8 else "text/rfc822-headers"), header, note


def _header(content: bytes) -> bytes:
    """The header section of a message, with its last CRLF but not the blank line."""
    if content.startswith(b"\r\n"):
        return b""
    end = content.find(b"\r\n\r\n")
    return content if end < 0 else content[: end + 2]


def _carriable(data: bytes) -> bool:
    """Whether 8BITMIME can carry `data` as is: CRLF lines of at most 998 octets, no NUL."""
    lines = data.split(b"\r\n")
    return b"\0" not in data and all(
        len(line) <= _MAX_LINE and b"\r" not in line and b"\n" not in line for line in lines
    )


def _message_id(original: bytes) -> str | None:
    """The original's Message-ID, if it has a plain ASCII one."""
    match = re.search(
        rb"^message-id:\s*(<[\x21-\x3b\x3d\x3f-\x7e]{1,900}>)\s*$",
        _header(original),
        re.IGNORECASE | re.MULTILINE,
    )
    return match[1].decode() if match else None


def _subject(actions: set[str]) -> str:
    if "failed" in actions:
        return "Undelivered Mail Returned to Sender"
    if "delayed" in actions:
        return "Delayed Mail (still being retried)"
    if actions == {"relayed"}:
        return "Relayed Mail Delivery Report"
    return "Successful Mail Delivery Report"


_INTRO = {
    "failed": "Your message could not be delivered to the recipients below; we have stopped"
    " trying.",
    "delayed": "Your message has not been delivered yet to the recipients below. We are still"
    " trying; you do not need to send it again.",
    "delivered": "Your message was delivered to the recipients below.",
    "relayed": "Your message was passed on for the recipients below to mail systems that do"
    " not confirm delivery.",
    "expanded": "Your message was delivered to the recipients below, which forward it to"
    " further addresses.",
}
_OUTCOME = {
    "failed": "could not be delivered",
    "delayed": "not delivered yet",
    "delivered": "delivered",
    "relayed": "relayed",
    "expanded": "delivered and forwarded",
}


def _text(reports: list[RecipientReport], reporting_mta: str, note: str) -> bytes:
    """The part for people: what happened to each recipient and the last reply."""
    lines = [f"This is the mail system at {reporting_mta}.", ""]
    actions = {report.action for report in reports}
    for action in _KEYWORD:
        if action in actions:
            lines += [*_wrap(_INTRO[action]), ""]
    for report in reports:
        lines.append(f"<{report.recipient.address}>: {_OUTCOME[report.action]} ({report.status})")
        details: list[str] = []
        if reply := _reply_lines(report.diagnostic or ""):
            source = f"Reply from {report.remote_mta}" if report.remote_mta else "Reason"
            details += [f"{source}: {reply[0]}", *reply[1:]]
        if report.last_attempt is not None:
            details.append(f"Last attempt: {_date(report.last_attempt)}")
        if report.action == "delayed" and report.will_retry_until is not None:
            details.append(f"We will keep trying until {_date(report.will_retry_until)}.")
        for detail in details:
            lines += _wrap(detail, "    ", "      ")
        lines.append("")
    lines += _wrap(note)
    return _crlf(lines)


def _wrap(text: str, first: str = "", rest: str = "") -> list[str]:
    """`text` in lines of at most 78 characters (312 octets of UTF-8)."""
    return textwrap.wrap(
        text, _LINE, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False
    )


def _delivery_status(message: Message, reports: list[RecipientReport], mta: str) -> list[str]:
    """The message/delivery-status lines (RFC 3464 2.2-2.3, RFC 3461 6.3), 7-bit."""
    lines: list[str] = []
    if message.envid is not None:
        # Kept as given, case included; written decoded, not as xtext (RFC 3461 6.3 a).
        lines += _fold("Original-Envelope-Id", _seven_bit(message.envid))
    lines += _fold("Reporting-MTA", f"dns; {_seven_bit(mta)}")
    lines += _fold("Arrival-Date", _date(message.created))
    for report in reports:
        rcpt = report.recipient
        lines.append("")
        if rcpt.orcpt is not None:
            lines += _fold("Original-Recipient", _original_recipient(rcpt.orcpt))
        lines += _fold("Final-Recipient", _final_recipient(rcpt.address))
        lines += _fold("Action", report.action)
        lines += _fold("Status", report.status)
        if report.remote_mta:
            lines += _fold("Remote-MTA", f"dns; {_mta_name(report.remote_mta)}")
        if reply := _reply_lines(report.diagnostic or ""):
            kind = "smtp" if _SMTP_REPLY.match(reply[0]) else "X-mtaqueue"
            reply[0] = f"{kind}; {reply[0]}"
            lines += _fold("Diagnostic-Code", *map(_seven_bit, reply))
        if report.last_attempt is not None:
            lines += _fold("Last-Attempt-Date", _date(report.last_attempt))
        if report.action == "delayed" and report.will_retry_until is not None:
            lines += _fold("Will-Retry-Until", _date(report.will_retry_until))
    return lines


def _reply_lines(reply: str) -> list[str]:
    """The lines of a (possibly multi-line) reply, stripped, without empty ones."""
    return [line.strip() for line in reply.splitlines() if line.strip()]


def _original_recipient(orcpt: str) -> str:
    """ORCPT as received ("type;address", xtext decoded), 7-bit."""
    addr_type, _, address = orcpt.partition(";")
    if addr_type.lower() == "utf-8":
        # Already utf-8-addr-xtext or -unitext: only raw UTF-8 still needs escaping.
        return f"{addr_type};{_utf8_addr_xtext(address, keep=_XTEXT_SPECIALS)}"
    return f"{addr_type};{_seven_bit(address)}"


def _final_recipient(address: str) -> str:
    if address.isascii():
        return f"rfc822; {_seven_bit(address)}"
    return f"utf-8; {_utf8_addr_xtext(address)}"  # RFC 6533 3: the 7-bit form


def _utf8_addr_xtext(address: str, keep: str = "") -> str:
    """RFC 6533 utf-8-addr-xtext: each character that is not a QCHAR (printable ASCII but
    backslash, "+" and "=") nor in `keep` written as \\x{HEXPOINT}."""
    return "".join(
        c if ("!" <= c <= "~" and c not in _XTEXT_SPECIALS) or c in keep else f"\\x{{{ord(c):X}}}"
        for c in address
    )


def _mta_name(host: str) -> str:
    """A "dns" MTA name: a host name, or an address as a domain literal (RFC 3461 9.3)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return _seven_bit(host)
    return f"[IPv6:{ip}]" if ip.version == 6 else f"[{ip}]"


def _seven_bit(text: str) -> str:
    """`text` for a 7-bit field: anything but printable ASCII as xtext "+XX" escapes of its
    UTF-8 octets (RFC 3461 4), so nothing is lost and no CR or LF gets in."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(
        c if " " <= c <= "~" else "".join(f"+{b:02X}" for b in c.encode("utf-8", "surrogateescape"))
        for c in text
    )


def _fold(name: str, *lines: str) -> list[str]:
    """The field `name: lines` as header lines: folded at spaces to at most 78 characters
    where the words allow, each of `lines` after the first on a new line (a multi-line reply,
    RFC 3461 9.2), and every line at most 998 octets: a longer word is cut, which adds a space
    when unfolded. Unfolding gives back the lines joined with spaces."""
    head = f"{name}:"
    out = [head]
    for i, line in enumerate(lines):
        words = [
            word[k : k + _MAX_WORD]
            for word in line.split(" ")
            for k in range(0, len(word) or 1, _MAX_WORD)
        ]
        for j, word in enumerate(words):
            overflows = word and out[-1] != head and len(out[-1]) + 1 + len(word) > _LINE
            if overflows or (i > 0 and j == 0):
                out.append(f" {word}")
            else:
                out[-1] += f" {word}"
    return out


def _part(headers: list[str], body: bytes) -> bytes:
    return "\r\n".join(headers).encode("ascii") + b"\r\n\r\n" + body


def _crlf(lines: list[str]) -> bytes:
    # A lone surrogate (undecodable input) becomes "?" rather than invalid UTF-8.
    return "".join(f"{line}\r\n" for line in lines).encode("utf-8", "replace")


def _cte(data: bytes) -> str:
    return "8bit" if is_8bit(data) else "7bit"


def _boundary(dsn_id: str, parts: list[bytes]) -> bytes:
    """A boundary that occurs in no part (RFC 2046 5.1.1); the DSN's id keeps it unique."""
    token = re.sub(r"[^A-Za-z0-9]", "", dsn_id)[:40]
    candidates = (f"=_{token}_{n}".encode() for n in count())
    return next(b for b in candidates if all(b not in part for part in parts))


def _date(epoch: float) -> str:
    """RFC 5322 date-time in UTC with a numeric zone (+0000), as RFC 3464 requires."""
    return format_datetime(datetime.fromtimestamp(epoch, UTC))
