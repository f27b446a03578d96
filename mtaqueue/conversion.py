"""Make a message's content legal for one hop (pure: bytes and capabilities in, bytes out):
`prepare(content, eightbitmime=)` gives `Prepared` (the content to send, and whether it
needs BODY=8BITMIME) or `Refused` (5.6.3). The delivery client (smtp/client.py) sends
what it gives; DKIM signing (dkim/signer.py) signs it in the form no hop changes.

SMTP carries lines of at most 998 octets (RFC 5321 4.5.3.1.6), and octets above 127 only to
a server that offers 8BITMIME (RFC 6152), never NUL or a bare CR or LF. Mail can arrive
with any of those (an app's minified HTML, 1001 recipients on one To: line, 8-bit text from
a client that never said BODY=8BITMIME). Before it goes out:

- content that is already legal for the hop goes byte for byte as it is (so a DKIM
  signature, later, survives);
- a header line over 998 octets is folded before whitespace, at 78 where it can be
  (RFC 5322 2.2.3; unfolding gives the field back); a run without whitespace is broken
  with CRLF SPACE, as Postfix does (smtp_line_length_limit);
- a leaf body part that cannot go as it is (a long line, 8-bit for a 7-bit hop, NUL, a
  bare CR or LF) is re-encoded: quoted-printable when it was 7bit/8bit/binary or had no
  Content-Transfer-Encoding (decoding gives the same octets), re-wrapped when it was
  already quoted-printable or base64; multipart/* and message/rfc822 are converted part
  by part, as Postfix's MIME output conversion does;
- what cannot be made legal is refused with 5.6.3 (RFC 3463: conversion required but not
  supported): 8-bit in a header for a 7-bit hop (RFC 2047 would change what the fields
  say), another encoding or media type whose content would have to change.

Postfix sends a non-MIME 8-bit message raw to a 7-bit hop; here it becomes MIME (a
quoted-printable text/plain, charset utf-8 when it decodes as such, else RFC 1428's
unknown-8bit), which RFC 6152 asks for.
"""

from __future__ import annotations

import binascii
import email.policy
import re
from email.message import Message
from email.parser import BytesHeaderParser

import msgspec

MAX_LINE = 998  # octets, without the CRLF
_FOLD = 78  # RFC 5322's SHOULD, for a header field we refold anyway
_QP_LINE = 76  # RFC 2045 6.7 (5), with the "=" of a soft line break
_NESTING = 100  # as Postfix's mime_nesting_limit
_IDENTITY = ("", "7bit", "8bit", "binary")
# The only message/* types that may be encoded like any leaf (RFC 6532 3.5, RFC 6533); the
# others' content must stay 7bit/8bit (RFC 2046 5.2).
_ENCODABLE_MESSAGES = (
    "message/global",
    "message/global-headers",
    "message/global-delivery-status",
    "message/global-disposition-notification",
)
_FIELD = re.compile(rb"[\x21-\x39\x3b-\x7e]+[ \t]*:")
_CTE = re.compile(rb"content-transfer-encoding[ \t]*:", re.IGNORECASE)
_WSP = b" \t"
_BARE = re.compile(rb"\0|\r(?!\n)|(?<!\r)\n")


class Prepared(msgspec.Struct, frozen=True):
    content: bytes
    eight_bit: bool  # octets above 127 remain: send BODY=8BITMIME


class Refused(msgspec.Struct, frozen=True):
    status: str  # enhanced status code for the bounce
    reason: str


class _Unconvertible(Exception):
    pass


def prepare(content: bytes, *, eightbitmime: bool) -> Prepared | Refused:
    """`content` as it may go to a hop that offers 8BITMIME (or not)."""
    try:
        converted = _entity(content, seven_bit=not eightbitmime, default="text/plain", depth=0)
    except _Unconvertible as exc:
        return Refused("5.6.3", f"conversion required but not possible: {exc}")
    return Prepared(converted, not converted.isascii())


def _legal(data: bytes, *, seven_bit: bool) -> bool:
    """CRLF lines of at most 998 octets, no NUL, and 7-bit if it must be."""
    if (seven_bit and not data.isascii()) or b"\0" in data:
        return False
    crlf = data.count(b"\r\n")
    if data.count(b"\r") != crlf or data.count(b"\n") != crlf:
        return False
    return max(map(len, data.split(b"\r\n"))) <= MAX_LINE


# -- one entity: a message, or a body part ------------------------------------------------


def _entity(
    data: bytes, *, seven_bit: bool, default: str, depth: int, message: bool = True
) -> bytes:
    """Convert a header section and its body; `message` for a whole message (top level or
    message/rfc822), whose MIME-Version says whether it is MIME at all."""
    if _legal(data, seven_bit=seven_bit):
        return data
    if depth > _NESTING:
        raise _Unconvertible("MIME nesting too deep")
    header, separator, body = _split(data)
    fields = BytesHeaderParser(policy=email.policy.compat32).parsebytes(header)
    fields.set_default_type(default)
    ctype = fields.get_content_type()
    cte = str(fields.get("content-transfer-encoding", "")).strip().lower()
    header = _header(header, seven_bit=seven_bit)
    if body == b"" or _legal(body, seven_bit=seven_bit):
        return header + separator + body
    if ctype.startswith("multipart/") and cte in _IDENTITY:
        boundary = _boundary(fields)
        child = "message/rfc822" if ctype == "multipart/digest" else "text/plain"
        body = _multipart(body, boundary, seven_bit=seven_bit, default=child, depth=depth)
        return _relabel(header, cte, seven_bit, body) + separator + body
    if ctype == "message/rfc822" and cte in _IDENTITY:
        body = _entity(body, seven_bit=seven_bit, default="text/plain", depth=depth + 1)
        return _relabel(header, cte, seven_bit, body) + separator + body
    if ctype.startswith("message/") and ctype not in _ENCODABLE_MESSAGES:
        raise _Unconvertible(f"{ctype} content cannot be re-encoded")
    if cte in _IDENTITY:
        if message and "mime-version" not in fields:
            header = _make_mime(header, fields, body)
        # A header followed by the body without a blank line gets one with the new field.
        return _set_cte(header, b"quoted-printable") + (separator or b"\r\n") + _qp(body)
    if cte == "quoted-printable":
        return header + separator + _qp(binascii.a2b_qp(body))
    if cte == "base64":
        return header + separator + _rewrap_base64(body)
    raise _Unconvertible(f"{cte or ctype} content cannot be re-encoded")


def _split(data: bytes) -> tuple[bytes, bytes, bytes]:
    """(header section with its last CRLF, the blank line, body). A line that is neither a
    field nor a continuation ends the header without a blank line (the body starts there)."""
    pos = 0
    while pos < len(data):
        end = data.find(b"\r\n", pos)
        line = data[pos : end if end >= 0 else len(data)]
        if not line:
            return data[:pos], b"\r\n", data[pos + 2 :]
        if not (_FIELD.match(line) or (pos and line[:1] in (b" ", b"\t"))):
            return data[:pos], b"", data[pos:]
        if end < 0:
            return data, b"", b""
        pos = end + 2
    return data, b"", b""


def _boundary(fields: Message) -> bytes:
    boundary = fields.get_param("boundary")
    if isinstance(boundary, tuple):  # RFC 2231
        boundary = email.utils.collapse_rfc2231_value(boundary)
    if not boundary or not boundary.isascii():
        raise _Unconvertible("multipart without a usable boundary")
    return boundary.encode()


# -- header sections --------------------------------------------------------------------


def _header(header: bytes, *, seven_bit: bool) -> bytes:
    if seven_bit and not header.isascii():
        name = next(line for line in header.split(b"\r\n") if not line.isascii())
        name = name.split(b":", 1)[0].decode("ascii", "replace")
        raise _Unconvertible(f"8-bit characters in a header ({name}) for a 7-bit server")
    # A NUL, bare CR or LF cannot be sent, and a line end would start a field of its own
    # at the next hop: a space, as Postfix's cleanup makes of them.
    header = _BARE.sub(b" ", header)
    lines = header.split(b"\r\n")
    if max(map(len, lines)) <= MAX_LINE:
        return header
    return b"\r\n".join(_fold(line) for line in lines)


def _fold(line: bytes) -> bytes:
    """One over-long header line, folded (see the module docstring)."""
    if len(line) <= MAX_LINE:
        return line
    # Not between the field name and the first word of its value.
    colon = line.find(b":") + 1
    floor = len(line) - len(line[colon:].lstrip(_WSP))
    pieces = []
    while len(line) > _FOLD:
        cut = _fold_point(line, floor)
        if cut is not None:
            pieces.append(line[:cut])
            line = line[cut:]
        elif len(line) > MAX_LINE:
            cut = MAX_LINE
            while cut > 1 and line[cut] & 0xC0 == 0x80:  # not inside a UTF-8 character
                cut -= 1
            pieces.append(line[:cut])
            line = b" " + line[cut:]
        else:
            break
        floor = 0
    pieces.append(line)
    return b"\r\n".join(pieces)


def _fold_point(line: bytes, floor: int) -> int | None:
    """Where to fold: before the last whitespace within 78 octets, else before the first one
    within 998; after `floor` and never leaving a line of whitespace only (RFC 5322 3.2.2)."""
    start = max(floor, len(line) - len(line.lstrip(_WSP))) + 1
    last = len(line.rstrip(_WSP))
    candidates = [i for i in range(start, min(last, MAX_LINE + 1)) if line[i] in _WSP]
    within = [i for i in candidates if i <= _FOLD]
    if within:
        return within[-1]
    return candidates[0] if candidates else None


def _set_cte(header: bytes, cte: bytes) -> bytes:
    """The header with its Content-Transfer-Encoding field(s) replaced by one saying `cte`."""
    fields = _fields(header)
    new = b"Content-Transfer-Encoding: " + cte + b"\r\n"
    kept = [f for f in fields if not _CTE.match(f)]
    at = next((i for i, f in enumerate(fields) if _CTE.match(f)), len(fields))
    return b"".join([*kept[:at], new, *kept[at:]])


def _relabel(header: bytes, cte: str, seven_bit: bool, body: bytes) -> bytes:
    """A container labelled 8bit or binary whose content is now 7-bit says 7bit."""
    if seven_bit and cte in ("8bit", "binary") and body.isascii():
        return _set_cte(header, b"7bit")
    return header


def _make_mime(header: bytes, fields: Message, body: bytes) -> bytes:
    """A non-MIME message about to get a Content-Transfer-Encoding becomes MIME."""
    added = b"MIME-Version: 1.0\r\n"
    if "content-type" not in fields and not body.isascii():
        charset = b"utf-8" if _is_utf8(body) else b"unknown-8bit"
        added += b"Content-Type: text/plain; charset=" + charset + b"\r\n"
    return header + added


def _fields(header: bytes) -> list[bytes]:
    """The header section as fields, each with its continuation lines and CRLFs."""
    fields: list[bytes] = []
    for line in header.split(b"\r\n")[:-1]:  # it ends with a CRLF
        if fields and line[:1] in (b" ", b"\t"):
            fields[-1] += line + b"\r\n"
        else:
            fields.append(line + b"\r\n")
    return fields


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -- bodies ---------------------------------------------------------------------------------


def _multipart(body: bytes, boundary: bytes, *, seven_bit: bool, default: str, depth: int):
    """Convert each part between the delimiter lines (RFC 2046 5.1.1); the delimiters, the
    CRLF before each (it belongs to the delimiter) and their padding stay as they are."""
    delimiter = re.compile(rb"(?:\A|\r\n)--" + re.escape(boundary) + rb"(--)?[ \t]*(?=\r\n|\Z)")

    def convert(segment: bytes, part: bool) -> bytes:
        if not part:  # the preamble or the epilogue
            return _text(segment, seven_bit=seven_bit)
        # A part starts after its delimiter line's CRLF.
        child = _entity(
            segment[2:], seven_bit=seven_bit, default=default, depth=depth + 1, message=False
        )
        return segment[:2] + child

    out = []
    pos, part = 0, False
    for match in delimiter.finditer(body):
        out += [convert(body[pos : match.start()], part), match[0]]
        pos, part = match.end(), not match[1]
        if match[1]:
            break
    out.append(convert(body[pos:], part))  # the epilogue, or a last part never closed
    return b"".join(out)


def _text(data: bytes, *, seven_bit: bool) -> bytes:
    """A preamble or an epilogue: nobody reads it, but it must be legal too."""
    return data if _legal(data, seven_bit=seven_bit) else _qp(data)


def _qp(data: bytes) -> bytes:
    """Quoted-printable (RFC 2045 6.7) of `data`, whose CRLFs are the line breaks; anything
    else (NUL, a bare CR or LF, 8-bit) is encoded. A line never starts with "-", so that no
    encoded line can look like a boundary delimiter."""
    out = []
    for line in data.split(b"\r\n"):
        # binascii's encoder in binary mode escapes CR and LF; its own soft breaks go, to
        # wrap again below.
        encoded = binascii.b2a_qp(line, istext=False).replace(b"=\n", b"")
        while True:
            if encoded[:1] == b"-":
                encoded = b"=2D" + encoded[1:]
            if len(encoded) <= _QP_LINE:
                break
            cut = _QP_LINE - 1
            escape = encoded.rfind(b"=", cut - 2, cut)  # do not split an =XX
            if escape >= 0:
                cut = escape
            out.append(encoded[:cut] + b"=")
            encoded = encoded[cut:]
        out.append(encoded)
    return b"\r\n".join(out)


def _rewrap_base64(body: bytes) -> bytes:
    """Base64 in lines of 76. Decoders ignore whatever is not in its alphabet (RFC 2045
    6.8): line breaks, and the 8-bit or NUL octets that made it illegal."""
    text = re.sub(rb"[^A-Za-z0-9+/=]", b"", body)
    ending = b"\r\n" if body.endswith(b"\r\n") else b""
    lines = [text[i : i + _QP_LINE] for i in range(0, len(text), _QP_LINE)]
    return b"\r\n".join(lines) + ending
